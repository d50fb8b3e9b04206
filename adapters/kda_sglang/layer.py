"""SGLang's Kimi-K3 KDA layer with ``forward_qkvbfg_fused`` served by :class:`kda_backend.KDAProjection`.

Installed with ``HookRegistry`` REPLACE of ``sglang.srt.models.kimi_k3.KimiK3DeltaAttention``, so SGLang's
``post_load_weights`` isinstance checks and ``_merge_bfa_weights`` still run. Under ``--attention-backend kda`` the
projection is built right after that merge, at load time on every rank together (its plan is broadcast over the
tensor-parallel group), over zero-copy views of ``fused_qkvg_proj.weight`` (QKVG), the merged ``_bfa_w``
([f_a | b | pad to 8 rows], F_A/beta) and ``_bfa_f_b_w`` (F_B). SGLang's own method serves where the projection
cannot (one warning says why: also where the weights arrive without ``post_load_weights``, as SGLang's IPC weight
cache loads them) and for any M its plan has no step for (no tuned plan, or M above the largest tuned one). A
forward never builds or communicates: ranks that skip self-attention in a step (DP attention) cannot leave the
others waiting.
"""

from __future__ import annotations

import torch
from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention

from kda_backend import KDAGeometry, KDAProjection, ProjectionWeights, serve_layer
from kda_backend.log import get_logger, warn_once
from kda_sglang.injection import deterministic_inference, graph_token_counts, kda_selected

# SGLang pads the merged [f_a | b] weight to a multiple of 8 rows (_merge_bfa_weights): 144 rows at TP8, 136 at TP16.
SGLANG_FAB_ROW_MULTIPLE = 8
# One log line per process says the layers serve through the core (not one per layer).
_announced = False


class KdaBackendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """Built by SGLang in place of ``KimiK3DeltaAttention`` (same constructor arguments)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._kda_projection: KDAProjection | None = None
        # Whether SGLang's post-load step reached this layer (or a forward already said that it did not).
        self._kda_load_seen = False

    def kda_geometry(self) -> KDAGeometry:
        """This rank's shapes: heads sharded over the attention-TP group, as SGLang shards the layer."""
        return KDAGeometry(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            tp_size=self.attn_tp_size, conv_width=self.conv_size, row_multiple=SGLANG_FAB_ROW_MULTIPLE,
        )

    def _why_unsupported(self) -> str | None:
        from sglang.srt.layers.quantization.unquant import UnquantizedLinearMethod
        from sglang.srt.utils import is_hip

        if is_hip():
            # SGLang runs its own fused ROCm in-projection and decode there; the core's kernels are CUDA-only.
            return "ROCm: SGLang's own ROCm projection serves"
        if deterministic_inference():
            # SGLang then promises results independent of the batch; kda-backend's kernels pick tactics per M.
            return "--enable-deterministic-inference: SGLang's deterministic path serves"
        if not self.use_full_rank_gate:
            return "the layer has no full-rank gate (Kimi-Linear)"
        if self._bfa_w is None or self._bfa_f_b_w is None:
            return "SGLang did not merge the [f_a | b] weights"
        quant_method = self.fused_qkvg_proj.quant_method
        if type(quant_method) is not UnquantizedLinearMethod:
            return f"fused_qkvg_proj is quantized ({type(quant_method).__name__})"
        for name, w in (("fused_qkvg_proj", self.fused_qkvg_proj.weight), ("_bfa_w", self._bfa_w),
                        ("_bfa_f_b_w", self._bfa_f_b_w)):
            if w.dtype != torch.bfloat16:
                return f"{name} is {w.dtype}, not bfloat16"
        return None

    def _build_kda_projection(self) -> KDAProjection | None:
        """The core's projection over this layer's merged weights, or ``None`` (one warning, or one error where
        building failed after the plan was shared) where SGLang's own method must serve. The conditions are the
        same on every rank, so either all ranks build (and join the plan broadcast) or none does."""
        reason = self._why_unsupported()
        if reason is None:
            try:
                weights = ProjectionWeights.from_split(
                    self.fused_qkvg_proj.weight, self._bfa_w, self._bfa_f_b_w, self.kda_geometry()
                )
            except ValueError as exc:  # a weight layout the core cannot view
                reason = str(exc)
        if reason is not None:
            warn_once(f"sglang-unsupported-{reason}", f"SGLang: Kimi-K3 KDA projection kept on SGLang's path: {reason}")
            return None
        projection = serve_layer(self, weights, aux_stream=self._bfa_alt_stream, batch_sizes=graph_token_counts())
        global _announced
        if projection is not None and not _announced:
            _announced = True
            get_logger().info("SGLang: Kimi-K3 KDA layers use kda-backend's projection stage")
        return projection

    def _merge_bfa_weights(self) -> None:
        """SGLang's merge (from ``post_load_weights``, on every rank, before CUDA-graph capture), then, under
        ``--attention-backend kda``, this layer's projection over the final weights."""
        super()._merge_bfa_weights()
        self._kda_load_seen = True
        self._kda_projection = self._build_kda_projection() if kda_selected() else None

    def forward_qkvbfg_fused(self, hidden_states: torch.Tensor, defer_f_b: bool = False):
        """SGLang's projection stage, through :class:`KDAProjection` where one was built at load.

        :param hidden_states: ``[M, hidden]`` bf16.
        :param defer_f_b: SGLang's fused decode applies F_B itself: no F_B kernel runs and ``forget_gate`` is f_a.
        :returns: SGLang's tuple ``(qkv [M, 3*hD], beta [M, h], forget_gate, g_proj [M, hD])`` with ``forget_gate``
            the F_B output ``[M, hD]``, or f_a ``[M, head_dim]`` with ``defer_f_b``; qkv and g_proj are views into
            one ``[M, 4*hD]`` output, beta and f_a views into the ``[M, fab_rows]`` F_A/beta output, as SGLang's.
        """
        projection = self._kda_projection
        if projection is None and not self._kda_load_seen:
            self._kda_load_seen = True
            if kda_selected():
                # SGLang's IPC weight cache (--load-format ipc_cache) maps weights the daemon processed and skips
                # post_load_weights, so the projection was never built.
                warn_once("sglang-not-loaded", "SGLang: Kimi-K3 KDA projection kept on SGLang's path: the weights "
                          "were loaded without post_load_weights (SGLang's IPC weight cache skips it), so "
                          "kda-backend's projection was never built")
        if projection is None or not projection.serves(hidden_states.shape[0]):
            # No projection, or no tuned step for this M (no tuned plan, or M above the largest tuned one: the
            # plan's resolution said so once): SGLang's own method, its overlap included.
            return super().forward_qkvbfg_fused(hidden_states, defer_f_b=defer_f_b)
        g = projection.geometry
        fab = hidden_states.new_empty(hidden_states.shape[0], g.fab_rows)
        qkvg, g1, beta = projection(hidden_states, fab_out=fab, compute_fb=not defer_f_b)
        qkv, g_proj_states = torch.split(qkvg, self.split_sizes, dim=-1)
        forget_gate = fab[:, : g.head_dim] if defer_f_b else g1
        return qkv, beta, forget_gate, g_proj_states
