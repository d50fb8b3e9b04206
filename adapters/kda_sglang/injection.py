"""The seams kda-backend uses in SGLang 0.5.23 (see adapters/SEAMS.md)."""

from __future__ import annotations

from typing import Any

import torch

from kda_backend import hookimpl, register_plugin
from kda_backend.engine_gate import broadcast_from_rank0
from kda_backend.log import get_logger

from kda_sglang import BACKEND_NAME

HOST_PLUGIN_NAME = "sglang-host"
LAYER_TARGET = "sglang.srt.models.kimi_k3.KimiK3DeltaAttention"


def full_attention_backend_name(capability: tuple[int, int] | None) -> str:
    """The backend the MLA (full-attention) layers get under ``--attention-backend kda``: FA3 on Hopper,
    TRT-LLM MLA on Blackwell, Triton elsewhere."""
    if capability is not None and capability[0] == 9:
        return "fa3"
    if capability is not None and capability[0] == 10:
        return "trtllm_mla"
    return "triton"


def kda_selected() -> bool:
    """Whether the running server was started with ``--attention-backend kda``."""
    from sglang.srt.runtime_context import get_exec

    try:
        return get_exec().kernel.attention_backend == BACKEND_NAME
    except (AttributeError, KeyError, RuntimeError, ValueError):  # no server published in this process
        return False


class SglangHost:
    """Answers the core's host hooks from SGLang's own state."""

    @hookimpl
    def kda_host_fork_allowed(self, device: torch.device) -> bool:
        from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
            is_in_breakable_cuda_graph,
        )
        from sglang.srt.model_executor.runner_utils import capture_mode

        # SGLang's capture mode covers its two eager warm-ups and the capture itself (its own overlap's gate);
        # unlike SGLang's gate we stay sequential inside a breakable graph, whose eager segments replay apart.
        return capture_mode.is_capture_mode and not is_in_breakable_cuda_graph()

    @hookimpl
    def kda_share_plan(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        from sglang.srt.distributed import parallel_state

        return broadcast_from_rank0(parallel_state, plan)


def _create_kda_backend(runner):
    """``--attention-backend kda``: the MLA layers get the platform's full-attention backend; SGLang's hybrid
    wrapper adds its KDA backend for the linear-attention layers, whose projection our layer class serves."""
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
    return ATTENTION_BACKENDS[full_attention_backend_name(capability)](runner)


def install() -> None:
    """Idempotent: the CLI choice, the backend factory, the MLA handler, the layer REPLACE and the host plugin."""
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS, register_attention_backend
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from kda_sglang.layer import KdaBackendKimiK3DeltaAttention

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if BACKEND_NAME not in ATTENTION_BACKENDS:
        register_attention_backend(BACKEND_NAME)(_create_kda_backend)
    if BACKEND_NAME not in AttentionBackendRegistry._handlers:
        # Unknown names silently get the Triton MLA handler; ours is the delegate's.
        capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        AttentionBackendRegistry.register(
            BACKEND_NAME, AttentionBackendRegistry.get_handler(full_attention_backend_name(capability))
        )
    if not any(hook is KdaBackendKimiK3DeltaAttention for _, hook, _ in HookRegistry._hooks.get(LAYER_TARGET, [])):
        HookRegistry.register(LAYER_TARGET, KdaBackendKimiK3DeltaAttention, HookType.REPLACE)
    register_plugin(SglangHost(), HOST_PLUGIN_NAME)
    get_logger().debug("SGLang: '%s' attention backend and KDA layer registered", BACKEND_NAME)
