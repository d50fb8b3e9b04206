"""fp32 reference of the projection stage: the oracle for every kernel and the CPU fallback's ground truth.

Given x ``[M, hidden]`` and the rank's weights:

1. ``qkvg = x @ W_qkvg^T``           ``[M, 4*hD]``
2. ``fab  = x @ W_fab^T``            ``[M, fab_rows]``; f_a = ``fab[:, :D]``, beta_raw = ``fab[:, D:D+h]``
3. ``g1   = f_a @ W_fb^T``           ``[M, hD]``

(h = heads_local, D = head_dim, hD = h*D.) The reference rounds f_a to the weights' dtype before step 3, as every
real implementation stores f_a in bf16 between the two GEMMs.
"""

from __future__ import annotations

import torch

from kda_backend.geometry import KDAGeometry


def split_packed(w_packed: torch.Tensor, geometry: KDAGeometry) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy views ``(W_qkvg [4*hD, hidden], W_fab [fab_rows, hidden])`` of a packed ``[packed_rows, hidden]``."""
    expected = (geometry.packed_rows, geometry.hidden_size)
    if tuple(w_packed.shape) != expected:
        raise ValueError(f"packed weight shape {tuple(w_packed.shape)} != expected {expected} for {geometry}")
    return w_packed[: geometry.qkvg_rows], w_packed[geometry.qkvg_rows :]


def reference_projection(
    x: torch.Tensor,
    w_qkvg: torch.Tensor,
    w_fab: torch.Tensor,
    w_fb: torch.Tensor,
    geometry: KDAGeometry,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projection stage from split weights, computed in fp32.

    :param x: ``[M, hidden]`` activations (any float dtype).
    :param w_qkvg: ``[4*hD, hidden]``.
    :param w_fab: ``[fab_rows, hidden]`` (f_a | beta | zero pad).
    :param w_fb: ``[hD, D]``.
    :returns: ``(qkvg [M, 4*hD], g1 [M, hD], beta_raw [M, h])``, all fp32.
    """
    g = geometry
    xf = x.float()
    qkvg = xf @ w_qkvg.float().t()
    fab = xf @ w_fab.float().t()
    f_a = fab[:, : g.head_dim].to(w_fb.dtype).float()
    g1 = f_a @ w_fb.float().t()
    beta = fab[:, g.head_dim : g.head_dim + g.heads_local]
    return qkvg, g1, beta


def reference_projection_packed(
    x: torch.Tensor, w_packed: torch.Tensor, w_fb: torch.Tensor, geometry: KDAGeometry
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The projection stage from packed ``[QKVG; FAB]`` weights ``[packed_rows, hidden]``; same outputs as
    :func:`reference_projection`."""
    w_qkvg, w_fab = split_packed(w_packed, geometry)
    return reference_projection(x, w_qkvg, w_fab, w_fb, geometry)
