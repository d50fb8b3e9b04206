"""Weight loads that L2 evicts first: ``cp.async`` (16 bytes, L2 only) with an ``evict_first`` L2 cache policy.

A decode step reads every projection weight once per layer, and not again until the same layer of the next step,
gigabytes of other layers' weights later. Kept in L2 at the usual priority, the streamed weights push out what is
read again soon; with ``evict_first`` they go first. What stays is not measured; the candidates are the activations
every CTA reads, the outputs the next kernel reads (otherwise written back amid the weight stream) and the split-K
partials.

Measured on H200 for Kimi-K3 TP8 (``benchmarks/RESULTS.md``, 2026-11-30, eleventh session): the 48-row QKVG alone
0.4 us faster at M = 1 and 0.8 us at M = 16, the overlapped stage 0.4 and 0.95 us faster.

The CuTe DSL's ``cp.async`` atom takes no cache policy, so both instructions are inline PTX (SM 8.0 and later).
Both are emitted at trace time from inside a ``@cute.kernel``: plain functions whose loops unroll in Python (static
shapes), with no dynamic control flow.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm


def evict_first_policy() -> cutlass.Int64:
    """An L2 cache policy that marks every line it covers evict-first (``createpolicy``; once per kernel)."""
    policy = llvm.inline_asm(
        ir.IntegerType.get_signless(64), [], "createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return cutlass.Int64(policy)


def copy_evict_first(src: cute.Tensor, dst: cute.Tensor, policy: cutlass.Int64) -> None:
    """Start 16-byte ``cp.async`` copies from global ``src`` to shared ``dst`` under ``policy``.

    :param src: one thread's partition of a global tile, ``((1, 8), rows, vectors)`` of 16-bit elements (a
        ``partition_S`` of a 128-bit cp.async tiled copy), each ``(1, 8)`` slice contiguous.
    :param dst: the matching ``partition_D`` in shared memory (a swizzle permutes whole 16-byte vectors only).
    """
    for i in range(cute.size(src, mode=[1])):
        for j in range(cute.size(src, mode=[2])):
            vec_src, vec_dst = src[None, i, j], dst[None, i, j]
            g_addr = vec_src.iterator.toint()
            s_addr = (vec_dst.iterator + cute.crd2idx(0, vec_dst.layout)).toint()
            llvm.inline_asm(
                None, [s_addr.ir_value(), g_addr.ir_value(), policy.ir_value()],
                "cp.async.cg.shared.global.L2::cache_hint [$0], [$1], 16, $2;", "r,l,l",
                has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
            )
