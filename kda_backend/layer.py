"""``KimiK3DeltaAttention``: one whole Kimi-K3 KDA layer, engine-agnostic, over explicit state.

The projection stage is :class:`~kda_backend.projection.KDAProjection` (tuned kernels, overlap inside CUDA
graphs). On CUDA the rest uses fla-core kernels: ``causal_conv1d_update`` / ``causal_conv1d`` (short conv + SiLU),
``fused_recurrent_kda`` (decode, state updated in place through slot indices) / ``chunk_kda`` (prefill), and
``rms_norm_gated`` (sigmoid gate); on the CPU every step is the fp32 reference
(:mod:`kda_backend.reference.layer`). Both paths update the caller's state tensors in place.

State (per slot; h = heads_local, D = head_dim, C = 3*h*D, W = conv width):
- conv state ``[slots, C, W]`` in the weights' dtype, fla's layout (last W inputs, newest last);
- recurrent state ``[slots, h, D, D]`` fp32, key-major (``S[k, v]``).
"""

from __future__ import annotations

import torch
from torch import nn

from kda_backend.geometry import KDAGeometry
from kda_backend.plan import Plan
from kda_backend.projection import KDAProjection
from kda_backend.reference.layer import KDALayerWeights, decay_gate, reference_kda_layer
from kda_backend.weights import ProjectionWeights


