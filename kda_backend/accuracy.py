"""How close a bf16 kernel output is to its fp32 reference: what the autotuner's gates and the provider's first-use
checks accept. A leaf module (torch only), so the kernel and provider layers may use it."""

from __future__ import annotations

import torch

BF16_TOLERANCE = 1e-2  # relative error of a bf16 output against fp32 (8 mantissa bits)


def output_error(out: torch.Tensor, ref: torch.Tensor) -> str | None:
    """Why ``out`` is not ``ref`` (fp32) as a bf16 result, or ``None``: a NaN (a part left unwritten after the
    output was poisoned), or a relative error above :data:`BF16_TOLERANCE`."""
    if out.isnan().any():
        return "NaN in its output"
    error = ((out.float() - ref).norm() / ref.norm()).item()
    return None if error <= BF16_TOLERANCE else f"relative error {error:.2g} > {BF16_TOLERANCE}"
