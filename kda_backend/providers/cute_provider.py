"""The CuTe DSL provider: the skinny swap-AB kernel of :mod:`kda_backend.kernels.skinny_gemm` for every role.

Supported: CUDA devices of compute capability 9.x (Hopper) and 10.x (Blackwell), bf16, M up to ``MAX_M``, shapes
the kernel tiles exactly (N a multiple of 16, K of 64, 16-byte aligned rows). The tactic per (role, M bucket) comes
from the tuned tactic table when one was loaded (:meth:`CuteDslProvider.add_tactics`), else the kernel's default.
"""

from __future__ import annotations

import importlib.util

import torch

from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import compiled_gemms, kernel_key
from kda_backend.kernels.skinny_gemm import Tactic, block_t_for, default_tactic, validate_tactic
from kda_backend.providers.base import GemmCall, GemmProvider, cuda_bf16_reason

MAX_M = 64
SUPPORTED_MAJORS = (9, 10)


class CuteDslProvider(GemmProvider):
    name = "cute"
    priority = 100

    def __init__(self) -> None:
        self._tactics: dict[tuple[str, int, int, int], Tactic] = {}

    def add_tactics(self, tactics: dict[tuple[str, int, int, int], Tactic]) -> None:
        """Install tuned tactics keyed by ``(role, n, k, block_t)`` (later entries win)."""
        self._tactics.update(tactics)

    def tactic(self, call: GemmCall) -> Tactic:
        bucket = block_t_for(call.m)
        tuned = self._tactics.get((call.role, call.n, call.k, bucket))
        if tuned is not None:
            return tuned
        return default_tactic(call.n, call.k, call.m)

    def why_not(self, call: GemmCall) -> str | None:
        reason = cuda_bf16_reason(call, SUPPORTED_MAJORS)
        if reason is not None:
            return reason
        if call.m > MAX_M:
            return f"M > {MAX_M}"
        if importlib.util.find_spec("cutlass") is None or importlib.util.find_spec("tvm_ffi") is None:
            return "nvidia-cutlass-dsl or apache-tvm-ffi is not installed"
        if call.n % 16 or call.k % 64:
            return f"N={call.n} must be a multiple of 16 and K={call.k} of 64"
        return validate_tactic(self.tactic(call), call.n, call.k, call.x_row_stride)

    def prepare(self, call: GemmCall) -> None:
        device = torch.device("cuda", torch.cuda.current_device())
        tactic = self.tactic(call)
        compiled_gemms.get(kernel_key(tactic, call.n, call.k, call.x_row_stride, call.w_row_stride, device))
        if tactic.split_k > 1:
            arrival_counters.reserve(device)

    def run(self, role: str, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        for name, t in (("x", x), ("w", w), ("out", out)):
            if t.data_ptr() % 16:
                raise ValueError(f"{role}: {name} data pointer is not 16-byte aligned")
        if not out.is_contiguous():
            raise ValueError(f"{role}: out must be contiguous [M, N], got stride {out.stride()}")
        call = GemmCall(role, x.shape[0], w.shape[0], w.shape[1], x.dtype, "cuda", None, x.stride(0), w.stride(0))
        launch(self.tactic(call), x, w, out)


def launch(tactic: Tactic, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    """``out[M, N] = x @ w.T`` with one tactic (compiled on first use; never inside a capture)."""
    m, n, k = x.shape[0], w.shape[0], w.shape[1]
    kernel = compiled_gemms.get(kernel_key(tactic, n, k, x.stride(0), w.stride(0), x.device))
    if tactic.split_k == 1:
        kernel(x, w, out.t())
        return
    tiles = n // tactic.block_n * -(-m // tactic.block_t)
    counters = arrival_counters.for_stream(torch.cuda.current_stream(x.device), tiles)
    workspace = torch.empty(tactic.split_k, m, n, device=x.device, dtype=torch.float32)
    kernel(x, w, out.t(), workspace.permute(2, 1, 0), counters)
