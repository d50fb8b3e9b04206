"""The whole projection stage in one Hopper launch: QKVG and F_A/beta as tokens-on-M wgmma tiles of one grid, F_B
in the QKVG CTAs' epilogues (no fork, no second launch: the same bits on every host).

- Grid: ``fab_blocks + qkvg_blocks`` row blocks of one ``tokens_on_m`` tactic (``block_n`` weight rows each) by
  the token tiles. F_A/beta's row blocks come first (the lowest block indices), so they are dispatched before the
  CTAs that wait for them.
- An F_A/beta CTA stores its tile and counts it in on ``chain[0]`` (release: the tile is visible device-wide first).
- A QKVG CTA stores its tile; those of the first token tile then wait until every F_A/beta tile is counted in and
  compute their share of ``g1 = f_a @ W_fb^T`` (``fb_rows / qkvg_blocks`` rows, every token): f_a and the share of
  W_fb staged in the drained ring, ``mma.sync`` into fp32 in a fixed order, so the result is deterministic. Every
  QKVG CTA then counts itself out on ``chain[1]``; the last one resets both counters for the stream's next launch.
- The F_A/beta tiles take as long as QKVG's (the same rows per CTA over the same K), so F_B starts about when
  QKVG's last tile is stored, without a kernel boundary between them.

Not yet run on a GPU: a prototype for the mid-M stage (issue: stage at the floor from M = 17), compile-checked
for sm_90a on the CPU.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.nvgpu import cpasync

from kda_backend.kernels.skinny_gemm import COPY_BITS, ELEMS_PER_COPY, MMA_SHAPE
from kda_backend.kernels.wgmma_gemm import WgmmaGemm, WgmmaTactic, validate_wgmma_tactic

ROW_PAD = 8  # bf16 elements past each staged row: consecutive rows then start on different shared-memory banks
STAGE_COUNTERS = 2  # chain[0]: F_A/beta tiles stored; chain[1]: QKVG CTAs done


def validate_stage(tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int) -> str | None:
    """``None`` if :class:`WgmmaStage` serves these shapes with ``tactic``, else why not."""
    if not tactic.tokens_on_m or tactic.split_k != 1:
        return f"tactic {tactic.key()}: the one-launch stage takes an unsplit tokens_on_m tactic"
    for name, rows in (("QKVG", qkvg_rows), ("F_A/beta", fab_rows)):
        if rows % tactic.block_n:
            return f"{name}'s {rows} rows are not a multiple of block_n={tactic.block_n}"
    qkvg_blocks = qkvg_rows // tactic.block_n
    if fb_rows % qkvg_blocks:
        return f"F_B's {fb_rows} rows do not split over {qkvg_blocks} QKVG CTAs"
    if d > fab_rows or d % ELEMS_PER_COPY:
        return f"F_B's K={d} must be a multiple of {ELEMS_PER_COPY} within F_A/beta's {fab_rows} rows"
    return validate_wgmma_tactic(tactic, qkvg_rows, k, k) or validate_wgmma_tactic(tactic, fab_rows, k, k)


class WgmmaStage(WgmmaGemm):
    """The one-launch stage for one tactic and one geometry (QKVG, F_A/beta and F_B rows, hidden size ``k``, F_B's
    K ``d``); M is a runtime value."""

    def __init__(self, tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int) -> None:
        reason = validate_stage(tactic, qkvg_rows, fab_rows, fb_rows, k, d)
        if reason is not None:
            raise ValueError(reason)
        super().__init__(tactic, qkvg_rows, k, k, k)
        self.fab_rows, self.fb_rows, self.d = fab_rows, fb_rows, d
        self.qkvg_blocks, self.fab_blocks = qkvg_rows // tactic.block_n, fab_rows // tactic.block_n
        self.fb_share = fb_rows // self.qkvg_blocks  # F_B rows per QKVG CTA
        if self.staging_bytes() > tactic.stages * tactic.slot_bytes():
            raise ValueError(f"tactic {tactic.key()}: its ring cannot stage F_B ({self.staging_bytes()} bytes)")

    def staging_bytes(self) -> int:
        """Shared memory F_B stages in the drained ring: one pass of tokens' f_a rows and the CTA's W_fb rows."""
        return (self.pass_tokens() + self.mma_rows()) * (self.d + ROW_PAD) * 2

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
        """``qkvg = x @ w_qkvg.T``, ``fab = x @ w_fab.T``, ``g1 = fab[:, :d] @ w_fb.T``: ``m_x`` (M, K), the weights
        (rows, K) and outputs (M, rows) contiguous bf16, ``m_w_fb`` (fb_rows, d); ``m_chain`` int32
        ``[STAGE_COUNTERS]``, zero on entry and left zero on exit."""
        t = self.tactic
        tiled_mma, s_w_layout, s_x_layout, x_box, s_x_box_layout = self._operand_layouts(m_w_qkvg.element_type)
        tile = (t.block_n, t.block_k)
        q_tma, q_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_w_qkvg, s_w_layout, tile)
        f_tma, f_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_w_fab, s_w_layout, tile)
        x_tma, x_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_x, s_x_box_layout, x_box)
        m_qkvg_t = cute.make_tensor(m_qkvg.iterator, cute.select(m_qkvg.layout, mode=[1, 0]))
        m_fab_t = cute.make_tensor(m_fab.iterator, cute.select(m_fab.layout, mode=[1, 0]))
        grid = (self.fab_blocks + self.qkvg_blocks, cute.ceil_div(m_x.shape[0], t.block_t), 1)
        self.stage_kernel(
            q_tma, q_src, f_tma, f_src, x_tma, x_src, m_qkvg_t, m_fab_t, m_fab, m_w_fb, m_g1, m_chain, s_w_layout,
            s_x_layout, s_x_box_layout, tiled_mma,
        ).launch(grid=grid, block=[t.threads, 1, 1], smem=t.smem_bytes(), stream=stream, use_pdl=t.pdl)

    @cute.kernel
    def stage_kernel(
        self,
        q_tma: cute.CopyAtom,
        q_src: cute.Tensor,
        f_tma: cute.CopyAtom,
        f_src: cute.Tensor,
        x_tma: cute.CopyAtom,
        x_src: cute.Tensor,
        m_qkvg_t: cute.Tensor,
        m_fab_t: cute.Tensor,
        m_fab: cute.Tensor,
        m_w_fb: cute.Tensor,
        m_g1: cute.Tensor,
        m_chain: cute.Tensor,
        s_w_layout: cute.ComposedLayout,
        s_x_layout: cute.ComposedLayout,
        s_x_box_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        """Row blocks ``0 .. fab_blocks - 1`` are F_A/beta's, the rest QKVG's (see the module docstring)."""
        t = self.tactic
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, bidy, _ = cute.arch.block_idx()
        _, token_tiles, _ = cute.arch.grid_dim()
        mainloop, s_w, s_x, s_x_box, ring, _ = self._ring(m_qkvg_t.element_type, s_w_layout, s_x_layout,
                                                         s_x_box_layout)
        consumer = warp < t.consumer_threads // 32
        if bidx < self.fab_blocks:
            self._tile_per_cta(mainloop, f_tma, f_src, x_tma, x_src, s_w, s_x, s_x_box, ring, m_fab_t, None, None,
                               None, tiled_mma, warp, tidx, bidx, bidy, 0)
            if consumer:
                self._count_in(m_chain, tidx)
        else:
            block = bidx - self.fab_blocks
            self._tile_per_cta(mainloop, q_tma, q_src, x_tma, x_src, s_w, s_x, s_x_box, ring, m_qkvg_t, None, None,
                               None, tiled_mma, warp, tidx, block, bidy, 0)
            if consumer:
                if bidy == 0:
                    self._f_b(m_fab, m_w_fb, m_g1, m_chain, ring, block, self.fab_blocks * token_tiles, tidx)
                self._count_out(m_chain, self.qkvg_blocks * token_tiles, tidx)

    @cute.jit
    def _count_in(self, m_chain, tidx):
        """Count this F_A/beta tile in on ``chain[0]``; release: every consumer's stores are visible first."""
        cute.arch.fence_acq_rel_gpu()
        self._consumers_sync()
        if tidx == 0:
            cute.arch.atomic_add(m_chain.iterator, cutlass.Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _count_out(self, m_chain, ctas, tidx):
        """Count this QKVG CTA out on ``chain[1]``; the last of ``ctas`` resets both counters (stream order makes
        the reset visible to the stream's next launch)."""
        self._consumers_sync()
        if tidx == 0:
            done = cute.arch.atomic_add(m_chain.iterator + 1, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if done == ctas - 1:
                m_chain[0] = 0
                m_chain[1] = 0

    @cute.jit
    def _f_b(self, m_fab, m_w_fb, m_g1, m_chain, ring, share, expected, tidx):
        """Rows ``share * fb_share ..`` of ``g1`` for every token, once ``expected`` F_A/beta tiles are counted in:
        ``mma.sync`` with the rows on its M side (the share padded to 16 with the next rows, never stored) and 8
        tokens per consumer warp, f_a staged one pass of tokens at a time."""
        t = self.tactic
        dtype = m_g1.element_type
        m_tokens = m_fab.shape[0]
        self._consumers_sync()  # the output tile has left the ring
        # Relaxed polls, one fence after (as the trailing side chain's F_B waits for F_A/beta's tiles).
        if tidx == 0:
            arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            while arrived < expected:
                arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
        self._consumers_sync()
        warps = t.consumer_threads // 32
        lanes, rows = self.pass_tokens(), self.mma_rows()
        stride = self.d + ROW_PAD
        s_fa = cute.make_tensor(ring, cute.make_layout((lanes, self.d), stride=(stride, 1)))
        s_wb = cute.make_tensor(ring + lanes * stride, cute.make_layout((rows, self.d), stride=(stride, 1)))
        first_row = share * self.fb_share
        # The share's W_fb rows; the MMA's padding rows stay unloaded: they feed only outputs that are not stored.
        self._stage_rows(cute.local_tile(m_w_fb, (self.fb_share, self.d), (share, 0)), s_wb, self.fb_share,
                         self.fb_share, tidx)
        mma = cute.make_tiled_mma(cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, MMA_SHAPE),
                                  cute.make_layout((1, warps, 1)))
        thr_mma = mma.get_slice(tidx)
        t_ra = mma.make_fragment_A(thr_mma.partition_A(s_wb))
        t_rb = mma.make_fragment_B(thr_mma.partition_B(s_fa))
        c_g1 = cute.make_identity_tensor((rows, lanes))
        t_c = thr_mma.partition_C(c_g1)
        acc = cute.make_rmem_tensor(t_c.shape, cutlass.Float32)
        for p in cutlass.range(cute.ceil_div(m_tokens, lanes), unroll=1):
            first = p * lanes
            # f_a: F_A/beta's first d columns.
            self._stage_rows(cute.local_tile(m_fab, (lanes, self.d), (p, 0)), s_fa, lanes, m_tokens - first, tidx)
            self._consumers_sync()
            cute.autovec_copy(thr_mma.partition_A(s_wb), t_ra)
            cute.autovec_copy(thr_mma.partition_B(s_fa), t_rb)
            acc.fill(0.0)
            cute.gemm(mma, acc, t_ra, t_rb, acc)
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, token = t_c[i]
                if row < self.fb_share and first + token < m_tokens:
                    m_g1[first + token, first_row + row] = acc[i].to(dtype)
            self._consumers_sync()  # the pass's f_a is read before the next one overwrites it

    def pass_tokens(self) -> int:
        """Tokens of one F_B pass: 8 per consumer warp (``mma.sync``'s N)."""
        return self.tactic.consumer_threads // 32 * MMA_SHAPE[1]

    def mma_rows(self) -> int:
        """F_B rows one CTA's MMAs cover: its share, padded to ``mma.sync``'s M."""
        return -(-self.fb_share // MMA_SHAPE[0]) * MMA_SHAPE[0]

    @cute.jit
    def _stage_rows(self, g_rows, s_rows, rows: cutlass.Constexpr[int], count, tidx):
        """Copy the first ``count`` of ``rows`` rows of ``g_rows`` (rows, d) into ``s_rows`` in 16-byte vectors."""
        t = self.tactic
        per_row = self.d // ELEMS_PER_COPY
        vec = (1, ELEMS_PER_COPY)
        v_g, v_s = cute.zipped_divide(g_rows, vec), cute.zipped_divide(s_rows, vec)
        copy = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), g_rows.element_type, num_bits_per_copy=COPY_BITS)
        vectors = rows * per_row
        for j in cutlass.range_constexpr(-(-vectors // t.consumer_threads)):
            i = j * t.consumer_threads + tidx
            r, c = i // per_row, i % per_row
            if i < vectors and r < count:
                cute.copy(copy, v_g[(None, (r, c))], v_s[(None, (r, c))])


def compile_stage(stage: WgmmaStage, arch: str):
    """``stage`` compiled for ``arch``: the TVM-FFI callable ``f(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, chain)`` over
    torch tensors on torch's current stream (see :meth:`WgmmaStage.__call__`)."""
    from cutlass.cute.runtime import make_fake_tensor

    from kda_backend.kernels.compile_cache import _compile_tagged

    m = cute.sym_int32(symbol="M")

    def bf16(shape):
        return make_fake_tensor(cutlass.BFloat16, shape, (shape[1], 1), assumed_align=16)

    k = stage.k
    operands = (
        bf16((m, k)), bf16((stage.n, k)), bf16((m, stage.n)), bf16((stage.fab_rows, k)), bf16((m, stage.fab_rows)),
        bf16((stage.fb_rows, stage.d)), bf16((m, stage.fb_rows)),
        make_fake_tensor(cutlass.Int32, (STAGE_COUNTERS,), (1,), assumed_align=4),
    )
    return _compile_tagged(stage, operands, arch)
