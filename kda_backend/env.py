"""The one place ``KDA_BACKEND_*`` environment variables are read, each parsed strictly.

``ENV_VARS`` is the documented table (README.md renders the same rows, :func:`markdown_rows`; a test keeps the two
equal). Values are read where they are used, so tests and engines can change them at run time: most on every call,
``KDA_BACKEND_LOG_LEVEL`` when the logger is set up and ``KDA_BACKEND_BLOCK_PLUGINS`` when the plugin manager is
built. A value outside what a variable accepts raises :class:`EnvError` naming the variable, the value and what
is accepted; a ``KDA_BACKEND_*`` name that is not in the table (a misspelt variable) is warned about once.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os

PREFIX = "KDA_BACKEND_"
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


class EnvError(ValueError):
    """A ``KDA_BACKEND_*`` variable holds a value it does not accept."""


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One variable: ``kind`` says how its value is parsed (``flag``: :func:`flag`; ``level``: :func:`log_level`;
    ``text``: used as given, checked where it is used)."""

    name: str
    default: str
    meaning: str
    kind: str = "text"


_FLAG = "`1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off` (any case; empty is `0`); any other value is an error."

ENV_VARS: tuple[EnvVar, ...] = (
    EnvVar("KDA_BACKEND_DISABLE", "0", "`1` turns the engine adapters off: vLLM and SGLang build their own layers "
           "and the core is not imported (vLLM's Kimi-K3 registry entries stay wrapped, to read this switch when the "
           f"model class loads). {_FLAG}", "flag"),
    EnvVar(
        "KDA_BACKEND_BLOCK_PLUGINS",
        "",
        "Comma-separated names of plugins not to register: entry-point plugins, the engine host plugins "
        "(`vllm-host`, `sglang-host`) or any name given to `register_plugin`; a built-in plugin's name (it stays "
        "registered) and a name no installed plugin has are warned about.",
    ),
    EnvVar(
        "KDA_BACKEND_PROVIDER",
        "",
        "Force GEMM providers: one registered `name` for every role, or `role=name,...` (roles qkvg, fab, fb, each "
        "at most once); anything else is an error. A pin wins over a plan's provider (one warning where they "
        "differ); a forced provider that cannot serve a call raises instead of falling back.",
    ),
    EnvVar(
        "KDA_BACKEND_PLAN",
        "",
        "Force the projection plan: `sequential` or `overlap` (every M up to 256), or the path of a plan JSON file "
        "written by `kda-backend autotune` for this GPU and geometry (another GPU, TP size or dtype is an error).",
    ),
    EnvVar(
        "KDA_BACKEND_AUTOTUNE",
        "0",
        "`1`: when no stored plan matches this device, or the stored one lacks a batch size the engine captures, "
        "tune one at load time (about 8-11 minutes on an H200 at TP8) and store it; where tuning fails, the stored "
        f"plan or the engine's own path serves, with one warning. {_FLAG}",
        "flag",
    ),
    EnvVar("KDA_BACKEND_CACHE_DIR", "", "Autotune/compile cache folder; default: the host's choice, else "
           "`~/.cache/kda_backend`. A path that is a file, a dangling symbolic link or a link loop is an error."),
    EnvVar("KDA_BACKEND_LOG_LEVEL", "INFO", "Level of the `kda_backend` logger: DEBUG, INFO, WARNING, ERROR or "
           "CRITICAL (any case); another value logs one warning and keeps INFO.", "level"),
    EnvVar(
        "KDA_BACKEND_FORCE_ENGINE_VERSION",
        "0",
        f"`1` lets an adapter inject into an engine version it was not tested with. {_FLAG}",
        "flag",
    ),
)

_BY_NAME = {v.name: v for v in ENV_VARS}


def get(name: str) -> str:
    """Raw value of a documented variable (its default when unset); the first read warns about misspelt names."""
    value = _raw(name)
    warn_unknown()
    return value


def _raw(name: str) -> str:
    try:
        var = _BY_NAME[name]
    except KeyError:
        raise KeyError(f"{name} is not a documented KDA_BACKEND_* variable; add it to ENV_VARS") from None
    return os.environ.get(name, var.default)


def flag(name: str) -> bool:
    """A boolean variable: one of :data:`TRUE` or :data:`FALSE` (any case, surrounding blanks ignored).

    :raises EnvError: any other value.
    """
    value = get(name)
    word = value.strip().lower()
    if word in TRUE:
        return True
    if word in FALSE or not word:
        return False
    raise EnvError(f"{name}={value!r}: not a boolean; accepted: {', '.join(TRUE)} or {', '.join(FALSE)} (any case)")


def name_list(name: str) -> list[str]:
    """A comma-separated variable as a list of stripped, non-empty names."""
    return [part.strip() for part in get(name).split(",") if part.strip()]


def log_level() -> tuple[int, str | None]:
    """``KDA_BACKEND_LOG_LEVEL`` as a :mod:`logging` level, and ``None`` or the problem with its value (then the
    level is INFO: a logger must come up whatever its variable says, to say so)."""
    value = _raw("KDA_BACKEND_LOG_LEVEL")  # read by the logger itself, so it cannot warn through it
    word = value.strip().upper()
    if word in LOG_LEVELS:
        return getattr(logging, word), None
    return logging.INFO, (f"KDA_BACKEND_LOG_LEVEL={value!r}: not a log level; accepted: {', '.join(LOG_LEVELS)} "
                          "(any case); using INFO")


def unknown_names() -> list[str]:
    """``KDA_BACKEND_*`` names set in the environment that are not documented variables."""
    return sorted(n for n in os.environ if n.startswith(PREFIX) and n not in _BY_NAME)


def warn_unknown() -> None:
    """Warn once per name about each undocumented ``KDA_BACKEND_*`` variable (a misspelling would otherwise go
    unnoticed)."""
    from kda_backend.log import warn_once  # the logger reads this module's variables

    for name in unknown_names():
        warn_once(f"env-unknown-{name}", _unknown_message(name))


def _unknown_message(name: str) -> str:
    close = difflib.get_close_matches(name, _BY_NAME, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{name} is not a kda-backend variable and is ignored; {hint}known: {', '.join(_BY_NAME)}"


def problems() -> dict[str, str]:
    """Variable name -> what is wrong with its value, for every set variable whose format alone is wrong
    (``kda-backend doctor``; the values that need the plugins or the device are checked where they are used)."""
    found = {name: _unknown_message(name) for name in unknown_names()}
    for var in ENV_VARS:
        if var.name not in os.environ:
            continue
        if var.kind == "flag":
            try:
                flag(var.name)
            except EnvError as exc:
                found[var.name] = str(exc)
        elif var.kind == "level" and log_level()[1]:
            found[var.name] = log_level()[1]
    return found


def markdown_rows() -> list[str]:
    """The README's environment table rows, one per :data:`ENV_VARS` entry."""
    return [f"| `{v.name}` | {f'`{v.default}`' if v.default else '(unset)'} | {v.meaning} |" for v in ENV_VARS]
