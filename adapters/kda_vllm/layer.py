"""vLLM's Kimi-K3 KDA layer with the projection stage served by :class:`kda_backend.KDAProjection`.

Everything else (weights, loaders, state specs, metadata, ``_forward``, o_proj) is vLLM's. The projection reads
zero-copy views of ``in_proj_qkvgfab.weight`` ([q|k|v|g|f_a|beta|pad], the core's packed layout) and
``f_b_proj.weight``, for any TP size that divides the heads. It is built, and its plan resolved and shared across
the TP group, in vLLM's post-load hook for attention layers, on every rank at the same point of loading; a forward
never communicates. Where the weights are not plain bf16 rows on the GPU vLLM's path serves, and one log line
says why.
"""

from __future__ import annotations

import torch
from einops import rearrange
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.offloader.base import NoopOffloader, get_offloader
from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

from kda_backend import KDAGeometry, KDAProjection, ProjectionWeights, build_projection
from kda_backend.log import warn_once

from kda_vllm.injection import register_host

NOT_LOADED = "its weights were never processed (vLLM's process_weights_after_loading did not run for this layer)"


class KdaBackendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """Built by vLLM in place of ``KimiK3DeltaAttention`` (same constructor arguments).

    :attr:`kda_projection` is the projection serving this layer, ``None`` where vLLM's own path serves;
    :attr:`kda_vllm_path_reason` then says why.
    """

    def __init__(self, config, vllm_config, *args, **kwargs) -> None:
        super().__init__(config, vllm_config, *args, **kwargs)
        self._kda_compilation_config = vllm_config.compilation_config
        self.kda_projection: KDAProjection | None = None
        self.kda_vllm_path_reason: str | None = NOT_LOADED

    def kda_geometry(self) -> KDAGeometry:
        return KDAGeometry(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            tp_size=self.tp_size, conv_width=self.conv_size,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's post-load hook for attention layers (``is_deferred_attention_layer``): called on every rank after
        every linear's quant method processed its weights, and again after a weight reload. Builds the projection
        over the weights vLLM keeps and resolves its plan here (the plan's TP broadcast is a collective)."""
        register_host()
        self.kda_projection = None
        self.kda_vllm_path_reason = self._why_vllm_path()
        if self.kda_vllm_path_reason is not None:
            warn_once(f"vllm-path-{self.kda_vllm_path_reason}", f"vLLM path kept: {self.kda_vllm_path_reason}")
            return
        weights = ProjectionWeights.from_packed(self.in_proj_qkvgfab.weight, self.f_b_proj.weight, self.kda_geometry())
        self.kda_projection = build_projection(
            weights,
            aux_stream=self._projection_aux_stream,
            batch_sizes=self._kda_compilation_config.cudagraph_capture_sizes or (),
        )
        # Our forward replaces vLLM's projection, so its overlap branch never runs for this layer; a zero token
        # limit also makes vLLM's warm-up skip tuning its overlap kernels for it. Where vLLM's path serves, its
        # overlap stays exactly as vLLM set it up.
        self._projection_overlap_max_tokens = 0

    def _why_vllm_path(self) -> str | None:
        """Why the projection cannot serve from the tensors vLLM keeps, or ``None`` where it can. Depends only on
        the configuration and shapes, so every rank of a TP group decides alike (the plan broadcast needs all)."""
        offloader = get_offloader()
        if not isinstance(offloader, NoopOffloader):
            return f"vLLM offloads weights to the CPU ({type(offloader).__name__}); kda-backend serves resident ones"
        for name in ("in_proj_qkvgfab", "f_b_proj"):
            linear = getattr(self, name)
            method = type(linear.quant_method)
            # Any unquantized method (vLLM's Kimi-K3 low-latency one is a subclass) keeps plain [out, in] rows, as
            # long as it processes weights after loading as UnquantizedLinearMethod does (not at all on CUDA).
            if not issubclass(method, UnquantizedLinearMethod):
                return f"{name} is quantized ({method.__name__})"
            if method.process_weights_after_loading is not UnquantizedLinearMethod.process_weights_after_loading:
                return f"{name}: {method.__name__} changes its weights after loading; their layout is unknown"
            if linear.weight.dtype != torch.bfloat16:
                return f"{name} weight is {linear.weight.dtype}, not bfloat16"
        try:
            ProjectionWeights.from_packed(self.in_proj_qkvgfab.weight, self.f_b_proj.weight, self.kda_geometry())
        except ValueError as exc:
            return f"in_proj_qkvgfab / f_b_proj are not the packed layout: {exc}"
        return None

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden_states [M, hidden]`` -> ``[M, hidden]``: vLLM's forward with the projection stage replaced."""
        projection = self.kda_projection
        if projection is None:
            warn_once(f"vllm-path-{self.kda_vllm_path_reason}", f"vLLM path kept: {self.kda_vllm_path_reason}")
            return super().forward(hidden_states, positions)
        num_tokens = hidden_states.size(0)
        qkvg, g1, beta = projection(hidden_states)
        mixed_qkv, g_proj_states = qkvg.split([3 * self.local_projection_size, self.local_projection_size], dim=-1)
        # From here on vLLM's forward, unchanged: _forward and o_proj get the tensors vLLM's own projection hands
        # them (tests/engines/test_vllm_adapter.py records and compares them).
        beta = beta.unsqueeze(0)
        g1 = rearrange(g1, "n (h d) -> 1 n h d", d=self.head_dim)
        g2 = rearrange(g_proj_states, "... (h d) -> ... h d", d=self.head_dim)
        core_attn_out = torch.empty(
            (1, num_tokens, self.local_num_heads, self.head_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        self._forward(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta, core_attn_out=core_attn_out)
        core_attn_out = rearrange(core_attn_out, "1 n h d -> n (h d)")
        if self.gemm_rs_ar is not None and self.gemm_rs_ar.should_run(core_attn_out):
            return self.gemm_rs_ar.apply(core_attn_out, self.o_proj)
        return self.o_proj(core_attn_out)[0]
