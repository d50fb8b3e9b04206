"""SGLang's Kimi-K3 KDA layer with ``forward_qkvbfg_fused`` served by :class:`kda_backend.KDAProjection`.

Installed with ``HookRegistry`` REPLACE of ``sglang.srt.models.kimi_k3.KimiK3DeltaAttention``, so SGLang's
``post_load_weights`` isinstance checks and ``_merge_bfa_weights`` still run. The projection is used only when the
server runs ``--attention-backend kda``; then it reads zero-copy views of ``fused_qkvg_proj.weight`` (QKVG),
the merged ``_bfa_w`` ([f_a | b | pad to 8 rows], F_A/beta) and ``_bfa_f_b_w`` (F_B), forks onto
``bfa_alt_stream`` where SGLang would, and returns SGLang's tuple ``(qkv, beta, forget_gate, g_proj)``.
"""

from __future__ import annotations

import torch
from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention

from kda_backend import KDAGeometry, KDAProjection, ProjectionWeights
from kda_backend.log import warn_once
from kda_backend.planning import resolve_plan

from kda_sglang.injection import kda_selected

# SGLang pads the merged [f_a | b] weight to a multiple of 8 rows (_merge_bfa_weights).
SGLANG_FAB_ROW_MULTIPLE = 8


class KdaBackendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """Built by SGLang in place of ``KimiK3DeltaAttention`` (same constructor arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kda_projection: KDAProjection | None = None

    def kda_geometry(self) -> KDAGeometry:
        return KDAGeometry(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            tp_size=self.attn_tp_size, conv_width=self.conv_size, row_multiple=SGLANG_FAB_ROW_MULTIPLE,
        )

    def _why_unsupported(self) -> str | None:
        if not self.use_full_rank_gate:
            return "the layer has no full-rank gate (Kimi-Linear)"
        if self._bfa_w is None or self._bfa_f_b_w is None:
            return "SGLang did not merge the [f_a | b] weights"
        if type(self.fused_qkvg_proj.quant_method).__name__ != "UnquantizedLinearMethod":
            return f"fused_qkvg_proj is quantized ({type(self.fused_qkvg_proj.quant_method).__name__})"
        for name, w in (("fused_qkvg_proj", self.fused_qkvg_proj.weight), ("_bfa_w", self._bfa_w),
                        ("_bfa_f_b_w", self._bfa_f_b_w)):
            if w.dtype != torch.bfloat16:
                return f"{name} is {w.dtype}, not bfloat16"
        return None

    def kda_projection(self) -> KDAProjection | None:
        """The core's projection over this layer's weights, built on first use (SGLang's eager warm-ups run
        before capture); ``None`` where SGLang's own method must serve."""
        if self._kda_projection is None:
            reason = self._why_unsupported()
            if reason is not None:
                warn_once(f"sglang-unsupported-{reason}", f"SGLang path kept: {reason}")
                return None
            g = self.kda_geometry()
            weights = ProjectionWeights.from_split(self.fused_qkvg_proj.weight, self._bfa_w, self._bfa_f_b_w, g)
            plan = resolve_plan(g, weights.device, weights.dtype)
            self._kda_projection = KDAProjection(weights, plan, aux_stream=self._bfa_alt_stream)
            if weights.device.type == "cuda":
                self._kda_projection.prepare(sorted(plan.steps) or [1])
        return self._kda_projection

    def forward_qkvbfg_fused(self, hidden_states: torch.Tensor, defer_f_b: bool = False):
        projection = self.kda_projection() if kda_selected() else None
        if projection is None:
            return super().forward_qkvbfg_fused(hidden_states, defer_f_b=defer_f_b)
        g = projection.geometry
        fab = hidden_states.new_empty(hidden_states.shape[0], g.fab_rows)
        qkvg, g1, beta = projection(hidden_states, fab_out=fab)
        qkv, g_proj_states = torch.split(qkvg, self.split_sizes, dim=-1)
        # With defer_f_b SGLang's fused decode applies F_B itself and wants f_a.
        forget_gate = fab[:, : g.head_dim] if defer_f_b else g1
        return qkv, beta, forget_gate, g_proj_states
