"""Reads of another CTA's shared memory inside a thread-block cluster (distributed shared memory, SM 9.0+).

The CuTe DSL (4.8.1) maps a shared-memory pointer into a peer CTA's window (``cute.arch.map_dsmem_ptr``) but neither
loads through the mapped pointer nor through a tensor over it, so the mapping and the load are one inline PTX
statement. It is emitted with side effects: the compiler then keeps it after the cluster barrier that makes the
peer's writes visible, which an ordinary (pure) statement could be hoisted above.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm

VECTOR_FLOATS = 4  # fp32 elements per 16-byte shared-memory load


def load_peer_f32x4(ptr: cute.Pointer, rank: cutlass.Int32 | int) -> list[cutlass.Float32]:
    """The 4 fp32 values at ``ptr`` (this CTA's shared memory, 16-byte aligned) in the shared memory of the cluster's
    CTA ``rank`` (``mapa`` + ``ld.shared::cluster.v4.f32``; ``rank`` may be this CTA's own)."""
    f32 = ir.F32Type.get()
    values = llvm.inline_asm(
        llvm.StructType.get_literal([f32] * VECTOR_FLOATS),
        [ptr.toint().ir_value(), cutlass.Int32(rank).ir_value()],
        "{\n.reg .b32 peer;\nmapa.shared::cluster.u32 peer, $4, $5;\n"
        "ld.shared::cluster.v4.f32 {$0, $1, $2, $3}, [peer];\n}",
        "=f,=f,=f,=f,r,r",
        has_side_effects=True, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT,
    )
    return [cutlass.Float32(llvm.extractvalue(f32, values, [i])) for i in range(VECTOR_FLOATS)]
