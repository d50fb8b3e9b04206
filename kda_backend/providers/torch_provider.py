"""The always-available provider: ``torch.mm`` (cuBLAS on CUDA, the CPU BLAS otherwise)."""

from __future__ import annotations

import torch

from kda_backend.providers.base import GemmCall, GemmProvider


class TorchProvider(GemmProvider):
    """Serves every role, dtype and device; the last link of every dispatch chain."""

    name = "torch"
    priority = 0

    def why_not(self, call: GemmCall) -> str | None:
        return None

    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        torch.mm(x, w.t(), out=out)
