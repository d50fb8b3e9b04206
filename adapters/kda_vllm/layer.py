"""vLLM's Kimi-K3 KDA layer with the projection stage served by :class:`kda_backend.KDAProjection`.

Everything else (weights, loaders, state specs, metadata, ``_forward``, o_proj) is vLLM's. The projection reads
zero-copy views of ``in_proj_qkvgfab.weight`` ([q|k|v|g|f_a|beta|pad], the core's packed layout) and
``f_b_proj.weight``, for any TP size that divides the heads. Quantized or non-bf16 projections keep vLLM's path.
"""

from __future__ import annotations

import torch
from einops import rearrange
from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

from kda_backend import KDAGeometry, KDAProjection, ProjectionWeights
from kda_backend.log import warn_once
from kda_backend.planning import resolve_plan


class KdaBackendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """Built by vLLM in place of ``KimiK3DeltaAttention`` (same constructor arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kda_projection: KDAProjection | None = None
        self._kda_unsupported: str | None = None

    def kda_geometry(self) -> KDAGeometry:
        return KDAGeometry(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            tp_size=self.tp_size, conv_width=self.conv_size,
        )

    def _why_unsupported(self) -> str | None:
        for name in ("in_proj_qkvgfab", "f_b_proj"):
            linear = getattr(self, name)
            if type(linear.quant_method).__name__ != "UnquantizedLinearMethod":
                return f"{name} is quantized ({type(linear.quant_method).__name__})"
            if linear.weight.dtype != torch.bfloat16:
                return f"{name} weight is {linear.weight.dtype}, not bfloat16"
        g = self.kda_geometry()
        if tuple(self.in_proj_qkvgfab.weight.shape) != (g.packed_rows, g.hidden_size):
            return f"in_proj_qkvgfab is {tuple(self.in_proj_qkvgfab.weight.shape)}, not the packed layout"
        return None

    def kda_projection(self) -> KDAProjection | None:
        """The core's projection over this layer's weights (built on first use, i.e. in vLLM's eager warm-up,
        before any graph is captured); ``None`` where vLLM's own path must serve."""
        if self._kda_projection is None and self._kda_unsupported is None:
            self._kda_unsupported = self._why_unsupported()
            if self._kda_unsupported is not None:
                warn_once(f"vllm-unsupported-{self._kda_unsupported}", f"vLLM path kept: {self._kda_unsupported}")
                return None
            g = self.kda_geometry()
            weights = ProjectionWeights.from_packed(self.in_proj_qkvgfab.weight, self.f_b_proj.weight, g)
            plan = resolve_plan(g, weights.device, weights.dtype)
            self._kda_projection = KDAProjection(weights, plan, aux_stream=self._projection_aux_stream)
            if weights.device.type == "cuda":
                self._kda_projection.prepare(sorted(plan.steps) or [1])
        return self._kda_projection

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        projection = self.kda_projection()
        if projection is None:
            return super().forward(hidden_states, positions)
        num_tokens = hidden_states.size(0)
        qkvg, g1, beta = projection(hidden_states)
        mixed_qkv, g_proj_states = qkvg.split([3 * self.local_projection_size, self.local_projection_size], dim=-1)
        # The rest hands vLLM's _forward and o_proj the same tensors vLLM's own forward does (a test checks it).
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