class KimiK3DeltaAttention(nn.Module):
    """One rank's KDA layer.

    :param geometry: per-rank shapes.
    :param weights: the layer's parameters; QKVG and FAB are packed into one ``[packed_rows, hidden]`` tensor.
    :param lower_bound: gate lower bound (``None``: the softplus gate).
    :param eps: RMSNorm epsilon.
    :param plan: projection plan (default: sequential, automatic providers).
    """

    def __init__(
        self,
        geometry: KDAGeometry,
        weights: KDALayerWeights,
        lower_bound: float | None = -5.0,
        eps: float = 1e-5,
        plan: Plan | None = None,
    ) -> None:
        super().__init__()
        self.geometry = geometry
        self.lower_bound, self.eps = lower_bound, eps
        frozen = {"requires_grad": False}
        self.in_proj = nn.Parameter(torch.cat([weights.w_qkvg, weights.w_fab]), **frozen)
        self.f_b = nn.Parameter(weights.w_fb.clone(), **frozen)
        self.conv_weight = nn.Parameter(weights.conv_weight.float().clone(), **frozen)
        self.a_log = nn.Parameter(weights.a_log.float().clone(), **frozen)
        self.dt_bias = nn.Parameter(weights.dt_bias.float().clone(), **frozen)
        self.o_norm_weight = nn.Parameter(weights.o_norm_weight.float().clone(), **frozen)
        self.o_proj = nn.Parameter(weights.w_o.clone(), **frozen)
        self.use_plan(plan)

    def use_plan(self, plan: Plan | None, for_tuning: bool = False) -> None:
        """Run the projection stage by ``plan`` from now on (``None``: sequential, automatic providers).

        :param for_tuning: the layer is timed in CUDA graphs as the autotuner times stages
            (:class:`KDAProjection`'s ``for_tuning``): overlapped steps fork exactly while a graph is captured,
            whatever the host engine answers (SGLang allows the fork only in its capture mode, not at load).
        """
        weights = ProjectionWeights.from_packed(self.in_proj, self.f_b, self.geometry)
        self.projection = KDAProjection(weights, plan, for_tuning=for_tuning)

    def layer_weights(self) -> KDALayerWeights:
        g = self.geometry
        return KDALayerWeights(
            w_qkvg=self.in_proj[: g.qkvg_rows], w_fab=self.in_proj[g.qkvg_rows :], w_fb=self.f_b,
            conv_weight=self.conv_weight, a_log=self.a_log, dt_bias=self.dt_bias,
            o_norm_weight=self.o_norm_weight, w_o=self.o_proj,
        )

    def new_state(self, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed ``(conv_state [slots, C, W], recurrent_state [slots, h, D, D] fp32)``."""
        g, dev = self.geometry, self.in_proj.device
        conv = torch.zeros(slots, g.conv_channels, g.conv_width, dtype=self.in_proj.dtype, device=dev)
        rec = torch.zeros(slots, g.heads_local, g.head_dim, g.head_dim, dtype=torch.float32, device=dev)
        return conv, rec

    def _validate(self, x: torch.Tensor, conv_state: torch.Tensor, rec_state: torch.Tensor, slots: torch.Tensor):
        g = self.geometry
        if x.dim() != 3 or x.shape[2] != g.hidden_size:
            raise ValueError(f"x: shape {tuple(x.shape)} != expected [B, T, {g.hidden_size}]")
        if conv_state.shape[1:] != (g.conv_channels, g.conv_width) or conv_state.dtype != x.dtype:
            raise ValueError(
                f"conv_state: {tuple(conv_state.shape)} {conv_state.dtype} != [slots, {g.conv_channels}, "
                f"{g.conv_width}] {x.dtype}"
            )
        if rec_state.shape[1:] != (g.heads_local, g.head_dim, g.head_dim) or rec_state.dtype != torch.float32:
            raise ValueError(
                f"recurrent_state: {tuple(rec_state.shape)} {rec_state.dtype} != [slots, {g.heads_local}, "
                f"{g.head_dim}, {g.head_dim}] torch.float32"
            )
        if slots.shape != (x.shape[0],) or slots.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"slots: shape {tuple(slots.shape)} {slots.dtype} != [{x.shape[0]}] int32/int64")
        for name, t in (("conv_state", conv_state), ("recurrent_state", rec_state), ("slots", slots)):
            if t.device != x.device:
                raise ValueError(f"{name}: device {t.device} != x's {x.device}")

    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor,
        recurrent_state: torch.Tensor,
        slots: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run B sequences of T new tokens each; decode is T = 1.

        :param x: ``[B, T, hidden]`` in the weights' dtype.
        :param conv_state: ``[slots, C, W]`` pool, updated in place.
        :param recurrent_state: ``[slots, h, D, D]`` fp32 pool, updated in place.
        :param slots: ``[B]`` int32 or int64 indices into the pools (default ``arange(B)``).
        :returns: ``[B, T, hidden]``, this rank's o_proj partial sum (before the tensor-parallel all-reduce).
        """
        if slots is None:
            slots = torch.arange(x.shape[0], device=x.device)
        self._validate(x, conv_state, recurrent_state, slots)
        slots = slots.long()  # the pools' index_copy_ takes int64 indices only
        if x.device.type != "cuda":
            return self._forward_reference(x, conv_state, recurrent_state, slots)
        return self._forward_fla(x, conv_state, recurrent_state, slots)

    def _forward_reference(self, x, conv_state, rec_state, slots):
        g = self.geometry
        pool_conv = conv_state[slots]
        out, _, rec_new = reference_kda_layer(
            x, self.layer_weights(), g, pool_conv[:, :, 1:].transpose(1, 2), rec_state[slots], self.lower_bound,
            self.eps,
        )
        # fla's conv state keeps the last W inputs (the reference's the last W - 1): shift the new inputs in.
        qkvg = x.reshape(-1, g.hidden_size).float() @ self.in_proj[: g.qkvg_rows].float().t()
        mixed = qkvg[:, : g.conv_channels].reshape(x.shape[0], x.shape[1], -1).to(conv_state.dtype)
        window = torch.cat([pool_conv, mixed.transpose(1, 2)], dim=2)[:, :, -g.conv_width :]
        conv_state.index_copy_(0, slots, window)
        rec_state.index_copy_(0, slots, rec_new)
        return out.to(x.dtype)

    def _forward_fla(self, x, conv_state, rec_state, slots):
        from fla.modules.causal_conv1d import causal_conv1d, causal_conv1d_update
        from fla.modules.norm.fused_norm_gate import rms_norm_gated
        from fla.ops.kda import chunk_kda
        from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

        g = self.geometry
        b, t, _ = x.shape
        h, d, hd = g.heads_local, g.head_dim, g.local_width
        qkvg, g1, beta_raw = self.projection(x.reshape(b * t, g.hidden_size))
        mixed, g_proj = qkvg[:, : 3 * hd], qkvg[:, 3 * hd :]
        if t == 1:
            conv = conv_state[slots]
            y, _ = causal_conv1d_update(mixed, conv, weight=self.conv_weight, activation="silu")
            conv_state.index_copy_(0, slots, conv)
        else:
            y, final = causal_conv1d(
                mixed.reshape(b, t, 3 * hd).contiguous(), weight=self.conv_weight, initial_state=conv_state[slots],
                output_final_state=True, activation="silu",
            )
            conv_state.index_copy_(0, slots, final.to(conv_state.dtype))
        q, k, v = (z.reshape(b, t, h, d) for z in y.reshape(b, t, 3 * hd).split(hd, dim=-1))
        gate = decay_gate(g1.reshape(b, t, h, d), self.a_log, self.dt_bias.reshape(h, d), self.lower_bound)
        beta = torch.sigmoid(beta_raw.float()).reshape(b, t, h)
        if t == 1:
            o, _ = fused_recurrent_kda_fwd(
                q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=gate, beta=beta, initial_state=rec_state,
                inplace_final_state=True, ssm_state_indices=slots, use_qk_l2norm_in_kernel=True,
            )
        else:
            o, final = chunk_kda(
                q.contiguous(), k.contiguous(), v.contiguous(), gate, beta, initial_state=rec_state[slots],
                output_final_state=True, use_qk_l2norm_in_kernel=True,
            )
            rec_state.index_copy_(0, slots, final)
        normed = rms_norm_gated(
            o.reshape(-1, d), g_proj.reshape(-1, d), self.o_norm_weight, None, activation="sigmoid", eps=self.eps
        )
        return (normed.reshape(b * t, hd).to(x.dtype) @ self.o_proj.t()).reshape(b, t, g.hidden_size)
