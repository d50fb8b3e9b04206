"""The one place ``KDA_BACKEND_*`` environment variables are read.

``ENV_VARS`` is the documented table (README.md renders the same rows; a test keeps the two in sync).
Values are read on every call, so tests and engines can change them at run time.
"""

from __future__ import annotations

import dataclasses
import os


@dataclasses.dataclass(frozen=True)
class EnvVar:
    name: str
    default: str
    meaning: str


ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("KDA_BACKEND_DISABLE", "0", "`1` turns the engine adapters off: nothing is injected into vLLM or SGLang."),
    EnvVar(
        "KDA_BACKEND_BLOCK_PLUGINS",
        "",
        "Comma-separated plugin names (entry-point names or built-in names) not to register.",
    ),
    EnvVar(
        "KDA_BACKEND_PROVIDER",
        "",
        "Force GEMM providers: `name` for every role or `role=name,...` (roles qkvg, fab, fb). "
        "A forced provider that cannot serve a call raises instead of falling back.",
    ),
    EnvVar(
        "KDA_BACKEND_PLAN",
        "",
        "Force the projection plan: `sequential` or `overlap` (every M), or the path of a plan JSON file.",
    ),
    EnvVar(
        "KDA_BACKEND_AUTOTUNE",
        "0",
        "`1`: when no stored plan matches this device, tune one at load time (about five minutes on an H200) and "
        "store it.",
    ),
    EnvVar("KDA_BACKEND_CACHE_DIR", "", "Autotune/compile cache folder; default: the host's choice, else `~/.cache/kda_backend`."),
    EnvVar("KDA_BACKEND_LOG_LEVEL", "INFO", "Level of the `kda_backend` logger (DEBUG, INFO, WARNING, ...)."),
    EnvVar(
        "KDA_BACKEND_FORCE_ENGINE_VERSION",
        "0",
        "`1` lets an adapter inject into an engine version it was not tested with.",
    ),
)

_BY_NAME = {v.name: v for v in ENV_VARS}


def get(name: str) -> str:
    """Raw value of a documented variable (its default when unset)."""
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a documented KDA_BACKEND_* variable; add it to ENV_VARS") from None
    return os.environ.get(name, var.default)


def flag(name: str) -> bool:
    """A boolean variable: ``1``, ``true``, ``yes``, ``on`` (any case) mean true."""
    return get(name).strip().lower() in {"1", "true", "yes", "on"}


def name_list(name: str) -> list[str]:
    """A comma-separated variable as a list of stripped, non-empty names."""
    return [part.strip() for part in get(name).split(",") if part.strip()]
