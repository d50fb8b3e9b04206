"""Which plan a projection runs: forced by the environment, stored for this device, tuned now, or the safe default.

Order: ``KDA_BACKEND_PLAN`` (``sequential``, ``overlap`` or a plan file) > the stored plan for this device key >
tuning now when ``KDA_BACKEND_AUTOTUNE=1`` (then stored) > sequential cuBLAS with one warning. The result passes
through the ``kda_share_plan`` hook so every tensor-parallel rank runs the same plan.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kda_backend import env, plan_store
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


def resolve_plan(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> Plan:
    """The plan for one rank's projection on ``device`` (installs tuned CuTe tactics as a side effect); resolved
    once per process for each geometry, device, dtype, forced plan and cache folder."""
    key = (geometry, str(device), dtype, env.get("KDA_BACKEND_PLAN"), str(hooks.cache_dir()))
    if key not in _resolved:
        _resolved[key] = _resolve(geometry, device, dtype)
    return _resolved[key]


def _resolve(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype) -> Plan:
    from kda_backend.autotune import autotune, install_tactics

    found = forced_plan()
    if found is None and device.type != "cuda":
        return Plan(source="cpu")
    if found is None:
        key = plan_store.device_key(geometry, device, dtype)
        found = plan_store.load(key)
        if found is None and env.flag("KDA_BACKEND_AUTOTUNE"):
            get_logger().info("no stored plan for %s tp%d: tuning now", key["device"], geometry.tp_size)
            found = autotune(geometry, device)
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
    return plan


def share(plan: Plan, tactics: TacticTable) -> tuple[Plan, TacticTable]:
    """Pass a plan and its tactics through ``kda_share_plan`` (rank 0's answer wins on every rank)."""
    shared = hooks.share_plan({"plan": plan.to_json(), "tactics": plan_store.tactics_to_json(tactics)})
    return Plan.from_json(shared["plan"]), plan_store.tactics_from_json(shared["tactics"])
