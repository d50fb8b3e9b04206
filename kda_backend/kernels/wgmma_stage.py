"""The fused stage: the whole projection stage in one Hopper launch, QKVG on most SMs and the side chain (F_A/beta,
then F_B) on the SMs QKVG leaves free, all as tokens-on-M ``wgmma`` tiles of one grid. No fork and no second
launch: the same schedule, and the same bits, on every host, eager or in any graph mode.

- Grid: ``side`` side-chain CTAs (block indices ``0 .. side - 1``, dispatched first), then QKVG's row blocks of
  the stage's tactic, one CTA each; ``side`` is what QKVG leaves of the SMs (4 of 132 for Kimi-K3 TP 8: 128 QKVG
  CTAs of 48 rows). One token tile: M up to the tactic's ``block_t``.
- Side-chain CTA ``i`` first asks L2 for its W_fb tiles (TMA prefetch), then computes F_A/beta's row block ``i``
  (``ceil(fab_rows / side)`` rows, fewer than a QKVG CTA's, in the deepest ring an SM holds, so it finishes first),
  counts it in on ``chain[0]`` (release), waits until every side-chain CTA counted in, then computes
  :data:`FB_PASSES` row blocks of ``g1 = f_a @ W_fb^T`` for every token: f_a (F_A/beta's first ``d`` columns,
  written by the side-chain CTAs) and W_fb arrive by TMA like any operand. The time QKVG's larger row blocks take
  beyond F_A/beta's covers F_B.
- The side-chain CTAs wait only for each other, and they are dispatched before QKVG's, which wait for nothing: the
  launch cannot deadlock. The last side-chain CTA past the wait resets both counters (``chain[1]`` counts them past
  it), so the stream's next launch finds them zero.
- Every tile is one CTA's, accumulated in a fixed order: bitwise deterministic.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync

from kda_backend.kernels.skinny_gemm import MAX_SMEM_BYTES, row_blocks
from kda_backend.kernels.wgmma_gemm import (
    MAX_STAGES,
    RING_OFFSET_BYTES,
    SMS,
    SWIZZLE_ATOM_BYTES,
    WgmmaGemm,
    WgmmaTactic,
    tokens_on_m_rows,
    validate_wgmma_tactic,
)

# QKVG's ring in the fused stage, by token tile. A deeper one streams QKVG no faster alone and takes HBM from the
# side chain's CTAs, more so as their activation tiles grow. Measured on H200 for Kimi-K3 TP 8 (qkvg_tactics.py,
# benchmarks/results/levers/fused-stage/): at M = 24 / 40 / 48 the stage took 22.07 / 22.22 / 22.50 us with 10
# slots against 23.36-25.08 with 12 and 24.46-24.83 with 15; at M = 56 / 64 22.84 / 23.29 with 8 against 22.86 /
# 23.42 with 9 and 24.05 (M = 64) with 10. On other H200s 9 slots ran 0.1-0.3 us faster than 8 at M = 56 / 64 on one
# and 1.3 us slower at M = 64 on another (qkvg-ring-m48-64-second-h200.log, tuned-ring/autotune.txt); one ring tuned
# per tactic bucket lost 0.2-0.9 us at M = 40 / 48 (benchmarks/RESULTS.md, levers).
FUSED_STAGES = ((48, 10), (64, 8))  # (largest token tile, slots)
# The fused stage serves one token tile of tokens-on-M QKVG, up to 64 tokens: above, its 48-row CTAs alone fall behind
# (M = 96: 27.9 us against the floor's 20.9) and the fused stage with them (34.3-34.8 us).
FUSED_MAX_M = 64
STAGE_COUNTERS = 2  # chain[0]: side-chain CTAs whose F_A/beta tile is stored; chain[1]: side-chain CTAs past the wait
FB_PASSES = 2  # F_B row blocks per side-chain CTA (a wgmma tile holds at most 256 rows)
MAX_TILE_ROWS = 256  # tokens_on_m: weight rows are the MMA's N


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How one stage launch divides the work: the tactics of QKVG, F_A/beta and F_B (all tokens-on-M, one token
    tile) and the side-chain CTAs."""

    qkvg: WgmmaTactic
    fab: WgmmaTactic
    fb: WgmmaTactic
    side: int


