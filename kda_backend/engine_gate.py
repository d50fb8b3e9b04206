"""What every engine adapter checks before touching its engine: the kill switch and the tested version."""

from __future__ import annotations

import importlib.metadata
from typing import Any

from kda_backend import env
from kda_backend.log import get_logger


def adapter_enabled(engine: str, tested: str) -> bool:
    """False (with one log line) when ``KDA_BACKEND_DISABLE`` is set or ``engine``'s installed version does not
    start with ``tested`` and ``KDA_BACKEND_FORCE_ENGINE_VERSION`` is not set."""
    log = get_logger()
    if env.flag("KDA_BACKEND_DISABLE"):
        log.info("%s plugin disabled by KDA_BACKEND_DISABLE", engine)
        return False
    version = importlib.metadata.version(engine)
    if not version.startswith(tested) and not env.flag("KDA_BACKEND_FORCE_ENGINE_VERSION"):
        log.warning(
            "%s %s is untested (tested: %s); not injecting (KDA_BACKEND_FORCE_ENGINE_VERSION=1 forces it)",
            engine, version, tested,
        )
        return False
    return True


def broadcast_from_rank0(parallel_state: Any, plan: dict[str, Any]) -> dict[str, Any] | None:
    """Rank 0's ``plan`` over the engine's tensor-parallel group; vLLM and SGLang share this ``parallel_state``
    API. ``None`` when the engine has no model-parallel state (the next plugin answers)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    group = parallel_state.get_tp_group()
    return plan if group.world_size == 1 else group.broadcast_object(plan, src=0)
