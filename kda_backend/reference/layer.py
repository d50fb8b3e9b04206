"""fp32 reference of one whole KDA layer (decode and prefill), with explicit state in and out.

For x ``[B, T, hidden]`` (B sequences, T new tokens each; decode is T = 1), per rank:

1. projection stage (:mod:`kda_backend.reference.projection`) -> qkvg, g1, beta_raw
2. short causal conv (width W) + SiLU over q|k|v, continuing from ``conv_state`` (the last W-1 inputs)
3. q, k L2-normalised per head, q scaled by D^-0.5
4. decay ``g = lower_bound * sigmoid(exp(A_log) * (g1 + dt_bias))``, or ``-exp(A_log) * softplus(g1 + dt_bias)``
   when there is no lower bound; ``beta = sigmoid(beta_raw)``
5. the delta-rule recurrence (:mod:`kda_backend.reference.recurrence`), fp32 state ``[B, h, D, D]``
6. gated RMSNorm per head: ``rmsnorm(o) * o_norm_weight * sigmoid(g_proj)``
7. o_proj: ``[B, T, hD] @ W_o^T`` -> ``[B, T, hidden]`` (this rank's partial sum, before the all-reduce)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from kda_backend.geometry import KDAGeometry
from kda_backend.reference.projection import reference_projection
from kda_backend.reference.recurrence import recurrence_token_loop


@dataclasses.dataclass
class KDALayerWeights:
    """One rank's KDA layer parameters (h = heads_local, D = head_dim, hD = h*D, W = conv width).

    :param w_qkvg: ``[4*hD, hidden]`` bf16.
    :param w_fab: ``[fab_rows, hidden]`` bf16 (f_a | beta | zero pad).
    :param w_fb: ``[hD, D]`` bf16.
    :param conv_weight: ``[3*hD, W]`` fp32, depthwise causal conv of q|k|v.
    :param a_log: ``[h]`` fp32.
    :param dt_bias: ``[hD]`` fp32.
    :param o_norm_weight: ``[D]`` fp32, shared by all heads.
    :param w_o: ``[hidden, hD]`` bf16.
    """

    w_qkvg: torch.Tensor
    w_fab: torch.Tensor
    w_fb: torch.Tensor
    conv_weight: torch.Tensor
    a_log: torch.Tensor
    dt_bias: torch.Tensor
    o_norm_weight: torch.Tensor
    w_o: torch.Tensor

    @classmethod
    def random(
        cls, geometry: KDAGeometry, generator: torch.Generator, dtype: torch.dtype = torch.bfloat16, device: str = "cpu"
    ) -> KDALayerWeights:
        """Random weights scaled so activations stay O(1); FAB pad rows are zero as in real checkpoints."""
        g = geometry

        def randn(*shape: int, scale: float) -> torch.Tensor:
            return (torch.randn(*shape, generator=generator) * scale).to(device)

        w_fab = randn(g.fab_rows, g.hidden_size, scale=g.hidden_size**-0.5)
        w_fab[g.fab_rows_used :] = 0
        return cls(
            w_qkvg=randn(g.qkvg_rows, g.hidden_size, scale=g.hidden_size**-0.5).to(dtype),
            w_fab=w_fab.to(dtype),
            w_fb=randn(g.local_width, g.head_dim, scale=g.head_dim**-0.5).to(dtype),
            conv_weight=randn(g.conv_channels, g.conv_width, scale=g.conv_width**-0.5),
            a_log=randn(g.heads_local, scale=0.5),
            dt_bias=randn(g.local_width, scale=0.5),
            o_norm_weight=1.0 + randn(g.head_dim, scale=0.1),
            w_o=randn(g.hidden_size, g.local_width, scale=g.local_width**-0.5).to(dtype),
        )


def causal_conv_silu(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU continuing from a state.

    :param x: ``[B, T, C]``.
    :param conv_state: ``[B, W-1, C]``, the W-1 inputs before ``x`` (oldest first).
    :param weight: ``[C, W]``; ``weight[:, -1]`` multiplies the current token.
    :returns: ``(y [B, T, C] fp32, new_state [B, W-1, C] in conv_state's dtype)``.
    """
    width = weight.shape[1]
    full = torch.cat([conv_state.float(), x.float()], dim=1)
    windows = full.unfold(1, width, 1)  # [B, T, C, W]
    y = F.silu((windows * weight.float()).sum(-1))
    return y, full[:, -(width - 1) :].to(conv_state.dtype)


def decay_gate(g1: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """Per-channel log-decay from the raw gate.

    :param g1: ``[..., h, D]`` raw gate (F_B output).
    :param a_log: ``[h]``.
    :param dt_bias: ``[h, D]``.
    :returns: ``[..., h, D]`` fp32, all <= 0.
    """
    a = a_log.float().exp().unsqueeze(-1)
    z = g1.float() + dt_bias.float()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * z)
    return -a * F.softplus(z)


def gated_rmsnorm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``rmsnorm(o) * weight * sigmoid(gate)`` over the last dim. o, gate ``[..., D]``; weight ``[D]``."""
    o = o.float()
    normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)
    return normed * weight.float() * torch.sigmoid(gate.float())


def reference_kda_layer(
    x: torch.Tensor,
    weights: KDALayerWeights,
    geometry: KDAGeometry,
    conv_state: torch.Tensor,
    recurrent_state: torch.Tensor,
    lower_bound: float | None = -5.0,
    eps: float = 1e-5,
    recurrence=recurrence_token_loop,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One KDA layer for B sequences of T new tokens each.

    :param x: ``[B, T, hidden]``.
    :param conv_state: ``[B, W-1, 3*hD]``.
    :param recurrent_state: ``[B, h, D, D]`` fp32.
    :param recurrence: :func:`recurrence_token_loop` or :func:`~kda_backend.reference.recurrence.recurrence_chunked`.
    :returns: ``(out [B, T, hidden] fp32, new conv_state, new recurrent_state)``; inputs are not modified.
    """
    g = geometry
    b, t, _ = x.shape
    h, d, hd = g.heads_local, g.head_dim, g.local_width
    qkvg, g1, beta_raw = reference_projection(x.reshape(b * t, -1), weights.w_qkvg, weights.w_fab, weights.w_fb, g)
    qkvg = qkvg.reshape(b, t, 4 * hd)
    mixed, g_proj = qkvg[..., : 3 * hd], qkvg[..., 3 * hd :]
    conv_out, new_conv = causal_conv_silu(mixed.to(x.dtype), conv_state, weights.conv_weight)
    q, k, v = (z.reshape(b, t, h, d) for z in conv_out.split(hd, dim=-1))
    q = F.normalize(q, dim=-1) * d**-0.5
    k = F.normalize(k, dim=-1)
    gate = decay_gate(g1.reshape(b, t, h, d), weights.a_log, weights.dt_bias.reshape(h, d), lower_bound)
    beta = torch.sigmoid(beta_raw.reshape(b, t, h))
    o, new_state = recurrence(q, k, v, gate, beta, recurrent_state.float())
    normed = gated_rmsnorm(o, g_proj.reshape(b, t, h, d), weights.o_norm_weight, eps)
    out = normed.reshape(b, t, hd).to(x.dtype).float() @ weights.w_o.float().t()
    return out, new_conv, new_state.to(recurrent_state.dtype)
