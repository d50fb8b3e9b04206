"""Validated, zero-copy views of one rank's projection weights, from either engine's layout.

Each argument is checked where it enters (:meth:`ProjectionWeights.from_split`, :meth:`ProjectionWeights.from_packed`):
a wrong type raises ``TypeError`` and a wrong shape, dtype, device or stride ``ValueError``, naming the argument,
what it is and what is accepted.
"""

from __future__ import annotations

import dataclasses

import torch

from kda_backend.geometry import KDAGeometry

# Float dtypes the GEMM providers compute in (the engines serve bf16; the torch provider takes the others on CPU).
DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def require_tensor(name: str, t: object) -> None:
    """Raise ``TypeError`` naming the argument ``name`` and its type unless ``t`` is a tensor."""
    if not isinstance(t, torch.Tensor):
        kind = f"{type(t).__module__}.{type(t).__qualname__}".removeprefix("builtins.")
        raise TypeError(f"{name}: {kind}; accepted: a torch.Tensor")


def _check_type(name: str, t: object) -> torch.Tensor:
    require_tensor(name, t)
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype}; accepted: {', '.join(map(str, DTYPES))}")
    if t.dim() != 2:
        raise ValueError(f"{name}: {t.dim()}-D tensor of shape {tuple(t.shape)}; accepted: a 2-D [rows, cols] weight")
    return t


def _check_geometry(geometry: object) -> KDAGeometry:
    if not isinstance(geometry, KDAGeometry):
        raise TypeError(f"geometry: {type(geometry).__name__}; accepted: a KDAGeometry (kda_backend.preset(...))")
    return geometry


def _check(name: str, t: torch.Tensor, shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> None:
    _check_type(name, t)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: shape {tuple(t.shape)} != expected {shape}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype {t.dtype} != expected {dtype} (all projection weights share one dtype)")
    if t.device != device:
        raise ValueError(f"{name}: device {t.device} != expected {device}")
    if t.stride(1) != 1:
        raise ValueError(f"{name}: stride {t.stride()} must be unit along the input dim (row-major rows)")


@dataclasses.dataclass(frozen=True)
class ProjectionWeights:
    """QKVG ``[4*hD, hidden]``, FAB ``[fab_rows, hidden]`` and F_B ``[hD, D]`` of one rank, as views.

    ``packed`` is the ``[packed_rows, hidden]`` tensor both views come from when the engine stores them packed
    (vLLM), else ``None`` (SGLang keeps two tensors).
    """

    w_qkvg: torch.Tensor
    w_fab: torch.Tensor
    w_fb: torch.Tensor
    geometry: KDAGeometry
    packed: torch.Tensor | None = None

    @classmethod
    def from_split(
        cls, w_qkvg: torch.Tensor, w_fab: torch.Tensor, w_fb: torch.Tensor, geometry: KDAGeometry
    ) -> ProjectionWeights:
        """Views of SGLang's layout: QKVG ``[4*hD, hidden]``, FAB ``[fab_rows, hidden]`` and F_B ``[hD, D]``, one
        float dtype (:data:`DTYPES`) and device, unit stride along the input dim.

        :raises TypeError: an argument of the wrong type.
        :raises ValueError: a wrong shape, dtype, device or stride (naming the argument).
        """
        g = _check_geometry(geometry)
        dtype, device = _check_type("w_qkvg", w_qkvg).dtype, w_qkvg.device
        _check("w_qkvg", w_qkvg, (g.qkvg_rows, g.hidden_size), dtype, device)
        _check("w_fab", w_fab, (g.fab_rows, g.hidden_size), dtype, device)
        _check("w_fb", w_fb, g.fb_shape, dtype, device)
        return cls(w_qkvg, w_fab, w_fb, g)

    @classmethod
    def from_packed(cls, w_packed: torch.Tensor, w_fb: torch.Tensor, geometry: KDAGeometry) -> ProjectionWeights:
        """Views of vLLM's layout: ``w_packed`` ``[qkvg_rows + fab_rows, hidden]`` (QKVG on FAB) and F_B
        ``[hD, D]``, checked as in :meth:`from_split`."""
        g = _check_geometry(geometry)
        _check_type("w_packed", w_packed)
        _check("w_packed", w_packed, (g.packed_rows, g.hidden_size), w_packed.dtype, w_packed.device)
        w_qkvg, w_fab = w_packed[: g.qkvg_rows], w_packed[g.qkvg_rows :]
        split = cls.from_split(w_qkvg, w_fab, w_fb, g)
        return dataclasses.replace(split, packed=w_packed)

    @property
    def dtype(self) -> torch.dtype:
        return self.w_qkvg.dtype

    @property
    def device(self) -> torch.device:
        return self.w_qkvg.device

    def of_role(self, role: str) -> torch.Tensor:
        """The weight of the GEMM ``role`` (``qkvg``, ``fab`` or ``fb``)."""
        return {"qkvg": self.w_qkvg, "fab": self.w_fab, "fb": self.w_fb}[role]
