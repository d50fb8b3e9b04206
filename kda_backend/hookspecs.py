"""The pluggy hook specification: the only way engines and GEMM providers talk to the core.

Project name ``kda_backend``. Built-in answers live in :mod:`kda_backend.builtin_plugins` and are registered
``trylast``, so any external plugin (an engine adapter, a provider package) overrides them. Every hook below is
listed with its exact signature in ``docs/hooks.md``; ``tests/test_hooks_meta.py`` enforces that and that each
hook has a test. Implementations are called one at a time (no hook wrappers) and an external one that raises or
answers outside the contract documented below drops its plugin (see :class:`kda_backend.plugins.Hooks`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pluggy
import torch

from kda_backend.providers.base import GemmProvider

PROJECT_NAME = "kda_backend"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def kda_gemm_providers() -> list[GemmProvider]:
    """Contribute GEMM providers.

    Fires when providers are first needed, and again after a plugin is registered, unregistered or dropped. Every
    implementation's providers are collected; dispatch tries them by descending ``priority`` and ends at the
    built-in torch provider.

    :returns: providers this plugin adds (possibly empty).
    """


@hookspec(firstresult=True)
def kda_host_fork_allowed(device: torch.device) -> bool | None:
    """Whether the projection may fork onto an auxiliary stream right now.

    Fires at every projection forward on CUDA that runs an overlapped step, except the autotuner's candidates,
    which fork exactly while its own timing graphs capture (they time the form decode graphs run). A host engine
    answers ``True`` only while the projection's stream is being captured into a graph whose replay runs the fork
    as captured: a full graph, or the open segment of a breakable one (the projection joins its fork before it
    returns, so the fork never spans a segment boundary); never in eager runs or in code a piecewise graph leaves
    to run eagerly. ``None`` defers to the next plugin.
    The built-in answer is ``torch.cuda.is_current_stream_capturing()``.

    :param device: the device the projection runs on.
    :returns: ``True``/``False``, or ``None`` to defer.
    """


@hookspec(firstresult=True)
def kda_host_aux_stream(device: torch.device) -> torch.cuda.Stream | None:
    """The auxiliary stream the F_A/beta -> F_B chain runs on when the projection forks.

    Fires when a projection first needs its aux stream. The built-in answer creates one stream per device and
    reuses it for every layer.

    :param device: the device the projection runs on.
    :returns: a stream on ``device``, or ``None`` to defer.
    """


@hookspec(firstresult=True)
def kda_autotune_cache_dir() -> Path | None:
    """Folder for autotune plans and compiled kernels.

    Fires whenever the cache is read or written. ``KDA_BACKEND_CACHE_DIR`` wins over every plugin; the built-in
    answer is ``~/.cache/kda_backend``.

    :returns: a folder path (created on demand), or ``None`` to defer.
    """


@hookspec(firstresult=True)
def kda_share_plan(plan: dict[str, Any]) -> dict[str, Any] | None:
    """Make a tuned plan identical on every tensor-parallel rank.

    Fires after a plan is loaded or tuned, before any CUDA graph is captured. A host engine broadcasts rank 0's
    plan over its process group and returns what rank 0 had; the built-in answer (one process) returns ``plan``.

    :param plan: this rank's plan as JSON-compatible data.
    :returns: the plan every rank must use, or ``None`` to defer.
    """
