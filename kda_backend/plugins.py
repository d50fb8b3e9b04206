"""The plugin manager and a typed facade over ``pm.hook``.

External plugins come from the ``kda_backend`` entry-point group (provider packages) or from
:func:`register_plugin` (engine adapters register their host plugin at activation time).
``KDA_BACKEND_BLOCK_PLUGINS`` names plugins that must not be registered; built-in plugins cannot be blocked
because they are the guaranteed fallback.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import pluggy
import torch

from kda_backend import env, hookspecs
from kda_backend.builtin_plugins import builtin_plugins
from kda_backend.log import warn_once
from kda_backend.providers.base import GemmProvider

ENTRY_POINT_GROUP = "kda_backend"

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None


def _build_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = set(env.name_list("KDA_BACKEND_BLOCK_PLUGINS"))
    builtins = builtin_plugins()
    for name, plugin in builtins.items():
        if name in blocked:
            warn_once(f"block-builtin-{name}", f"built-in plugin {name!r} cannot be blocked; keeping it")
        pm.register(plugin, name=name)
    for name in blocked - set(builtins):
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(ENTRY_POINT_GROUP)
    pm.check_pending()
    return pm


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _build_manager()
        return _manager


def register_plugin(plugin: object, name: str) -> bool:
    """Register an external plugin once; returns False if blocked or already registered under ``name``."""
    pm = get_plugin_manager()
    with _lock:
        if pm.is_blocked(name) or pm.get_plugin(name) is not None:
            return False
        pm.register(plugin, name=name)
        pm.check_pending()
        hooks.invalidate()
        return True


def unregister_plugin(name: str) -> None:
    """Remove a plugin registered with :func:`register_plugin` (no-op if absent)."""
    pm = get_plugin_manager()
    with _lock:
        if pm.get_plugin(name) is not None:
            pm.unregister(name=name)
            hooks.invalidate()


def reset_plugin_manager() -> None:
    """Forget the manager so the next use rebuilds it (tests; changed environment)."""
    global _manager
    with _lock:
        _manager = None
        hooks.invalidate()


class Hooks:
    """Typed calls of every hook; results that cannot be missing raise when no plugin answered."""

    def __init__(self) -> None:
        self._providers: list[GemmProvider] | None = None

    def invalidate(self) -> None:
        self._providers = None

    @property
    def _hook(self) -> Any:
        return get_plugin_manager().hook

    def gemm_providers(self) -> list[GemmProvider]:
        """All providers, highest priority first (stable for equal priorities); cached until plugins change."""
        with _lock:
            if self._providers is None:
                found = [p for batch in self._hook.kda_gemm_providers() for p in batch]
                self._providers = sorted(found, key=lambda p: -p.priority)
            return list(self._providers)

    def fork_allowed(self, device: torch.device) -> bool:
        return bool(self._hook.kda_host_fork_allowed(device=device))

    def aux_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._hook.kda_host_aux_stream(device=device)
        if stream is None:
            raise RuntimeError(f"no plugin provided an auxiliary stream for {device}")
        return stream

    def cache_dir(self) -> Path:
        override = env.get("KDA_BACKEND_CACHE_DIR")
        path = Path(override) if override else self._hook.kda_autotune_cache_dir()
        return Path(os.path.expanduser(path))

    def share_plan(self, plan: dict[str, Any]) -> dict[str, Any]:
        shared = self._hook.kda_share_plan(plan=plan)
        if shared is None:
            raise RuntimeError("no plugin answered kda_share_plan")
        return shared


hooks = Hooks()


def plugin_names() -> list[str]:
    """Names of registered plugins (for ``kda-backend doctor``)."""
    pm = get_plugin_manager()
    return sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None)

