"""Which plan a projection runs: forced by the environment, stored for this device, tuned now, or the safe default.

Order: ``KDA_BACKEND_PLAN`` (``sequential``, ``overlap`` or a plan file) > the stored plan for this device key >
tuning now when ``KDA_BACKEND_AUTOTUNE=1`` (then stored) > sequential cuBLAS with one warning. The result passes
through the ``kda_share_plan`` hook so every tensor-parallel rank runs the same plan.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch

from kda_backend import env, plan_store
from kda_backend.batch_sizes import MAX_TUNED_M, spans
from kda_backend.geometry import KDAGeometry
from kda_backend.log import get_logger, warn_once
from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step
from kda_backend.plan_store import TacticTable
from kda_backend.plugins import hooks

FORCED_MAX_M = 256

# Every layer of a model asks for the same plan: resolve (and broadcast) it once per process and key.
_resolved: dict[tuple, Plan] = {}


def forced_plan() -> tuple[Plan, TacticTable] | None:
    """The plan ``KDA_BACKEND_PLAN`` names, if any."""
    value = env.get("KDA_BACKEND_PLAN").strip()
    if not value:
        return None
    if value == "sequential":
        return Plan.uniform(FORCED_MAX_M, Step(overlap=False), source="env:sequential"), {}
    if value == "overlap":
        return Plan.uniform(FORCED_MAX_M, Step(overlap=True), source="env:overlap"), {}
    loaded = plan_store.load_file(Path(value))
    if loaded is None:
        raise ValueError(f"KDA_BACKEND_PLAN={value!r}: not 'sequential', 'overlap' or a readable plan file")
    return loaded


def resolve_plan(
    geometry: KDAGeometry, device: torch.device, dtype: torch.dtype = torch.bfloat16, batch_sizes: Iterable[int] = ()
) -> Plan:
    """The plan for one rank's projection on ``device`` (installs tuned CuTe tactics as a side effect); resolved
    once per process for each geometry, device, dtype, batch sizes, forced plan, autotune switch and cache folder.

    :param batch_sizes: the token counts the host engine runs (its CUDA-graph batch sizes). With
        ``KDA_BACKEND_AUTOTUNE=1`` a plan that lacks any of them (up to :data:`MAX_TUNED_M`) is tuned for exactly
        those and the ones it had; otherwise the M it lacks borrow the next larger tuned M's step (said once).
    """
    sizes = tuple(sorted({int(m) for m in batch_sizes}))
    key = (geometry, str(device), dtype, sizes, env.get("KDA_BACKEND_PLAN"), env.get("KDA_BACKEND_AUTOTUNE"),
           str(hooks.cache_dir()))
    if key not in _resolved:
        _resolved[key] = _resolve(geometry, device, dtype, sizes)
    return _resolved[key]


def _resolve(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...]) -> Plan:
    from kda_backend.autotune import DEFAULT_MS, autotune, install_tactics

    found = forced_plan()
    if found is None and device.type != "cuda":
        return Plan(source="cpu")
    if found is None:
        key = plan_store.device_key(geometry, device, dtype)
        found = plan_store.load(key)
        missing = _untuned(found[0], sizes) if found is not None else sizes
        if (found is None or missing) and env.flag("KDA_BACKEND_AUTOTUNE"):
            ms = sorted({*(found[0].steps if found else ()), *(m for m in sizes if m <= MAX_TUNED_M)}) or DEFAULT_MS
            get_logger().info("tuning the plan for %s tp%d at M = %s", key["device"], geometry.tp_size, spans(ms))
            found = autotune(geometry, device, ms)
            path = plan_store.save(key, *found)
            get_logger().info("plan stored in %s", path)
    if found is None:
        warn_once(
            f"no-plan-{geometry}",
            f"no tuned plan for {torch.cuda.get_device_name(device)} tp{geometry.tp_size}: running sequential "
            "cuBLAS; run `kda-backend autotune` (or set KDA_BACKEND_AUTOTUNE=1) for the fast path",
        )
        found = Plan(source="default (no tuned plan)", fallback=SEQUENTIAL_TORCH), {}
    plan, tactics = share(*found)
    install_tactics(tactics)
    _report_coverage(plan, sizes)
    return plan


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
                  f"tuned M ({plan.max_m}): they run its fallback ({plan.fallback.mode}, qkvg={plan.fallback.qkvg})")


def share(plan: Plan, tactics: TacticTable) -> tuple[Plan, TacticTable]:
    """Pass a plan and its tactics through ``kda_share_plan`` (rank 0's answer wins on every rank)."""
    shared = hooks.share_plan({"plan": plan.to_json(), "tactics": plan_store.tactics_to_json(tactics)})
    return Plan.from_json(shared["plan"]), plan_store.tactics_from_json(shared["tactics"])
