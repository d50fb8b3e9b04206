"""The side chain ``fab = x @ W_fab^T``, then ``g1 = fab[:, :D] @ W_fb^T``, as one launch trailing QKVG's
(:class:`SideChainGemm`), and the whole stage, QKVG's tiles beside it, as one launch (:class:`StageGemm`).

On one stream (where the host allows no fork: eager calls, piecewise graphs) the side chain trails QKVG's launch
(:class:`~kda_backend.kernels.skinny_gemm.Link`). As two launches, F_A/beta then F_B, each costs the host a launch
(about 6 us on an H200's host through TVM-FFI); here both are programs of one launch. An eager call at M <= 16
launches the whole stage at once: its host time exceeds the stage's GPU time there.

- Each CTA draws a ticket from a counter as it starts: the first ``fab_ctas`` tickets run F_A/beta tiles (the
  :class:`~kda_backend.kernels.skinny_gemm.SkinnyGemm` tile of its tactic, ``x_ready``: launched right behind
  QKVG's wait for x, so it loads x at once), the others F_B tiles, which wait until every F_A/beta tile is stored.
  A CTA holding an F_B ticket started after every F_A/beta ticket was drawn, by CTAs already running, which wait
  for nothing: the wait always ends, however the hardware orders the CTAs.
- The tiles are the two-launch chain's tiles of the same tactics, so the results are the same bits as the two
  launches' and the forked side chain's.
- Both tactics run with one thread count and ``cp.async`` activations; the launch's shared memory is the larger
  program's, carved from one allocation (:class:`SharedCarve`).
- Three int32 chain counters, zero before and after: ``[0]`` F_A/beta tiles stored, ``[1]`` CTAs done (the last
  resets all three), ``[2]`` tickets drawn.

The provider checks each launch form on its first use on a device before it serves
(:func:`~kda_backend.providers.cute_provider.one_launch_error`, :func:`~kda_backend.providers.cute_provider.
stage_error`); a side chain that fails runs as two launches, a stage that fails as QKVG and its side chain.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from kda_backend.kernels.skinny_gemm import MAX_SMEM_BYTES, Link, SkinnyGemm, Tactic, row_blocks, validate_link

FAB = Link(signals=True, x_ready=True)  # F_A/beta's tiles: load x at once, count each stored tile in
FB = Link(waits=True)  # F_B's tiles: load f_a once every F_A/beta tile is stored
TICKET_BYTES = 128  # the shared word a CTA's ticket is broadcast in, after the programs' area


def why_not_one_launch(fab: Tactic, fb: Tactic) -> str | None:
    """``None`` if F_A/beta's and F_B's tactics (as they trail QKVG) run as one launch, else why not."""
    reason = validate_link(FAB, fab) or validate_link(FB, fb)
    if reason is not None:
        return reason
    if fab.threads != fb.threads:
        return f"F_A/beta's tactic {fab.key()} runs {fab.threads} threads, F_B's {fb.key()} {fb.threads}"
    if not (fab.pdl and fb.pdl):
        return "one launch trailing QKVG needs programmatic launch in both tactics"
    if fab.x_tma or fab.x_bulk or fb.x_tma or fb.x_bulk:
        return "one launch takes activations by cp.async only (no x_tma or x_bulk)"
    smem = max(fab.smem_bytes(), fb.smem_bytes()) + TICKET_BYTES
    if smem > MAX_SMEM_BYTES:
        return f"one launch needs {smem} B of shared memory > {MAX_SMEM_BYTES}"
    return None


def why_not_one_launch_stage(qkvg: Tactic, fab: Tactic, fb: Tactic) -> str | None:
    """``None`` if QKVG's tactic runs in one launch with the side chain's (:class:`StageGemm`), else why not."""
    reason = why_not_one_launch(fab, fb)
    if reason is not None:
        return reason
    if qkvg.threads != fab.threads:
        return f"QKVG's tactic {qkvg.key()} runs {qkvg.threads} threads, the side chain's {fab.threads}"
    if not qkvg.pdl or qkvg.split_k > 1 or qkvg.x_tma or qkvg.x_bulk:
        return f"QKVG's tactic {qkvg.key()} must be programmatic, unsplit, with activations by cp.async"
    smem = max(qkvg.smem_bytes(), fab.smem_bytes(), fb.smem_bytes()) + TICKET_BYTES
    if smem > MAX_SMEM_BYTES:
        return f"one launch of the stage needs {smem} B of shared memory > {MAX_SMEM_BYTES}"
    return None


def tiles(gemm: SkinnyGemm, m_tokens) -> int:
    """``gemm``'s output tiles over ``m_tokens`` tokens (a runtime value in a kernel): row blocks times token tiles,
    as :func:`~kda_backend.kernels.skinny_gemm.output_tiles` counts them on the host."""
    return row_blocks(gemm.n, gemm.tactic.block_n) * cute.ceil_div(m_tokens, gemm.tactic.block_t)


class SharedCarve:
    """Shared-memory tensors carved in order from one allocation of ``size`` bytes at ``base``, with the
    ``allocate_tensor`` of ``cutlass.memory.SmemAllocator``: the programs of one launch each carve their own from the
    same bytes, so the launch needs the larger program's shared memory, not the sum."""

    def __init__(self, base: cute.Pointer, size: int) -> None:
        self._base, self._size, self._offset = base, size, 0

    def allocate_tensor(self, dtype, layout, byte_alignment: int = 1) -> cute.Tensor:
        byte_alignment = max(byte_alignment, dtype.width // 8)  # at least the element's, as SmemAllocator aligns
        start = -(-self._offset // byte_alignment) * byte_alignment
        self._offset = start + cute.cosize(layout) * dtype.width // 8
        if self._offset > self._size:
            raise ValueError(f"a program needs more than the {self._size} bytes of shared memory carved for it")
        return cute.make_tensor(cute.recast_ptr(self._base + start, dtype=dtype), layout)

    def allocate_array(self, *args, **kwargs):
        raise NotImplementedError("mbarrier arrays (x_tma, x_bulk) are not carved: see why_not_one_launch")


class SideChainGemm:
    """The kernel for one pair of tactics and static problem: F_A/beta ``[fab_n, K]`` over x, F_B ``[fb_n, D]``
    over the first ``D`` columns of F_A/beta's output."""

    def __init__(
        self, fab: Tactic, fb: Tactic, fab_n: int, k: int, x_row_stride: int, w_fab_row_stride: int, fb_n: int,
        d: int, w_fb_row_stride: int,
    ) -> None:
        reason = why_not_one_launch(fab, fb)
        if reason is not None:
            raise ValueError(reason)
        self.fab = SkinnyGemm(fab, fab_n, k, x_row_stride, w_fab_row_stride, FAB)
        self.fb = SkinnyGemm(fb, fb_n, d, fab_n, w_fb_row_stride, FB)
        self.d = d
        self.area = max(fab.smem_bytes(), fb.smem_bytes())

    def fa_view(self, m_fab: cute.Tensor) -> cute.Tensor:
        """F_B's activations: F_A's columns of F_A/beta's output in place, (M, D) with F_A/beta's row stride."""
        return cute.make_tensor(m_fab.iterator, cute.make_layout((m_fab.shape[0], self.d), stride=(self.fab.n, 1)))

    def ctas(self, m_tokens) -> int:
        """CTAs of both programs over ``m_tokens`` tokens: one per F_A/beta tile and K part, one per F_B tile."""
        return self.fab_ctas(m_tokens) + tiles(self.fb, m_tokens)

    def fab_ctas(self, m_tokens) -> int:
        return tiles(self.fab, m_tokens) * self.fab.tactic.split_k

    @cute.jit
    def __call__(
        self,
        m_x: cute.Tensor,
        m_w_fab: cute.Tensor,
        m_fab: cute.Tensor,
        m_w_fb: cute.Tensor,
        m_g1: cute.Tensor,
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        m_chain: cute.Tensor,
        stream,
    ):
        """``fab = x @ w_fab.T``, ``g1 = fab[:, :D] @ w_fb.T``: ``m_x`` (M, K), ``m_w_fab`` (fab_n, K), ``m_fab``
        (M, fab_n) contiguous, ``m_w_fb`` (fb_n, D), ``m_g1`` (M, fb_n) contiguous, all bf16; with F_A/beta split
        along K its workspace (split_k, M, fab_n) and arrival counters (as :meth:`SkinnyGemm.__call__`), else
        ``None``; ``m_chain`` the three int32 chain counters (see the module docstring)."""
        m_fa = self.fa_view(m_fab)
        fab_ops = self.fab.launch_operands(m_x, m_w_fab, m_fab, m_work)
        fb_ops = self.fb.launch_operands(m_fa, m_w_fb, m_g1, None)
        self.kernel(m_x, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops).launch(
            grid=(self.ctas(m_x.shape[0]), 1, 1), block=[self.fab.tactic.threads, 1, 1],
            smem=self.area + TICKET_BYTES, stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, m_x, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops):
        """``fab_ops`` / ``fb_ops``: each program's :meth:`SkinnyGemm.launch_operands`."""
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.area, 128)
        ticket = self.draw_ticket(smem, m_chain, tidx)
        fab_ctas = self.fab_ctas(m_x.shape[0])
        if ticket < fab_ctas:
            self.fab_program(base, tidx, ticket, m_x, m_w_fab, m_arrivals, m_chain, fab_ops)
        else:
            self.fb_program(base, tidx, ticket - fab_ctas, m_x.shape[0], m_chain, m_fa, m_w_fb, fb_ops)
        self.count_out(m_chain, tidx)

    @cute.jit
    def draw_ticket(self, smem, m_chain, tidx) -> cutlass.Int32:
        """This CTA's ticket from ``chain[2]``, broadcast through a shared word carved after the programs' area."""
        s_ticket = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), TICKET_BYTES)
        if tidx == 0:
            s_ticket[0] = cute.arch.atomic_add(m_chain.iterator + 2, cutlass.Int32(1), sem="relaxed", scope="gpu")
        cute.arch.sync_threads()
        return s_ticket[0]

    @cute.jit
    def fab_program(self, base, tidx, ticket, m_x, m_w_fab, m_arrivals, m_chain, fab_ops):
        """F_A/beta's tile (and K part) of ticket ``ticket`` (below :meth:`fab_ctas`), its shared memory carved
        from ``base``."""
        fab_rows, fab_tiles = row_blocks(self.fab.n, self.fab.tactic.block_n), tiles(self.fab, m_x.shape[0])
        self.fab.tile(SharedCarve(base, self.area), tidx, ticket % fab_rows, ticket % fab_tiles // fab_rows,
                      ticket // fab_tiles, m_x, m_w_fab, fab_ops[0], fab_ops[1], m_arrivals, m_chain, None,
                      *fab_ops[2:], own_exit=False)

    @cute.jit
    def fb_program(self, base, tidx, f, m_tokens, m_chain, m_fa, m_w_fb, fb_ops):
        """F_B's tile ``f``, loading f_a once every F_A/beta tile is stored, its shared memory carved from
        ``base``."""
        fb_rows = row_blocks(self.fb.n, self.fb.tactic.block_n)
        self.fb.tile(SharedCarve(base, self.area), tidx, f % fb_rows, f // fb_rows, 0, m_fa, m_w_fb, fb_ops[0],
                     None, None, m_chain, tiles(self.fab, m_tokens), *fb_ops[2:], own_exit=False)

    @cute.jit
    def count_out(self, m_chain, tidx):
        """The CTA is done: count it in on ``chain[1]``; the last resets the three counters for the next side chain
        on the stream (acquire-release: the last sees every other CTA's ticket and tile counted before it resets).
        Then wait for QKVG's launch to complete, so that kernels after this one see a completed stage."""
        if tidx == 0:
            ctas = cute.arch.grid_dim()
            done = cute.arch.atomic_add(m_chain.iterator + 1, cutlass.Int32(1), sem="acq_rel", scope="gpu")
            if done == ctas[0] - 1:
                m_chain[0] = 0
                m_chain[1] = 0
                m_chain[2] = 0
        cute.arch.griddepcontrol_wait()


