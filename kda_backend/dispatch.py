"""Choosing a GEMM provider per call: walk providers by priority, log each rejection once, end at torch.

Rejections are expected on a healthy machine (FlashInfer's kernels are Blackwell-only, CuTe's stop at M = 64, the
CPU has neither), so each is logged once at DEBUG; the projection says once at INFO which provider serves each
role. ``KDA_BACKEND_PROVIDER`` (or an explicit ``forced`` argument) pins a role to a named provider; a pinned provider
that cannot serve a call raises :class:`ValueError` naming the registered choices instead of falling back.
A provider that fails at run time is marked broken for the process (one warning) and the next one serves.
"""

from __future__ import annotations

from kda_backend import env
from kda_backend.log import debug_once, warn_once
from kda_backend.plugins import hooks
from kda_backend.providers.base import ROLES, GemmCall, GemmProvider

_broken: dict[str, str] = {}


def forced_providers() -> dict[str, str]:
    """Role -> provider name pinned by ``KDA_BACKEND_PROVIDER`` (``name`` alone pins every role)."""
    pins: dict[str, str] = {}
    for item in env.name_list("KDA_BACKEND_PROVIDER"):
        if "=" in item:
            role, name = (part.strip() for part in item.split("=", 1))
            if role not in ROLES:
                raise ValueError(f"KDA_BACKEND_PROVIDER: unknown role {role!r}; roles are {list(ROLES)}")
            pins[role] = name
        else:
            pins.update({role: item for role in ROLES})
    return pins


def is_forced(role: str) -> bool:
    return role in forced_providers()


def mark_broken(provider: GemmProvider, reason: str) -> None:
    """Take ``provider`` out of automatic selection for this process, warning once."""
    _broken[provider.name] = reason
    warn_once(f"broken-{provider.name}", f"provider {provider.name!r} disabled: {reason}; falling back")


def broken_reason(name: str) -> str | None:
    return _broken.get(name)


def provider_by_name(name: str) -> GemmProvider:
    providers = hooks.gemm_providers()
    for provider in providers:
        if provider.name == name:
            return provider
    raise ValueError(f"unknown GEMM provider {name!r}; registered: {[p.name for p in providers]}")


def select(call: GemmCall, forced: str | None = None) -> GemmProvider:
    """The provider that serves ``call``.

    :param call: the GEMM to serve.
    :param forced: a provider name that must serve it (else ``KDA_BACKEND_PROVIDER``, else automatic).
    :raises ValueError: a forced provider is unknown or rejects ``call``.
    """
    forced = forced or forced_providers().get(call.role)
    if forced:
        provider = provider_by_name(forced)
        reason = provider.why_not(call)
        if reason is not None:
            raise ValueError(f"forced provider {forced!r} cannot serve {call.role} M={call.m}: {reason}")
        return provider
    for provider in hooks.gemm_providers():
        if provider.name in _broken:
            continue
        reason = provider.why_not(call)
        if reason is None:
            return provider
        debug_once(
            f"reject-{provider.name}-{call.role}-{call.n}-{call.k}-{call.device_type}-{reason}",
            f"provider {provider.name!r} skipped for {call.role} [N={call.n}, K={call.k}]: {reason}",
        )
    raise RuntimeError("no GEMM provider accepted the call; the built-in torch provider must always be registered")
