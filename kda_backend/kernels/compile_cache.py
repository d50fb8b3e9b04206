"""Compiling :class:`~kda_backend.kernels.skinny_gemm.SkinnyGemm` once per key and launching it through TVM-FFI.

Kernels are compiled against fake tensors with a symbolic token count M (one binary serves every M up to the
tactic's grid) and the TVM-FFI calling convention, which takes torch tensors directly and launches on torch's
current stream, so a call costs microseconds and works inside CUDA-graph capture. Compiling inside a capture is
refused: :meth:`CompiledGemms.get` must have run for the key beforehand (``KDAProjection.prepare``).

On a machine without a GPU, ``CUTE_DSL_ARCH`` (``sm_90a``, ``sm_100a``) selects the target, so CI compiles every
kernel for every architecture.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import torch

from kda_backend.kernels.skinny_gemm import SkinnyGemm, Tactic


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """What makes two compiled binaries different."""

    tactic: Tactic
    n: int
    k: int
    x_row_stride: int
    w_row_stride: int
    arch: str


def target_arch(device: torch.device | None = None) -> str:
    """``sm_XYa`` of ``device`` (or of ``CUTE_DSL_ARCH`` when set, e.g. for CPU-only compile checks)."""
    forced = os.environ.get("CUTE_DSL_ARCH")
    if forced:
        return forced
    if device is None or device.type != "cuda":
        raise ValueError("no CUDA device to compile for; set CUTE_DSL_ARCH (sm_90a, sm_100a) to cross-compile")
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm_{major}{minor}a"


def compile_gemm(key: KernelKey) -> Any:
    """Compile one kernel for ``key.arch`` and return the TVM-FFI callable ``f(x, w, out_t)`` (with split-K,
    ``out_t`` is the fp32 workspace ``[split_k, M, N]`` permuted to ``(N, M, split_k)``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    gemm = SkinnyGemm(key.tactic, key.n, key.k, key.x_row_stride, key.w_row_stride)
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, key.k), (key.x_row_stride, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (key.n, key.k), (key.w_row_stride, 1), assumed_align=16)
    if key.tactic.split_k > 1:
        out_t = make_fake_tensor(
            cutlass.Float32, (key.n, m, key.tactic.split_k), (1, key.n, cute.sym_int64()), assumed_align=16
        )
    else:
        out_t = make_fake_tensor(cutlass.BFloat16, (key.n, m), (1, key.n), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    return cute.compile(gemm, x, w, out_t, stream, options=f"--enable-tvm-ffi --gpu-arch {key.arch}")


class CompiledGemms:
    """Process-wide in-memory cache of compiled kernels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kernels: dict[KernelKey, Any] = {}

    def get(self, key: KernelKey) -> Any:
        with self._lock:
            kernel = self._kernels.get(key)
        if kernel is not None:
            return kernel
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"kernel {key} was not compiled before CUDA-graph capture; call prepare() first")
        kernel = compile_gemm(key)
        with self._lock:
            return self._kernels.setdefault(key, kernel)

    def __contains__(self, key: KernelKey) -> bool:
        return key in self._kernels


compiled_gemms = CompiledGemms()
