"""kda-backend: the Kimi-K3 KDA projection stage, fast in any engine.

Public API: geometry (:class:`KDAGeometry`, :func:`preset`), weights (:class:`ProjectionWeights`), the projection
(:class:`KDAProjection`, :class:`Plan`), plugin registration (:func:`register_plugin`, :data:`hookimpl`) and the
fp32 references (:mod:`kda_backend.reference`).

The public names load their modules on first use: an engine adapter that only reads the kill switch and the engine
version (:mod:`kda_backend.engine_gate`) leaves the core (the projection, its providers and plugins) unimported.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module defining it.
_PUBLIC = {
    "GemmCall": "kda_backend.providers.base",
    "GemmProvider": "kda_backend.providers.base",
    "KDAGeometry": "kda_backend.geometry",
    "KDAProjection": "kda_backend.projection",
    "Plan": "kda_backend.plan",
    "ProjectionWeights": "kda_backend.weights",
    "Step": "kda_backend.plan",
    "build_projection": "kda_backend.serving",
    "get_plugin_manager": "kda_backend.plugins",
    "hookimpl": "kda_backend.hookspecs",
    "hooks": "kda_backend.plugins",
    "preset": "kda_backend.geometry",
    "register_plugin": "kda_backend.plugins",
    "serve_layer": "kda_backend.serving",
    "unregister_plugin": "kda_backend.plugins",
    "valid_tp_sizes": "kda_backend.geometry",
}

__all__ = ["__version__", *_PUBLIC]


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'kda_backend' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_PUBLIC})
