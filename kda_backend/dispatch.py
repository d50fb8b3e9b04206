"""Choosing a GEMM provider per call: walk providers by priority, log each rejection once, end at torch.

Rejections are expected on a healthy machine (FlashInfer's kernels are Blackwell-only, CuTe's stop at M = 64, the
CPU has neither), so each is logged once at DEBUG; the projection says once at INFO which provider serves each
role. ``KDA_BACKEND_PROVIDER`` (or an explicit ``forced`` argument) pins a role to a named provider; a pinned provider
that cannot serve a call raises :class:`ValueError` naming the registered choices instead of falling back.
A provider that fails at run time is marked broken for the process (one warning) and the next one serves; one whose
``why_not`` raises or answers neither ``None`` nor a string is dropped with one error naming it and its plugin.
"""

from __future__ import annotations

from kda_backend import env
from kda_backend.env import EnvError
from kda_backend.log import debug_once, error_once, warn_once
from kda_backend.plugins import hooks
from kda_backend.providers.base import ROLES, GemmCall, GemmProvider

_broken: dict[str, str] = {}


def forced_providers() -> dict[str, str]:
    """Role -> provider name pinned by ``KDA_BACKEND_PROVIDER``: one ``name`` pins every role, else
    ``role=name,...`` pins each role named (at most once).

    :raises EnvError: any other form, an unknown role, or a provider that is not registered.
    """
    value = env.get("KDA_BACKEND_PROVIDER")
    items = env.name_list("KDA_BACKEND_PROVIDER")
    registered = [p.name for p in hooks.gemm_providers()] if items else []
    accepted = (f"accepted: one provider name for every role, or role=name,... with roles {', '.join(ROLES)}; "
                f"providers: {', '.join(registered)}")
    if len(items) == 1 and "=" not in items[0]:
        pins = {role: items[0] for role in ROLES}
    else:
        pins = {}
        for item in items:
            role, sep, name = (part.strip() for part in item.partition("="))
            if not sep or not name or role not in ROLES or role in pins:
                problem = ("a provider name without a role beside others" if not sep else
                           f"role {role!r} without a provider" if not name else
                           f"unknown role {role!r}" if role not in ROLES else f"role {role!r} pinned twice")
                raise EnvError(f"KDA_BACKEND_PROVIDER={value!r}: {problem}; {accepted}")
            pins[role] = name
    unknown = sorted({name for name in pins.values() if name not in registered})
    if unknown:
        raise EnvError(f"KDA_BACKEND_PROVIDER={value!r}: provider {unknown[0]!r} is not registered; {accepted}")
    return pins


def is_forced(role: str) -> bool:
    return role in forced_providers()


def why_not(provider: GemmProvider, call: GemmCall) -> str | None:
    """``provider.why_not(call)``, isolated: a provider whose check raises or answers neither ``None`` nor a string
    is taken out of selection for the process (one error naming it and its plugin) and answers with that reason.
    """
    try:
        reason = provider.why_not(call)
    except Exception as exc:  # a plugin's check may fail in any way; only this provider is lost
        problem = f"why_not raised {type(exc).__name__}: {exc}"
    else:
        if reason is None or isinstance(reason, str):
            return reason
        problem = f"why_not answered {type(reason).__name__} {reason!r:.80}; accepted: None or a reason string"
    _broken[provider.name] = problem
    error_once(f"dropped-{provider.name}", f"provider {provider.name!r} of plugin "
               f"{hooks.provider_plugin(provider.name)!r} dropped: {problem}; the other providers serve")
    return problem


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
    :param forced: a provider name that must serve it where ``KDA_BACKEND_PROVIDER`` pins none for the role (the
        user's pin wins over a plan's name), else automatic.
    :raises ValueError: a forced provider is unknown or rejects ``call``.
    """
    forced = forced_providers().get(call.role) or forced
    if forced:
        provider = provider_by_name(forced)
        reason = why_not(provider, call)
        if reason is not None:
            raise ValueError(f"forced provider {forced!r} cannot serve {call.role} M={call.m}: {reason}")
        return provider
    for provider in hooks.gemm_providers():
        if provider.name in _broken:
            continue
        reason = why_not(provider, call)
        if reason is None:
            return provider
        debug_once(
            f"reject-{provider.name}-{call.role}-{call.n}-{call.k}-{call.device_type}-{reason}",
            f"provider {provider.name!r} skipped for {call.role} [N={call.n}, K={call.k}]: {reason}",
        )
    raise RuntimeError("no GEMM provider accepted the call; the built-in torch provider must always be registered")
