"""kda-backend: the Kimi-K3 KDA projection stage, fast in any engine.

Public API: geometry (:class:`KDAGeometry`, :func:`preset`), weights (:class:`ProjectionWeights`), the projection
(:class:`KDAProjection`, :class:`Plan`), plugin registration (:func:`register_plugin`, :data:`hookimpl`) and the
fp32 references (:mod:`kda_backend.reference`).
"""

__version__ = "0.1.0"

from kda_backend.geometry import KDAGeometry, preset, valid_tp_sizes
from kda_backend.hookspecs import hookimpl
from kda_backend.plan import Plan, Step
from kda_backend.plugins import get_plugin_manager, hooks, register_plugin, unregister_plugin
from kda_backend.projection import KDAProjection
from kda_backend.providers.base import GemmCall, GemmProvider
from kda_backend.serving import build_projection
from kda_backend.weights import ProjectionWeights

__all__ = [
    "GemmCall",
    "GemmProvider",
    "KDAGeometry",
    "KDAProjection",
    "Plan",
    "ProjectionWeights",
    "Step",
    "__version__",
    "build_projection",
    "get_plugin_manager",
    "hookimpl",
    "hooks",
    "preset",
    "register_plugin",
    "unregister_plugin",
    "valid_tp_sizes",
]
