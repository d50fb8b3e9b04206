"""The one place tests compare outputs with the fp32 reference and poison outputs before a kernel writes them."""

from __future__ import annotations

import torch

# Relative error (Frobenius norm of the difference over the reference's) allowed per output dtype: bf16 outputs
# carry 8 mantissa bits, and K = 7168 accumulations in fp32 add little to that.
REL_TOLERANCE = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def assert_close(out: torch.Tensor, ref: torch.Tensor, what: str = "output", tolerance: float | None = None) -> None:
    """``out`` (any dtype, any device) has ``ref``'s shape, no NaN, and a relative error within its dtype's
    tolerance (or ``tolerance``)."""
    assert tuple(out.shape) == tuple(ref.shape), f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not out.isnan().any(), f"{what}: NaN"
    ref = ref.float().to(out.device)
    err = ((out.float() - ref).norm() / ref.norm()).item()
    limit = REL_TOLERANCE[out.dtype] if tolerance is None else tolerance
    assert err <= limit, f"{what}: relative error {err:.3g} > {limit}"


def poisoned(*shapes: tuple[int, ...], device: str | torch.device = "cpu",
             dtype: torch.dtype = torch.bfloat16) -> list[torch.Tensor]:
    """One NaN-filled tensor per shape: an output a kernel does not write in full keeps NaN and fails the check."""
    return [torch.full(shape, float("nan"), device=device, dtype=dtype) for shape in shapes]


SENTINEL = 3.0  # what the memory right after an output or workspace holds, and must still hold after a launch
GUARD = 4096  # elements of that memory checked


def guarded(m: int, n: int, dtype: torch.dtype = torch.bfloat16,
            device: str | torch.device = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-poisoned contiguous ``[m, n]`` tensor and the ``GUARD`` elements right after it, holding ``SENTINEL``:
    a kernel that stores past its output changes them."""
    buf = torch.full((m * n + GUARD,), SENTINEL, device=device, dtype=dtype)
    buf[: m * n] = float("nan")
    return buf[: m * n].view(m, n), buf[m * n:]


def projection_outputs(m: int, geometry, device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """Poisoned ``qkvg_out [M, 4hD]``, ``fab_out [M, fab_rows]``, ``g1_out [M, hD]`` for one projection call."""
    g = geometry
    return poisoned((m, g.qkvg_rows), (m, g.fab_rows), (m, g.local_width), device=device)


def packed_kimi_k3_layers(count: int, seed: int, tp: int = 8, device: str | torch.device = "cuda") -> list:
    """``count`` layers of random Kimi-K3 per-rank weights at ``tp``, packed as vLLM keeps them
    ([q|k|v|g|f_a|beta|pad] and f_b), layer ``i`` from seed ``seed + i``."""
    from kda_backend import ProjectionWeights
    from kda_backend.geometry import preset
    from kda_backend.reference import KDALayerWeights

    g = preset("kimi-k3", tp)
    layers = []
    for i in range(count):
        w = KDALayerWeights.random(g, torch.Generator().manual_seed(seed + i), device=device)
        layers.append(ProjectionWeights.from_packed(torch.cat([w.w_qkvg, w.w_fab]), w.w_fb, g))
    return layers
