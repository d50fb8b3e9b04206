"""The FlashInfer provider: ``flashinfer.mm_bf16`` with its Blackwell low-M CuTe DSL kernels (``cute-dsl``).

Optional: supported only where flashinfer is installed, on compute capability 10.x, bf16, with a contiguous x
(``mm_bf16`` takes row-major activations, so F_B's strided f_a view stays with the other providers). Its priority
sits below the project's CuTe kernels and above torch: it serves when those are unavailable, when forced
(``KDA_BACKEND_PROVIDER=flashinfer``), or when the autotuner finds it fastest for a step.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from kda_backend.providers.base import GemmCall, GemmProvider, cuda_bf16_reason

BACKEND = "cute-dsl"
SUPPORTED_MAJORS = (10,)


class FlashInferProvider(GemmProvider):
    name = "flashinfer"
    priority = 50

    def why_not(self, call: GemmCall) -> str | None:
        reason = cuda_bf16_reason(call, SUPPORTED_MAJORS)
        if reason is not None:
            return reason
        if call.x_row_stride != call.k:
            return f"x row stride {call.x_row_stride} != K={call.k}: mm_bf16 needs contiguous activations"
        if call.w_row_stride != call.k:
            return f"weight row stride {call.w_row_stride} != K={call.k}: mm_bf16 needs a column-major w.T"
        if importlib.util.find_spec("flashinfer") is None:
            return "flashinfer is not installed"
        return None

    def prepare(self, call: GemmCall) -> None:
        """One call at this shape, so FlashInfer compiles its kernel now rather than inside a capture."""
        device = torch.device("cuda", torch.cuda.current_device())
        x = torch.zeros(call.m, call.k, device=device, dtype=call.dtype)
        w = torch.zeros(call.n, call.k, device=device, dtype=call.dtype)
        self.run(call.role, x, w, torch.empty(call.m, call.n, device=device, dtype=call.dtype))

    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        flashinfer = importlib.import_module("flashinfer")
        # mm_bf16 takes the weight as [K, N] column-major: exactly w.T, a view of the [N, K] row-major weight.
        flashinfer.mm_bf16(x, w.t(), out=out, backend=BACKEND, pdl=True)
