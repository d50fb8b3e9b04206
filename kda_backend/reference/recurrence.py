"""The KDA delta-rule recurrence in two independent forms, so the oracle checks itself.

Per head, state ``S [D_k, D_v]`` (fp32). For each token t with q_t, k_t ``[D_k]``, v_t ``[D_v]``, per-channel
log-decay g_t ``[D_k]`` (<= 0) and beta_t (scalar in (0, 1)):

    S   <- diag(exp(g_t)) S
    u_t  = beta_t * (v_t - S^T k_t)
    S   <- S + k_t u_t^T
    o_t  = S^T q_t

:func:`recurrence_token_loop` runs that loop. :func:`recurrence_chunked` solves a whole chunk at once: with
cumulative log-decays G_t = sum_{s<=t} g_s, the updates satisfy the lower-triangular system
``(I + diag(beta) L) U = diag(beta) (V - (K*e^G) S_0)`` with ``L[t, s] = sum_c k_t k_s e^{G_t - G_s}`` (s < t), and
``O = (Q*e^G) S_0 + tril(P) U`` with ``P[t, s] = sum_c q_t k_s e^{G_t - G_s}``; only decay differences with
t >= s are exponentiated, so nothing overflows.
"""

from __future__ import annotations

import torch


def recurrence_token_loop(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token recurrence.

    :param q: ``[B, T, H, D]`` (already normalised and scaled).
    :param k: ``[B, T, H, D]``.
    :param v: ``[B, T, H, D]``.
    :param g: ``[B, T, H, D]`` log-decay per key channel.
    :param beta: ``[B, T, H]``.
    :param state: ``[B, H, D, D]`` initial state (not modified).
    :returns: ``(o [B, T, H, D], final_state [B, H, D, D])`` in the dtype of ``state``.
    """
    dtype = state.dtype
    s = state.clone()
    outs = []
    for t in range(q.shape[1]):
        qt, kt, vt = (z[:, t].to(dtype) for z in (q, k, v))
        s = s * g[:, t].to(dtype).exp().unsqueeze(-1)
        u = beta[:, t].to(dtype).unsqueeze(-1) * (vt - torch.einsum("bhkv,bhk->bhv", s, kt))
        s = s + kt.unsqueeze(-1) * u.unsqueeze(-2)
        outs.append(torch.einsum("bhkv,bhk->bhv", s, qt))
    return torch.stack(outs, dim=1), s


def recurrence_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 16,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk-parallel closed form of :func:`recurrence_token_loop` (same arguments and results)."""
    dtype = state.dtype
    q, k, v, g, beta = (z.to(dtype) for z in (q, k, v, g, beta))
    s = state.clone()
    outs = []
    for start in range(0, q.shape[1], chunk_size):
        sl = slice(start, start + chunk_size)
        # [B, H, C, D] / [B, H, C]
        qc, kc, vc, gc = (z[:, sl].transpose(1, 2) for z in (q, k, v, g))
        bc = beta[:, sl].transpose(1, 2)
        n = qc.shape[2]
        cum = gc.cumsum(dim=2)
        # decay[t, s, c] = exp(G_t - G_s), masked to t >= s before exponentiating.
        diff = cum.unsqueeze(3) - cum.unsqueeze(2)
        lower_incl = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        decay = torch.where(lower_incl[..., None], diff, torch.full_like(diff, float("-inf"))).exp()
        l_mat = torch.einsum("bhtc,bhsc,bhtsc->bhts", kc, kc, decay).tril(-1)
        p_mat = torch.einsum("bhtc,bhsc,bhtsc->bhts", qc, kc, decay)
        k_dec = kc * cum.exp()
        rhs = bc.unsqueeze(-1) * (vc - k_dec @ s)
        eye = torch.eye(n, dtype=dtype, device=q.device)
        u = torch.linalg.solve_triangular(eye + bc.unsqueeze(-1) * l_mat, rhs, upper=False)
        outs.append(((qc * cum.exp()) @ s + p_mat @ u).transpose(1, 2))
        tail = (cum[:, :, -1:] - cum).exp()
        s = cum[:, :, -1].exp().unsqueeze(-1) * s + (kc * tail).transpose(-1, -2) @ u
    return torch.cat(outs, dim=1), s
