"""The plugin manager and a typed facade over ``pm.hook``.

External plugins come from the ``kda_backend`` entry-point group (provider packages) or from
:func:`register_plugin` (engine adapters register their host plugin at activation time).
``KDA_BACKEND_BLOCK_PLUGINS`` names plugins that must not be registered; built-in plugins cannot be blocked
because they are the guaranteed fallback.

A plugin cannot take serving down: an entry point that fails to import or register, a hook implementation that
raises or answers outside its contract (see :class:`Hooks`) drops that plugin with one error naming it
(:func:`drop_plugin`, listed by ``kda-backend doctor``), and the other plugins, the built-in ones last, answer.
"""

from __future__ import annotations

import errno
import importlib.metadata as md
import os
import stat
import tempfile
import threading
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pluggy
import torch

from kda_backend import env, hookspecs
from kda_backend.builtin_plugins import builtin_plugins
from kda_backend.log import error_once, warn_once
from kda_backend.providers.base import GemmProvider

ENTRY_POINT_GROUP = "kda_backend"
# Names the engine adapters register their host plugin under (so blocking them is not an unknown name).
HOST_PLUGINS = ("vllm-host", "sglang-host")

_lock = threading.RLock()
_manager: pluggy.PluginManager | None = None
_dropped: dict[str, str] = {}


def _build_manager() -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
    pm.add_hookspecs(hookspecs)
    blocked = set(env.name_list("KDA_BACKEND_BLOCK_PLUGINS"))
    builtins = builtin_plugins(cache_dir=hooks.cache_dir)
    for name, plugin in builtins.items():
        if name in blocked:
            warn_once(f"block-builtin-{name}", f"built-in plugin {name!r} cannot be blocked; keeping it")
        pm.register(plugin, name=name)
    for name in blocked - set(builtins):
        pm.set_blocked(name)
    _load_entry_points(pm, blocked)
    pm.check_pending()
    return pm


def _load_entry_points(pm: pluggy.PluginManager, blocked: set[str]) -> None:
    """Register the plugin of each ``kda_backend`` entry point; one that fails to import or to register is dropped
    (one error naming it) and the rest load. Warns about blocked names that no plugin has."""
    entry_points = md.entry_points(group=ENTRY_POINT_GROUP)
    registered = {name for name, plugin in pm.list_name_plugin() if plugin is not None}  # blocked ones are None
    known = registered | {ep.name for ep in entry_points} | set(HOST_PLUGINS)
    for name in sorted(blocked - known):
        warn_once(f"block-unknown-{name}", f"KDA_BACKEND_BLOCK_PLUGINS names {name!r}, which no installed plugin "
                  f"has (known: {', '.join(sorted(known))}); it blocks only a plugin registered later under that name")
    for ep in entry_points:
        if pm.is_blocked(ep.name) or pm.get_plugin(ep.name) is not None:
            continue
        origin = f"entry point {ep.name} = {ep.value}" + (f" of {ep.dist.name}" if ep.dist else "")
        try:  # a third-party import may fail in any way; only this plugin is lost
            plugin = ep.load()
        except Exception as exc:
            drop_plugin(ep.name, f"{origin} failed to import: {type(exc).__name__}: {exc}", pm)
            continue
        try:
            pm.register(plugin, name=ep.name)
            pm.check_pending()
        except Exception as exc:
            drop_plugin(ep.name, f"{origin} failed to register: {type(exc).__name__}: {exc}", pm)


def get_plugin_manager() -> pluggy.PluginManager:
    """The process-wide plugin manager, built on first use."""
    global _manager
    with _lock:
        if _manager is None:
            _manager = _build_manager()
        return _manager


