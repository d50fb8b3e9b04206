"""What an engine adapter calls once per layer, when the layer's weights are final: plan, projection, kernels."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

from kda_backend import dispatch, env
from kda_backend.log import error_once
from kda_backend.plan import Plan
from kda_backend.planning import resolve_plan
from kda_backend.projection import KDAProjection
from kda_backend.weights import ProjectionWeights


# (geometry, device, dtype) -> why this process could not build a projection for it (after the plan was shared).
_failed: dict[tuple, str] = {}


def build_projection(
    weights: ProjectionWeights, *, aux_stream: torch.cuda.Stream | None = None, batch_sizes: Iterable[int] = ()
) -> KDAProjection:
    """The projection of one layer, ready to serve.

    Resolves this rank's plan through the ``kda_share_plan`` hook, which an engine answers with a broadcast over
    its tensor-parallel group: every rank must call this at the same point of model loading (after the engine's
    own post-load weight processing), never from a forward, where a rank that skips the layer would leave the
    others waiting. The plan is resolved once per process and key, so only the first layer communicates.
    On CUDA, compiles the kernels for every M the plan has a step for and for ``batch_sizes`` (the engine's
    CUDA-graph batch sizes), so nothing compiles during capture.

    :param weights: the layer's validated weight views.
    :param aux_stream: the stream the side chain forks onto (``None``: the ``kda_host_aux_stream`` hook's).
    :param batch_sizes: token counts the engine will run (its CUDA-graph batch sizes): the plan is tuned for them
        where ``KDA_BACKEND_AUTOTUNE=1`` asks for it (see :func:`~kda_backend.planning.resolve_plan`).
    :raises ValueError: ``batch_sizes`` holds something other than positive integers.
    """
    sizes = _token_counts(batch_sizes)
    plan = resolve_plan(weights.geometry, weights.device, weights.dtype, sizes)
    return _prepared(weights, plan, aux_stream, sizes)


def serve_layer(
    layer: torch.nn.Module,
    weights: ProjectionWeights,
    *,
    aux_stream: torch.cuda.Stream | None = None,
    batch_sizes: Iterable[int] = (),
) -> KDAProjection | None:
    """What an engine adapter calls for each layer once its weights are final: :func:`build_projection` (same
    arguments and the same rule: every rank, at the same point of loading), its state kept as buffers of ``layer``
    (:func:`keep_state`).

    Where building fails after the plan was resolved and shared (a kernel that does not compile, memory the GPU
    lacks), returns ``None`` with one error: the engine's own projection serves the layer, and this process's
    later layers of the same geometry do not try again. What the user forces (``KDA_BACKEND_PLAN``,
    ``KDA_BACKEND_PROVIDER``) fails loudly instead, as does resolving the plan (alike on every rank, so none is
    left waiting in the plan's broadcast).
    """
    sizes = _token_counts(batch_sizes)
    plan = resolve_plan(weights.geometry, weights.device, weights.dtype, sizes)
    key = (weights.geometry, str(weights.device), weights.dtype)
    if key in _failed:
        return None
    try:
        projection = _prepared(weights, plan, aux_stream, sizes)
    except Exception as exc:  # building is an optional speed-up: the engine's path serves where it fails
        if env.get("KDA_BACKEND_PLAN").strip() or dispatch.forced_providers():
            raise
        _failed[key] = f"{type(exc).__name__}: {exc}"
        error_once(f"serve-layer-{key}", f"kda-backend could not build the KDA projection (tp_size="
                   f"{weights.geometry.tp_size}) on {weights.device}: {_failed[key]}; the engine's own projection "
                   "serves this process's layers")
        return None
    keep_state(layer, projection)
    return projection


def _token_counts(batch_sizes: Iterable[int]) -> list[int]:
    given = list(batch_sizes)
    try:
        sizes = sorted({operator.index(m) for m in given})
    except TypeError:
        sizes = [0]
    if sizes and sizes[0] < 1:
        raise ValueError(f"batch_sizes: {given!r:.200}; accepted: positive integers (token counts per step)")
    return sizes


def _prepared(
    weights: ProjectionWeights, plan: Plan, aux_stream: torch.cuda.Stream | None, sizes: list[int]
) -> KDAProjection:
    projection = KDAProjection(weights, plan, aux_stream=aux_stream)
    if weights.device.type == "cuda":
        projection.prepare(sorted(set(plan.steps) | set(sizes)) or [1])
    return projection


def keep_state(layer: torch.nn.Module, projection: KDAProjection) -> None:
    """Register ``projection``'s :meth:`~KDAProjection.state_buffers` as non-persistent buffers of ``layer`` (an
    engine's module), so an engine that saves and restores its model's buffers around a release of its weights'
    memory restores them too. Non-persistent: no checkpoint or ``state_dict`` sees them; the same tensor on every
    layer is one buffer to ``named_buffers()``."""
    for name, tensor in projection.state_buffers().items():
        layer.register_buffer(name, tensor, persistent=False)
