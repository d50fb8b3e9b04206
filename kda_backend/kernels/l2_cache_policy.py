"""L2 cache policies for the skinny GEMM's loads: weights evict-first, activations evict-last.

A decode step reads every projection weight once per layer, and not again until the same layer of the next step,
gigabytes of other layers' weights later. Activations are the opposite: every CTA along the weight rows reads the
same token tile (128 CTAs for Kimi-K3's QKVG at TP8). So the weights' lines are marked ``evict_first`` and the
activations' ``evict_last``: the streamed weights go first and the shared tile stays.

Measured on H200 for Kimi-K3 TP8 (``benchmarks/RESULTS.md``, levers): evict-first weights make the 48-row QKVG
alone 0.4 us faster at M = 1 and 0.8 us at M = 16; evict-last activations on top of them make it 2.9-4.0 us faster
at M = 24 and 32 (32-token tiles), where evict-first weights alone make the 64-row tiles 3 us slower, and up to
0.2 us faster at M = 8 and 16.

The CuTe DSL's ``cp.async`` atom takes no cache policy, and its bulk copy drops the one it is given (DSL 4.8.1:
the PTX has no hint), so the policy, the 16-byte copies and the bulk copy are inline PTX (SM 9.0 for the bulk copy);
its TMA copy takes the policy as ``cache_policy``. Everything here is emitted at trace time from inside a
``@cute.kernel`` on static shapes.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm

EVICT_FIRST = "evict_first"
EVICT_LAST = "evict_last"
VECTOR_ELEMS = 8  # 16-bit elements per 16-byte cp.async


def l2_policy(priority: str) -> cutlass.Int64:
    """An L2 cache policy giving every line it covers ``priority`` (:data:`EVICT_FIRST` or :data:`EVICT_LAST`;
    ``createpolicy``, once per kernel)."""
    policy = llvm.inline_asm(
        ir.IntegerType.get_signless(64), [], f"createpolicy.fractional.L2::{priority}.b64 $0, 1.0;", "=l",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Int64(policy)


def _cp_async_vector(src: cute.Tensor, dst: cute.Tensor, policy: cutlass.Int64, via_l1: bool) -> None:
    """One 16-byte ``cp.async`` from global ``src`` to shared ``dst`` (each one contiguous vector) under ``policy``;
    ``via_l1`` caches it in L1 too (``.ca``), else L2 only (``.cg``)."""
    g_addr = src.iterator.toint()
    s_addr = (dst.iterator + cute.crd2idx(0, dst.layout)).toint()
    llvm.inline_asm(
        None, [s_addr.ir_value(), g_addr.ir_value(), policy.ir_value()],
        f"cp.async.{'ca' if via_l1 else 'cg'}.shared.global.L2::cache_hint [$0], [$1], 16, $2;", "r,l,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )


def _check_vectors(src: cute.Tensor) -> None:
    if cute.size(src, mode=[0]) != VECTOR_ELEMS:
        raise ValueError(f"expected one {VECTOR_ELEMS}-element vector per copy, got a value mode of {src.shape[0]}")


def copy_with_policy(src: cute.Tensor, dst: cute.Tensor, policy: cutlass.Int64) -> None:
    """Start every 16-byte ``cp.async`` (L2 only) of one thread's partition from global ``src`` to shared ``dst``.

    :param src: a ``partition_S`` of a 128-bit cp.async tiled copy, ``(vector, rows, vectors)`` of 16-bit
        elements, mode 0 one contiguous 16-byte vector of eight elements.
    :param dst: the matching ``partition_D`` in shared memory (a swizzle permutes whole 16-byte vectors only).
    """
    _check_vectors(src)
    for i in range(cute.size(src, mode=[1])):
        for j in range(cute.size(src, mode=[2])):
            _cp_async_vector(src[None, i, j], dst[None, i, j], policy, False)


@cute.jit
def copy_with_policy_where(
    src: cute.Tensor, dst: cute.Tensor, pred: cute.Tensor, policy: cutlass.Int64, via_l1: cutlass.Constexpr[bool]
):
    """:func:`copy_with_policy` for the vectors whose ``pred[0, row, vector]`` holds (``via_l1``: through L1)."""
    _check_vectors(src)
    for i in cutlass.range(cute.size(src, mode=[1]), unroll_full=True):
        for j in cutlass.range(cute.size(src, mode=[2]), unroll_full=True):
            if pred[0, i, j]:
                _cp_async_vector(src[None, i, j], dst[None, i, j], policy, via_l1)


def bulk_copy_with_policy(src: cute.Tensor, dst: cute.Tensor, size_bytes: int, mbar: cute.Pointer,
                          policy: cutlass.Int64) -> None:
    """One bulk copy (``cp.async.bulk``, no tensor map) of ``size_bytes`` contiguous bytes from global ``src`` to
    shared ``dst``, completed on the mbarrier at ``mbar``, under ``policy``; both start 16-byte aligned."""
    llvm.inline_asm(
        None,
        [dst.iterator.toint().ir_value(), src.iterator.toint().ir_value(), cutlass.Int32(size_bytes).ir_value(),
         mbar.toint().ir_value(), policy.ir_value()],
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [$0], [$1], $2, [$3], $4;",
        "r,l,r,r,l",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