def register_plugin(plugin: object, name: str) -> bool:
    """Register an external plugin once; returns False if blocked, dropped or already registered under ``name``.

    :raises ValueError: ``name`` is not a non-empty string.
    :raises pluggy.PluginValidationError: ``plugin`` implements a hook that does not exist or with parameters
        its specification lacks (the plugin is left unregistered).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_plugin: name {name!r}; accepted: a non-empty string")
    pm = get_plugin_manager()
    with _lock:
        if pm.is_blocked(name) or pm.get_plugin(name) is not None:
            return False
        pm.register(plugin, name=name)
        try:
            pm.check_pending()
        except pluggy.PluginValidationError:
            pm.unregister(name=name)
            raise
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
        _dropped.clear()
        hooks.invalidate()


def is_builtin(name: str) -> bool:
    """Whether the plugin registered under ``name`` is one of kda-backend's own (never dropped: the fallback)."""
    plugin = get_plugin_manager().get_plugin(name)
    module = plugin.__name__ if isinstance(plugin, types.ModuleType) else type(plugin).__module__
    return plugin is not None and module.split(".")[0] == "kda_backend"


def drop_plugin(name: str, problem: str, pm: pluggy.PluginManager | None = None) -> None:
    """Unregister and block the external plugin ``name`` for this process, with one error naming it and
    ``problem``; the other plugins answer in its place."""
    pm = pm or get_plugin_manager()
    with _lock:
        pm.set_blocked(name)
        _dropped[name] = problem
        hooks.invalidate()
    error_once(f"plugin-dropped-{name}", f"plugin {name!r} dropped: {problem}; the other plugins serve")


def dropped() -> dict[str, str]:
    """Plugin name -> why it was dropped, for every plugin dropped in this process (``kda-backend doctor``)."""
    with _lock:
        return dict(_dropped)


def folder_problem(path: Path) -> str | None:
    """What keeps ``path`` from being or becoming a folder, or ``None``: it, or the nearest part of it that exists,
    is not a folder, is a symbolic link to nothing, or is a link loop."""
    for part in (path, *path.parents):
        if not os.path.lexists(part):
            continue
        try:
            mode = os.stat(part).st_mode
        except FileNotFoundError:
            return f"{part} is a symbolic link to {os.readlink(part)!r}, which does not exist"
        except OSError as exc:
            return f"{part} is a symbolic link loop" if exc.errno == errno.ELOOP else f"{part}: {exc.strerror}"
        return None if stat.S_ISDIR(mode) else f"{part} is not a folder"
    return None


def prove_writable(path: Path) -> None:
    """Create the folder ``path`` (and its parents) if missing and write a temporary file in it: what a caller checks
    before long work whose result it will store there. Raises ``OSError``."""
    path.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryFile(dir=path):
        pass


FORK_HOOK = "kda_host_fork_allowed"


class _Refused(Exception):
    """A hook answer outside its contract (the message says what was answered and what is accepted)."""


