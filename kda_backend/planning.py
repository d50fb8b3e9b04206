"""Which plan a projection runs: forced by the environment, stored for this device, tuned now, or the safe default.

Order: ``KDA_BACKEND_PLAN`` (``sequential``, ``overlap`` or a plan file) > the stored plan for this device key >
tuning now when ``KDA_BACKEND_AUTOTUNE=1`` (then stored; where tuning fails, the stored plan, with one warning) > no
steps, with one warning: an engine adapter keeps the engine's own path at every M
(:meth:`~kda_backend.plan.Plan.covers`), a standalone projection runs sequential cuBLAS.
The result passes through the ``kda_share_plan`` hook so every tensor-parallel rank runs the same plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from kda_backend import env, plan_store
from kda_backend.batch_sizes import MAX_TUNED_M, spans
from kda_backend.geometry import KDAGeometry
from kda_backend.log import get_logger, warn_once
from kda_backend.plan import SEQUENTIAL_TORCH, Plan, PlanError, Step
from kda_backend.plugins import hooks

FORCED_MAX_M = 256

# Key fields a forced plan file may differ in with one warning: the plan stays valid for the same device and
# geometry, though its timings were taken with other versions.
VERSION_FIELDS = ("kda_backend", "torch", "cutlass_dsl")

# Every layer of a model asks for the same plan: resolve (and broadcast) it once per process and key.
_resolved: dict[tuple, Plan] = {}


def forced_plan(key: dict[str, Any] | None = None) -> Plan | None:
    """The plan ``KDA_BACKEND_PLAN`` names, if any.

    :param key: what a plan file must have been made for (:func:`expected_key`); ``None`` checks no key.
    :raises ValueError: the value is neither ``sequential``, ``overlap`` nor a readable plan file, or the file was
        made for another device, geometry or dtype (naming the file's and this key's fields). Other versions of
        the package, torch or the CuTe DSL are warned about once.
    """
    value = env.get("KDA_BACKEND_PLAN").strip()
    if not value:
        return None
    if value == "sequential":
        return Plan.uniform(FORCED_MAX_M, Step(overlap=False), source="env:sequential")
    if value == "overlap":
        return Plan.uniform(FORCED_MAX_M, Step(overlap=True), source="env:overlap")
    accepted = "accepted: 'sequential', 'overlap' or the path of a plan file written by `kda-backend autotune`"
    try:
        found, plan = plan_store.read_file(Path(value))
    except FileNotFoundError:
        raise ValueError(f"KDA_BACKEND_PLAN={value!r}: no such file; {accepted}") from None
    except OSError as exc:
        raise ValueError(f"KDA_BACKEND_PLAN={value!r}: cannot read it ({exc.strerror or exc}); {accepted}") from None
    except PlanError as exc:
        raise ValueError(f"KDA_BACKEND_PLAN={value!r}: not a plan file ({exc}); {accepted}") from None
    if key is not None:
        differences = plan_store.key_differences(found, key, exact=False)
        hard = [d for d in differences if d.split(":")[0] not in VERSION_FIELDS]
        if hard:
            raise ValueError(f"KDA_BACKEND_PLAN={value!r}: made for another device, geometry or dtype "
                             f"({'; '.join(hard)}); accepted: a plan file made for this key {key}")
        if differences:
            warn_once(f"forced-versions-{value}", f"KDA_BACKEND_PLAN={value!r} was tuned with other versions "
                      f"({'; '.join(differences)}); serving it (`kda-backend autotune` re-tunes it)")
    return plan


def expected_key(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """What a forced plan file must match: the full device key on CUDA; elsewhere (no device to name) the
    geometry and dtype."""
    if device.type == "cuda":
        return plan_store.device_key(geometry, device, dtype)
    return {"geometry": geometry.describe(), "dtype": str(dtype)}


def resolve_plan(
    geometry: KDAGeometry, device: torch.device, dtype: torch.dtype = torch.bfloat16, batch_sizes: Iterable[int] = ()
) -> Plan:
    """The plan (with its CuTe tactics) for one rank's projection on ``device``; resolved
    once per process for each geometry, device, dtype, batch sizes, forced plan, autotune switch and cache folder.

    :param batch_sizes: the token counts the host engine runs (its CUDA-graph batch sizes). With
        ``KDA_BACKEND_AUTOTUNE=1`` a plan that lacks any of them (up to :data:`MAX_TUNED_M`) is tuned for exactly
        those and the ones it had; otherwise the M it lacks borrow the next larger tuned M's step (said once).
    """
    sizes = tuple(sorted({int(m) for m in batch_sizes}))
    key = (geometry, str(device), dtype, sizes, env.get("KDA_BACKEND_PLAN"), env.flag("KDA_BACKEND_AUTOTUNE"),
           str(hooks.cache_dir()))
    if key not in _resolved:
        _resolved[key] = _resolve(geometry, device, dtype, sizes)
    return _resolved[key]


def _resolve(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> Plan:
    from kda_backend.autotune import DEFAULT_MS

    found, tuned = forced_plan(expected_key(geometry, device, dtype)), False
    if found is None and device.type != "cuda":
        # Every M up to the forced plans' bound, on the providers that serve a CPU (torch).
        return Plan.uniform(FORCED_MAX_M, Step(overlap=False), source="cpu")
    if found is None:
        key = plan_store.device_key(geometry, device, dtype)
        found = plan_store.load(key)
        missing = _untuned(found, sizes) if found is not None else sizes
        if (found is None or missing) and env.flag("KDA_BACKEND_AUTOTUNE"):
            ms = sorted({*(found.steps if found else ()), *(m for m in sizes if m <= MAX_TUNED_M)}) or DEFAULT_MS
            get_logger().info("tuning the plan for %s tp%d at M = %s", key["device"], geometry.tp_size, spans(ms))
            found, tuned = _tuned_or_kept(geometry, device, ms, key, found)
    if found is None:
        warn_once(
            f"no-plan-{geometry}",
            f"no tuned plan for {torch.cuda.get_device_name(device)} tp{geometry.tp_size}: an engine keeps its own "
            "path at every batch size (a standalone projection runs sequential cuBLAS); run `kda-backend autotune` "
            "(or set KDA_BACKEND_AUTOTUNE=1) for the fast path",
        )
        found = Plan(source="default (no tuned plan)", fallback=SEQUENTIAL_TORCH)
    plan = share(found)
    if tuned and plan.steps:
        # Every rank tuned on its own GPU; what every rank serves, and what the next start reads, is rank 0's plan:
        # stored after the broadcast (the same file from every rank), never this rank's own.
        _store(key, plan)
    _report_coverage(plan, sizes)
    return plan


def _tuned_or_kept(
    geometry: KDAGeometry, device: torch.device, ms: list[int], key: dict[str, Any], stored: Plan | None
) -> tuple[Plan, bool]:
    """``(the plan tuned now at ms, True)``. Where tuning fails (a GPU too full beside the engine's weights, a kernel
    that does not build) ``(stored, False)``, or else a plan with no steps (the engine's own path), with one
    warning: a speed-up asked for at load must not stop the engine loading its model."""
    from kda_backend.autotune import autotune

    try:
        # Tuning draws random weights: the host's random state (an engine's sampling) stays as it was.
        with torch.random.fork_rng(devices=[device] if torch.cuda.is_available() else [], device_type="cuda"):
            tuned = autotune(geometry, device, ms)
    except Exception as exc:  # any failure of the optional tuning falls back; the warning names it
        kept = "the stored plan" if stored is not None else "no tuned plan (the engine's own path)"
        warn_once(f"autotune-failed-{key['device']}", f"KDA_BACKEND_AUTOTUNE=1: tuning the plan for {key['device']} "
                  f"tp{geometry.tp_size} failed ({type(exc).__name__}: {exc}); this rank falls back to {kept}, and "
                  "every TP rank serves rank 0's plan. Run `kda-backend autotune` on this GPU before serving: it "
                  "tunes without the engine's weights beside it")
        kept = stored if stored is not None else Plan(source="default (tuning failed)", fallback=SEQUENTIAL_TORCH)
        return kept, False
    return tuned, True


def _store(key: dict[str, Any], plan: Plan) -> None:
    try:
        get_logger().info("plan stored in %s", plan_store.save(key, plan))
    except OSError as exc:  # a read-only cache folder: the tuned plan still serves this process
        warn_once(f"unstored-{key['device']}", f"{exc}; serving the tuned plan without storing it")


def _untuned(plan: Plan, sizes: tuple[int, ...]) -> list[int]:
    return [m for m in sizes if m <= MAX_TUNED_M and not plan.tuned(m)]


def _report_coverage(plan: Plan, sizes: tuple[int, ...]) -> None:
    """Say once which of the host's batch sizes the plan was not tuned for, and what serves them."""
    if not plan.steps:
        return
    borrowed = [m for m in sizes if not plan.tuned(m) and m < plan.max_m]
    beyond = [m for m in sizes if m > plan.max_m]
    if borrowed:
        get_logger().info("batch sizes M = %s were not tuned: each runs the step of the next larger tuned M "
                          "(`kda-backend autotune --ms` or KDA_BACKEND_AUTOTUNE=1 tunes them)", spans(borrowed))
    if beyond:
        warn_once(f"beyond-{plan.max_m}-{beyond}", f"batch sizes M = {spans(beyond)} are above the plan's largest "
                  f"tuned M ({plan.max_m}): the engine keeps its own path for them (a standalone projection runs "
                  f"the plan's fallback, {plan.fallback.mode} with qkvg={plan.fallback.qkvg})")


def share(plan: Plan) -> Plan:
    """Pass a plan with its tactics through ``kda_share_plan`` (rank 0's answer wins on every rank; a plugin that
    answers something else than a plan is dropped, see :class:`~kda_backend.plugins.Hooks`)."""
    return hooks.share_plan(plan.to_document(), parse=plan_store.shared_from_json)