class StageGemm(SideChainGemm):
    """The whole stage as one launch (eager calls): QKVG's tiles are a third program beside the side chain's.

    Every CTA first waits for the launch before it (``griddepcontrol.wait``: x is complete, and a stage launched
    before on the stream has reset its counters), then draws its ticket: F_A/beta's tiles first (they never wait,
    and they gate F_B), then QKVG's, then F_B's. The tiles are the separate launches' tiles of the same tactics, so
    the bits are theirs. All three tactics run one thread count (QKVG in 16-row CTAs for Kimi-K3), the launch's
    shared memory is the largest program's."""

    def __init__(
        self, qkvg: Tactic, qkvg_n: int, w_qkvg_row_stride: int, fab: Tactic, fb: Tactic, fab_n: int, k: int,
        x_row_stride: int, w_fab_row_stride: int, fb_n: int, d: int, w_fb_row_stride: int,
    ) -> None:
        reason = why_not_one_launch_stage(qkvg, fab, fb)
        if reason is not None:
            raise ValueError(reason)
        super().__init__(fab, fb, fab_n, k, x_row_stride, w_fab_row_stride, fb_n, d, w_fb_row_stride)
        self.qkvg = SkinnyGemm(qkvg, qkvg_n, k, x_row_stride, w_qkvg_row_stride)
        self.area = max(self.area, qkvg.smem_bytes())

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
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        m_chain: cute.Tensor,
        stream,
    ):
        """``qkvg = x @ w_qkvg.T`` (``m_w_qkvg`` (qkvg_n, K), ``m_qkvg`` (M, qkvg_n) contiguous, bf16) beside the
        side chain; the other operands as :meth:`SideChainGemm.__call__`'s."""
        m_fa = self.fa_view(m_fab)
        qkvg_ops = self.qkvg.launch_operands(m_x, m_w_qkvg, m_qkvg, None)
        fab_ops = self.fab.launch_operands(m_x, m_w_fab, m_fab, m_work)
        fb_ops = self.fb.launch_operands(m_fa, m_w_fb, m_g1, None)
        m_tokens = m_x.shape[0]
        self.kernel(m_x, m_w_qkvg, qkvg_ops, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops).launch(
            grid=(self.ctas(m_tokens) + tiles(self.qkvg, m_tokens), 1, 1), block=[self.fab.tactic.threads, 1, 1],
            smem=self.area + TICKET_BYTES, stream=stream, use_pdl=True,
        )

    @cute.kernel
    def kernel(self, m_x, m_w_qkvg, qkvg_ops, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops):
        """``qkvg_ops`` / ``fab_ops`` / ``fb_ops``: each program's :meth:`SkinnyGemm.launch_operands`."""
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.area, 128)
        cute.arch.griddepcontrol_wait()
        ticket = self.draw_ticket(smem, m_chain, tidx)
        m_tokens = m_x.shape[0]
        fab_ctas, qkvg_tiles = self.fab_ctas(m_tokens), tiles(self.qkvg, m_tokens)
        if ticket < fab_ctas:
            self.fab_program(base, tidx, ticket, m_x, m_w_fab, m_arrivals, m_chain, fab_ops)
        elif ticket < fab_ctas + qkvg_tiles:
            q = ticket - fab_ctas
            rows = row_blocks(self.qkvg.n, self.qkvg.tactic.block_n)
            self.qkvg.tile(SharedCarve(base, self.area), tidx, q % rows, q // rows, 0, m_x, m_w_qkvg, qkvg_ops[0],
                           None, None, None, None, *qkvg_ops[2:], own_exit=False)
        else:
            self.fb_program(base, tidx, ticket - fab_ctas - qkvg_tiles, m_tokens, m_chain, m_fa, m_w_fb, fb_ops)
        self.count_out(m_chain, tidx)