def plan_stage(tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int,
               sms: int = SMS) -> StagePlan | str:
    """The :class:`StagePlan` of QKVG ``tactic`` on ``sms`` SMs, or why these shapes do not fit the fused stage."""
    if not tactic.tokens_on_m or tactic.split_k != 1:
        return f"tactic {tactic.key()}: the fused stage takes an unsplit tokens_on_m tactic"
    side = sms - row_blocks(qkvg_rows, tactic.block_n)
    if side < 1:
        return f"QKVG's {row_blocks(qkvg_rows, tactic.block_n)} row blocks leave none of {sms} SMs to the side chain"
    fab_block = -(-fab_rows // (side * 8)) * 8
    fb_blocks = side * FB_PASSES
    if fb_rows % fb_blocks or (fb_rows // fb_blocks) % 8 or fb_rows // fb_blocks > MAX_TILE_ROWS:
        return (f"F_B's {fb_rows} rows do not split into {fb_blocks} row blocks of a multiple of 8 up to "
                f"{MAX_TILE_ROWS}")
    if d % 64 or d > fab_rows:
        return f"F_B's K={d} must be a multiple of 64 within F_A/beta's {fab_rows} rows"
    # F_A/beta's CTA streams its weights at the rate of its ring's bytes in flight, so it takes the deepest ring the
    # SM holds (the launch's shared memory is one size for all CTAs, one CTA per SM): fewer rows in more slots than
    # a QKVG CTA, it finishes well before QKVG and leaves that time to F_B.
    fab_probe = dataclasses.replace(tactic, block_n=fab_block, stages=1)
    ring = MAX_SMEM_BYTES - RING_OFFSET_BYTES
    fab_stages = ring // fab_probe.slot_bytes()
    fab = dataclasses.replace(fab_probe, stages=min(MAX_STAGES, fab_stages))
    # F_B's K-tiles all load at once: one ring per pass, each as deep as F_B's K-tiles.
    fb = dataclasses.replace(tactic, block_n=fb_rows // fb_blocks, stages=d // 64, pdl=False)
    if FB_PASSES * fb.stages * fb.slot_bytes() > ring:
        return f"F_B's {FB_PASSES} passes of {fb.stages} K-tiles need more than {ring} bytes of shared memory"
    reason = (validate_wgmma_tactic(tactic, qkvg_rows, k, k) or validate_wgmma_tactic(fab, fab_rows, k, k)
              or validate_wgmma_tactic(fb, fb_rows, d, fab_rows))
    return reason or StagePlan(tactic, fab, fb, side)


def fused_stage_tactic(qkvg_rows: int, k: int, m: int) -> WgmmaTactic | None:
    """QKVG's tactic in the fused stage at ``m`` tokens: :func:`~kda_backend.kernels.wgmma_gemm.tokens_on_m_rows`
    rows per CTA in the ring :data:`FUSED_STAGES` gives its token tile, one token tile; ``None`` above
    :data:`FUSED_MAX_M` or where 64-element K-tiles do not divide K."""
    if m > FUSED_MAX_M or k % 64:
        return None
    tactic = WgmmaTactic(tokens_on_m_rows(qkvg_rows), 64, 64, 1, tokens_on_m=True).for_tokens(m)
    stages = next(slots for tile, slots in FUSED_STAGES if tactic.block_t <= tile)
    return dataclasses.replace(tactic, stages=stages)


def validate_stage(tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int,
                   sms: int = SMS) -> str | None:
    """``None`` if :class:`WgmmaStage` serves these shapes with ``tactic`` on ``sms`` SMs, else why not."""
    found = plan_stage(tactic, qkvg_rows, fab_rows, fb_rows, k, d, sms)
    return found if isinstance(found, str) else None


class WgmmaStage:
    """The fused stage for one QKVG tactic (its ``block_t`` bounds M) and one geometry: QKVG, F_A/beta and
    F_B rows, hidden size ``k`` and F_B's K ``d``; M is a runtime value."""

    def __init__(self, tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int,
                 sms: int = SMS) -> None:
        found = plan_stage(tactic, qkvg_rows, fab_rows, fb_rows, k, d, sms)
        if isinstance(found, str):
            raise ValueError(found)
        self.plan = found
        self.k, self.d, self.fab_rows = k, d, fab_rows
        self.qkvg = WgmmaGemm(found.qkvg, qkvg_rows, k, k, k)
        self.fab = WgmmaGemm(found.fab, fab_rows, k, k, k)
        # F_B's activations: f_a, the first d columns of the F_A/beta output (row stride fab_rows).
        self.fb = WgmmaGemm(found.fb, fb_rows, d, fab_rows, d)

    def smem_bytes(self) -> int:
        """The barrier area, then the largest ring of the three GEMMs (F_B's two passes side by side)."""
        p = self.plan
        rings = (p.qkvg.stages * p.qkvg.slot_bytes(), p.fab.stages * p.fab.slot_bytes(),
                 FB_PASSES * p.fb.stages * p.fb.slot_bytes())
        return RING_OFFSET_BYTES + max(rings)

    def barriers(self) -> int:
        """mbarriers: a full/empty pair per slot of the larger of QKVG's and F_A/beta's rings, then F_B's."""
        p = self.plan
        return 2 * max(p.qkvg.stages, p.fab.stages) + FB_PASSES * 2 * p.fb.stages

    @cute.jit
    def __call__(
        self,
        m_x: cute.Tensor,
        m_w_qkvg: cute.Tensor,
        m_qkvg: cute.Tensor,
        m_w_fab: cute.Tensor,
        m_fab: cute.Tensor,
        m_w_fb: cute.Tensor,
        m_g1: cute.Tensor,
        m_chain: cute.Tensor,
        stream,
    ):
        """``qkvg = x @ w_qkvg.T``, ``fab = x @ w_fab.T``, ``g1 = fab[:, :d] @ w_fb.T``: ``m_x`` (M, K) with M up to
        the tactic's ``block_t``, the weights (rows, K) and outputs (M, rows) contiguous bf16, ``m_w_fb``
        (fb_rows, d); ``m_chain`` int32 ``[STAGE_COUNTERS]``, zero on entry and left zero on exit."""
        p = self.plan
        q_ops = self.qkvg._operands(m_w_qkvg, m_x)
        f_ops = self.fab._operands(m_w_fab, m_x)
        m_fa = cute.make_tensor(m_fab.iterator, cute.make_layout((m_fab.shape[0], self.d), stride=(self.fab_rows, 1)))
        b_ops = self.fb._operands(m_w_fb, m_fa)
        outs = [cute.make_tensor(o.iterator, cute.select(o.layout, mode=[1, 0])) for o in (m_qkvg, m_fab, m_g1)]
        grid = (p.side + row_blocks(self.qkvg.n, p.qkvg.block_n), 1, 1)
        self.stage_kernel(*q_ops, *f_ops, *b_ops, *outs, m_chain).launch(
            grid=grid, block=[p.qkvg.threads, 1, 1], smem=self.smem_bytes(), stream=stream, use_pdl=p.qkvg.pdl
        )

    @cute.kernel
    def stage_kernel(
        self,
        q_w_tma: cute.CopyAtom, q_w_src: cute.Tensor, q_x_tma: cute.CopyAtom, q_x_src: cute.Tensor,
        q_s_w: cute.ComposedLayout, q_s_x: cute.ComposedLayout, q_s_x_box: cute.ComposedLayout, q_mma: cute.TiledMma,
        f_w_tma: cute.CopyAtom, f_w_src: cute.Tensor, f_x_tma: cute.CopyAtom, f_x_src: cute.Tensor,
        f_s_w: cute.ComposedLayout, f_s_x: cute.ComposedLayout, f_s_x_box: cute.ComposedLayout, f_mma: cute.TiledMma,
        b_w_tma: cute.CopyAtom, b_w_src: cute.Tensor, b_x_tma: cute.CopyAtom, b_x_src: cute.Tensor,
        b_s_w: cute.ComposedLayout, b_s_x: cute.ComposedLayout, b_s_x_box: cute.ComposedLayout, b_mma: cute.TiledMma,
        m_qkvg_t: cute.Tensor,
        m_fab_t: cute.Tensor,
        m_g1_t: cute.Tensor,
        m_chain: cute.Tensor,
    ):
        """Per GEMM (``q_`` QKVG, ``f_`` F_A/beta, ``b_`` F_B): TMA atoms and coordinate tensors of weights and
        activations, ring layouts and MMA (see :meth:`WgmmaGemm.kernel`); outputs transposed (rows, M). Block
        indices ``0 .. side - 1`` are the side chain's, the rest QKVG's (see the module docstring)."""
        p = self.plan
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, _, _ = cute.arch.block_idx()
        dtype = m_qkvg_t.element_type
        smem = cutlass.memory.SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, self.barriers(), byte_alignment=8)
        ring = smem.allocate_array(dtype, (self.smem_bytes() - RING_OFFSET_BYTES) // 2,
                                   byte_alignment=SWIZZLE_ATOM_BYTES)
        if bidx >= p.side:
            mainloop, s_w, s_x, s_x_box = self.qkvg._pipeline_on(barriers, ring, dtype, q_s_w, q_s_x, q_s_x_box)
            self.qkvg._tile_per_cta(mainloop, q_w_tma, q_w_src, q_x_tma, q_x_src, s_w, s_x, s_x_box, ring, m_qkvg_t,
                                    None, None, None, q_mma, warp, tidx, bidx - p.side, 0, 0)
        else:
            if tidx == p.qkvg.consumer_threads:  # the producer warp's first thread
                self._prefetch_fb_weights(b_w_tma, b_w_src, ring, b_s_w, dtype, bidx)
            mainloop, s_w, s_x, s_x_box = self.fab._pipeline_on(barriers, ring, dtype, f_s_w, f_s_x, f_s_x_box)
            self.fab._tile_per_cta(mainloop, f_w_tma, f_w_src, f_x_tma, f_x_src, s_w, s_x, s_x_box, ring, m_fab_t,
                                   None, None, None, f_mma, warp, tidx, bidx, 0, 0)
            self._wait_for_side_chain(m_chain, tidx)
            # F_B's passes, each with its own ring and barriers, all loads issued at once.
            fb_barriers = barriers + 2 * max(p.qkvg.stages, p.fab.stages)
            fb_ring = WgmmaGemm.ring_elems(b_s_w, b_s_x)
            for j in cutlass.range_constexpr(FB_PASSES):
                mainloop, s_w, s_x, s_x_box = self.fb._pipeline_on(
                    fb_barriers + j * 2 * p.fb.stages, ring + j * fb_ring, dtype, b_s_w, b_s_x, b_s_x_box
                )
                self.fb._tile_per_cta(mainloop, b_w_tma, b_w_src, b_x_tma, b_x_src, s_w, s_x, s_x_box,
                                      ring + j * fb_ring, m_g1_t, None, None, None, b_mma, warp, tidx,
                                      bidx * FB_PASSES + j, 0, 0)

    def _prefetch_fb_weights(self, b_w_tma, b_w_src, ring, b_s_w, dtype, side_cta):
        """Start reading this side-chain CTA's W_fb tiles into L2 (TMA prefetch), so F_B's loads find them there."""
        t = self.plan.fb
        s_w = cute.make_tensor(cute.recast_ptr(ring, b_s_w.inner, dtype=dtype), b_s_w.outer)
        for j in range(FB_PASSES):
            g_w = cute.local_tile(b_w_src, (t.block_n, t.block_k), (side_cta * FB_PASSES + j, None))
            _, t_gw = cpasync.tma_partition(
                b_w_tma, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2), cute.group_modes(g_w, 0, 2)
            )
            for k in range(self.d // t.block_k):
                cute.prefetch(b_w_tma, t_gw[None, k])

    @cute.jit
    def _wait_for_side_chain(self, m_chain, tidx):
        """Count this CTA's F_A/beta tile in and wait for every side-chain CTA's (the whole CTA). Release: each
        thread's stores are visible device-wide before thread 0 counts in; acquire: thread 0's fence after the
        wait orders the CTA's later reads, and the async-proxy fences let TMA read what generic stores wrote
        (the F_A/beta outputs in global memory, the staged tile in the ring)."""
        side = self.plan.side
        cute.arch.fence_acq_rel_gpu()
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.atomic_add(m_chain.iterator, cutlass.Int32(1), sem="release", scope="gpu")
            # Relaxed polls, one fence after.
            arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            while arrived < side:
                arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
            past = cute.arch.atomic_add(m_chain.iterator + 1, cutlass.Int32(1), sem="relaxed", scope="gpu")
            if past == side - 1:  # every side-chain CTA has seen chain[0] complete
                m_chain[0] = 0
                m_chain[1] = 0
        cute.arch.sync_threads()
        cute.arch.fence_proxy("async.global")


def compile_stage(stage: WgmmaStage, arch: str):
    """``stage`` compiled for ``arch``: the TVM-FFI callable ``f(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, chain)`` over
    torch tensors on torch's current stream (see :meth:`WgmmaStage.__call__`)."""
    from cutlass.cute.runtime import make_fake_tensor

    from kda_backend.kernels.compile_cache import _compile_tagged

    m = cute.sym_int32(symbol="M")

    def bf16(shape):
        return make_fake_tensor(cutlass.BFloat16, shape, (shape[1], 1), assumed_align=16)

    k, qkvg_rows, fab_rows, fb_rows = stage.k, stage.qkvg.n, stage.fab_rows, stage.fb.n
    operands = (
        bf16((m, k)), bf16((qkvg_rows, k)), bf16((m, qkvg_rows)), bf16((fab_rows, k)), bf16((m, fab_rows)),
        bf16((fb_rows, stage.d)), bf16((m, fb_rows)),
        make_fake_tensor(cutlass.Int32, (STAGE_COUNTERS,), (1,), assumed_align=4),
    )
    return _compile_tagged(stage, operands, arch)

