"""The seams kda-backend uses in vLLM 0.33 (see adapters/SEAMS.md for why each and what would remove it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kda_backend import hookimpl, register_plugin
from kda_backend.engine_gate import broadcast_from_rank0
from kda_backend.log import get_logger

HOST_PLUGIN_NAME = "vllm-host"


class VllmHost:
    """Answers the core's host hooks from vLLM's own state."""

    @hookimpl
    def kda_host_fork_allowed(self, device: torch.device) -> bool:
        # While a graph is being captured: a FULL graph, or the open segment of a breakable one. The projection joins
        # its fork before returning and launches no eager break (this layer's only one is vLLM's _forward, after
        # it), so the fork never spans a segment boundary. Never in eager runs, warm-ups, profiling or eager breaks.
        return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()

    @hookimpl
    def kda_host_aux_stream(self, device: torch.device) -> torch.cuda.Stream | None:
        from vllm.utils.torch_utils import aux_stream

        return aux_stream()

    @hookimpl
    def kda_autotune_cache_dir(self) -> Path:
        import vllm.envs

        return Path(vllm.envs.VLLM_CACHE_ROOT) / "kda_backend"

    @hookimpl
    def kda_share_plan(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        from vllm.distributed import parallel_state

        return broadcast_from_rank0(parallel_state, plan)


def install() -> None:
    """Register the layer subclass through ``PluggableLayer.register_oot`` (idempotent; nothing where it already
    is, or where another plugin owns the seam). The host plugin is registered by each layer when its weights are
    loaded."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.platforms import current_platform

    from kda_vllm.layer import KdaBackendKimiK3DeltaAttention

    if current_platform.is_rocm() or current_platform.is_xpu() or current_platform.device_type == "tpu":
        # vLLM builds its AMD (or the reference) KDA layer there, a class of the same name; the registry is keyed by
        # that name, so a replacement would reach it too.
        get_logger().info("vLLM on %s: kda-backend does not inject (CUDA only)", current_platform.device_type)
        return
    registered = op_registry_oot.get(KimiK3DeltaAttention.__name__)
    if registered is KdaBackendKimiK3DeltaAttention:
        return
    if registered is not None:
        get_logger().warning("another plugin replaced KimiK3DeltaAttention (%s); kda-backend stays out", registered)
        return
    KimiK3DeltaAttention.register_oot(KdaBackendKimiK3DeltaAttention)


def register_host() -> None:
    """Make vLLM's state answer the core's host hooks (idempotent)."""
    register_plugin(VllmHost(), HOST_PLUGIN_NAME)