class Hooks:
    """Typed calls of every hook; results that cannot be missing raise when no plugin answered.

    Implementations are called one at a time in pluggy's order (hook wrappers are not supported), so each answer
    is checked against its hook's contract: an external plugin whose implementation raises or answers outside it
    is dropped (:func:`drop_plugin`) and the next implementation answers; a built-in one that does raises.
    """

    def __init__(self) -> None:
        self._providers: list[GemmProvider] | None = None
        self._owners: dict[str, str] = {}
        # Hook name -> its implementations in call order, until plugins change: the fork check runs on every
        # overlapped projection call, so it must not walk pluggy's registry each time.
        self._impls: dict[str, list[Any]] = {}

    def invalidate(self) -> None:
        self._providers = None
        self._impls = {}

    @property
    def _hook(self) -> Any:
        return get_plugin_manager().hook

    def _answers(
        self, hook_name: str, check: Callable[[Any], Any], first: bool, **kwargs: Any
    ) -> list[tuple[str, Any]]:
        """``(plugin name, checked answer)`` of the implementations of ``hook_name`` that answered (not ``None``),
        in call order; only the first if ``first``. ``check`` returns the answer as the caller takes it or raises
        :class:`_Refused`."""
        answers = []
        impls = self._impls.get(hook_name)
        if impls is None:
            impls = self._impls[hook_name] = [
                (impl.plugin_name, impl.function, impl.argnames, impl.wrapper or impl.hookwrapper)
                for impl in reversed(getattr(self._hook, hook_name).get_hookimpls())
            ]
        for plugin_name, function, argnames, wrapper in impls:
            try:
                if wrapper:
                    raise _Refused("is a hook wrapper; kda-backend calls each implementation alone")
                answer = function(*[kwargs[arg] for arg in argnames])
                if answer is None:
                    continue
                answers.append((plugin_name, check(answer)))
            except Exception as exc:
                if is_builtin(plugin_name):
                    raise
                problem = str(exc) if isinstance(exc, _Refused) else f"raised {type(exc).__name__}: {exc}"
                drop_plugin(plugin_name, f"{hook_name} {problem}")
                continue
            if first:
                break
        return answers

    def gemm_providers(self) -> list[GemmProvider]:
        """All providers, highest priority first (stable for equal priorities); cached until plugins change. A
        plugin whose providers are not :class:`GemmProvider` objects with a name and an integer priority, or reuse
        another plugin's provider name, is dropped."""
        with _lock:
            if self._providers is None:
                answers = self._answers("kda_gemm_providers", _checked_providers, first=False)
                owners = {p.name: plugin for plugin, batch in answers if is_builtin(plugin) for p in batch}
                found = []
                for plugin, batch in answers:
                    clash = [p.name for p in batch if owners.get(p.name, plugin) != plugin]
                    if clash:
                        drop_plugin(plugin, f"kda_gemm_providers answered providers named {clash}, which plugin "
                                    f"{owners[clash[0]]!r} registers already; accepted: new names")
                        continue
                    owners.update({p.name: plugin for p in batch})
                    found += batch
                self._owners = owners
                self._providers = sorted(found, key=lambda p: -p.priority)
            return list(self._providers)

    def provider_plugin(self, provider: str) -> str | None:
        """The name of the plugin that contributed the provider named ``provider``."""
        self.gemm_providers()
        return self._owners.get(provider)

    def fork_allowed(self, device: torch.device) -> bool:
        """The first answer of ``kda_host_fork_allowed``. Asked on every overlapped projection call, so where every
        implementation takes ``device`` and answers a bool or ``None`` they are called directly; anything else (a
        wrapper, a raise, an answer outside the contract) takes the checked path that reports it."""
        impls = self._impls.get(FORK_HOOK)
        if impls is not None:
            for _, function, argnames, wrapper in impls:
                if wrapper or len(argnames) != 1:
                    break
                try:
                    answer = function(device)
                except Exception:
                    break
                if answer is True or answer is False:
                    return answer
                if answer is not None:
                    break
            else:
                return False
        answers = self._answers(FORK_HOOK, _checked_bool, first=True, device=device)
        return bool(answers and answers[0][1])

    def aux_stream(self, device: torch.device) -> torch.cuda.Stream:
        """The first answer of ``kda_host_aux_stream`` that is a stream on ``device``. Streams are duck-typed
        (engines hand over their own stream objects): one with ``wait_event``, ``record_event`` and ``device``."""

        def check(stream: Any) -> Any:
            if not all(callable(getattr(stream, name, None)) for name in ("wait_event", "record_event")):
                raise _Refused(f"answered {type(stream).__name__} {stream!r:.80}; accepted: a CUDA stream on {device} "
                               "or None")
            if getattr(stream, "device", None) != device:
                raise _Refused(f"answered a stream on {getattr(stream, 'device', None)}; accepted: a CUDA stream on "
                               f"{device} or None")
            return stream

        answers = self._answers("kda_host_aux_stream", check, first=True, device=device)
        if not answers:
            raise RuntimeError(f"no plugin provided an auxiliary stream for {device}")
        return answers[0][1]

    def cache_dir(self) -> Path:
        """The cache folder: ``KDA_BACKEND_CACHE_DIR``, else the first plugin's answer that can be a folder (an
        external plugin answering a path that cannot is dropped, and the next one answers).

        :raises ValueError: ``KDA_BACKEND_CACHE_DIR``'s or the built-in plugin's folder is a file, a dangling
            symbolic link or a link loop, or lies under one (the message names where the path came from).
        """
        accepted = "accepted: a folder, or a path where one can be created"
        override = env.get("KDA_BACKEND_CACHE_DIR")
        if override.strip():
            path, source = Path(os.path.expanduser(override)), f"KDA_BACKEND_CACHE_DIR={override!r}"
            problem = folder_problem(path)
        else:
            while True:
                answers = self._answers("kda_autotune_cache_dir", _checked_path, first=True)
                if not answers:
                    raise RuntimeError("no plugin answered kda_autotune_cache_dir")
                plugin, answer = answers[0]
                path, source = Path(os.path.expanduser(answer)), f"plugin {plugin!r} (kda_autotune_cache_dir)"
                problem = folder_problem(path)
                if problem is None or is_builtin(plugin):
                    break
                drop_plugin(plugin, f"kda_autotune_cache_dir answered {str(path)!r}: {problem}; {accepted}")
        if problem is not None:
            raise ValueError(f"cache folder {path} from {source}: {problem}; {accepted}")
        return path

    def share_plan(self, plan: dict[str, Any], parse: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """The plan every rank must use: the first answer that is an object (and that ``parse`` accepts, raising
        ``ValueError`` otherwise); ``parse(answer)`` if given, else the answer."""

        def check(answer: Any) -> Any:
            if not isinstance(answer, dict):
                raise _Refused(f"answered {type(answer).__name__} {answer!r:.80}; accepted: a plan object")
            if parse is None:
                return answer
            try:
                return parse(answer)
            except ValueError as exc:
                raise _Refused(f"answered a plan outside the schema: {exc}") from None

        answers = self._answers("kda_share_plan", check, first=True, plan=plan)
        if not answers:
            raise RuntimeError("no plugin answered kda_share_plan")
        return answers[0][1]


def _checked_providers(answer: Any) -> list[GemmProvider]:
    if not isinstance(answer, (list, tuple)):
        raise _Refused(f"answered {type(answer).__name__} {answer!r:.80}; accepted: a list of GemmProvider objects")
    names = []
    for provider in answer:
        if not isinstance(provider, GemmProvider):
            raise _Refused(f"answered {type(provider).__name__} {provider!r:.80} in its list; accepted: GemmProvider "
                           "objects")
        if not isinstance(provider.name, str) or not provider.name or provider.name in names:
            raise _Refused(f"answered a provider named {provider.name!r}; accepted: a non-empty string, one per "
                           "provider")
        if isinstance(provider.priority, bool) or not isinstance(provider.priority, int):
            raise _Refused(f"answered provider {provider.name!r} with priority {provider.priority!r}; accepted: an "
                           "integer")
        names.append(provider.name)
    return list(answer)


def _checked_bool(answer: Any) -> bool:
    if not isinstance(answer, bool):
        raise _Refused(f"answered {type(answer).__name__} {answer!r:.80}; accepted: True, False or None")
    return answer


def _checked_path(answer: Any) -> str | os.PathLike:
    if not isinstance(answer, (str, os.PathLike)) or not os.fspath(answer):
        raise _Refused(f"answered {type(answer).__name__} {answer!r:.80}; accepted: a folder path (str or Path) or "
                       "None")
    return answer


hooks = Hooks()


def plugin_names() -> list[str]:
    """Names of registered plugins (for ``kda-backend doctor``)."""
    pm = get_plugin_manager()
    return sorted(name for name, plugin in pm.list_name_plugin() if plugin is not None)

