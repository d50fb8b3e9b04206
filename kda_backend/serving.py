"""What an engine adapter calls once per layer, when the layer's weights are final: plan, projection, kernels."""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch

from kda_backend.planning import resolve_plan
from kda_backend.projection import KDAProjection
from kda_backend.weights import ProjectionWeights


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
    :raises ValueError: ``batch_sizes`` holds something other than positive integers.
    :param batch_sizes: token counts the engine will run (its CUDA-graph batch sizes): the plan is tuned for them
        where ``KDA_BACKEND_AUTOTUNE=1`` asks for it (see :func:`~kda_backend.planning.resolve_plan`).
    """
    given = list(batch_sizes)
    try:
        sizes = sorted({operator.index(m) for m in given})
    except TypeError:
        sizes = [0]
    if sizes and sizes[0] < 1:
        raise ValueError(f"batch_sizes: {given!r:.200}; accepted: positive integers (token counts per step)")
    plan = resolve_plan(weights.geometry, weights.device, weights.dtype, sizes)
    projection = KDAProjection(weights, plan, aux_stream=aux_stream)
    if weights.device.type == "cuda":
        projection.prepare(sorted(set(plan.steps) | set(sizes)) or [1])
    return projection
