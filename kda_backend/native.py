"""Each engine's own projection stage at one M, as its release decides it, expressed as a plan step: the baselines
``kda-backend bench`` times beside this project's plan.

- vLLM 0.33 (``KimiK3DeltaAttention.forward``): overlap only at TP8, bf16, ``0 < M <= 14``, inside a full CUDA-graph
  capture; QKVG by ``torch.mm`` (cuBLAS) on Hopper and by CuTe skinny / FlashInfer kernels on Blackwell, F_A/beta
  and F_B by CuTe skinny kernels on the aux stream. Everywhere else: one cuBLAS GEMM over the packed
  ``[QKVG; FAB]`` weight, then F_B.
- SGLang 0.5.23 (``forward_qkvbfg_fused``): overlap in capture mode for ``0 < M <= 64`` on Hopper (128 on
  Blackwell): cuBLAS QKVG on the main stream, F_A/beta and F_B on ``alt_streams[2]`` by a tiny GEMV where M is small
  and cuBLAS beyond; sequential cuBLAS over its two separate weights above that.

The engines' own skinny kernels cannot run here; each is modelled by the closest kernel this package runs, and
:func:`describe` says which.
"""

from __future__ import annotations

from kda_backend.geometry import KDAGeometry
from kda_backend.plan import SEQUENTIAL_TORCH, Step

VLLM_OVERLAP_MAX_M = 14
VLLM_OVERLAP_TP = 8
SGLANG_OVERLAP_MAX_M = {9: 64, 10: 128}


def vllm_step(geometry: KDAGeometry, m: int, capability: tuple[int, int]) -> Step:
    """vLLM's stage at ``m`` tokens (over its packed weight): its CuTe/FlashInfer side-chain and Blackwell QKVG
    kernels are modelled by this package's CuTe kernels."""
    if geometry.tp_size == VLLM_OVERLAP_TP and 0 < m <= VLLM_OVERLAP_MAX_M and capability[0] in (9, 10):
        return Step(overlap=True, qkvg="torch" if capability[0] == 9 else "cute", fab="cute", fb="cute")
    return SEQUENTIAL_TORCH


def sglang_step(m: int, capability: tuple[int, int]) -> Step:
    """SGLang's stage at ``m`` tokens (over its split weights): its tiny side-chain GEMV is modelled by cuBLAS."""
    if 0 < m <= SGLANG_OVERLAP_MAX_M.get(capability[0], 0):
        return Step(overlap=True, qkvg="torch", fab="torch", fb="torch")
    return SEQUENTIAL_TORCH


def describe() -> str:
    """One line per engine naming the kernels that stand in for the engine's own."""
    return (
        "vllm_native: vLLM 0.33's decision per M over packed weights; its CuTe/FlashInfer skinny kernels are "
        "modelled by kda-backend's CuTe kernels\n"
        "sglang_native: SGLang 0.5.23's decision per M over split weights; its tiny side-chain GEMV is modelled by "
        "cuBLAS"
    )
