"""The side chain ``fab = x @ W_fab^T``, then ``g1 = fab[:, :D] @ W_fb^T``, as one launch trailing QKVG's.

On one stream (where the host allows no fork: eager calls, piecewise graphs) the side chain trails QKVG's launch
(:class:`~kda_backend.kernels.skinny_gemm.Link`). As two launches, F_A/beta then F_B, each costs the host a launch
(about 6 us on an H200's host through TVM-FFI); here both are programs of one launch, so an eager projection call is
two launches, QKVG and this.

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
(:func:`~kda_backend.providers.cute_provider.one_launch_error`); one that fails runs as two launches.
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
        fab, fb = self.fab.tactic, self.fb.tactic
        # F_B reads F_A's columns of F_A/beta's output in place: (M, D) with F_A/beta's row stride.
        m_fa = cute.make_tensor(m_fab.iterator, cute.make_layout((m_fab.shape[0], self.d), stride=(self.fab.n, 1)))
        fab_ops = self.fab.launch_operands(m_x, m_w_fab, m_fab, m_work)
        fb_ops = self.fb.launch_operands(m_fa, m_w_fb, m_g1, None)
        m_tokens = m_x.shape[0]
        ctas = (row_blocks(self.fab.n, fab.block_n) * cute.ceil_div(m_tokens, fab.block_t) * fab.split_k
                + row_blocks(self.fb.n, fb.block_n) * cute.ceil_div(m_tokens, fb.block_t))
        self.kernel(m_x, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops).launch(
            grid=(ctas, 1, 1), block=[fab.threads, 1, 1], smem=self.area + TICKET_BYTES, stream=stream, use_pdl=True
        )

    @cute.kernel
    def kernel(self, m_x, m_w_fab, m_arrivals, m_chain, fab_ops, m_fa, m_w_fb, fb_ops):
        """``fab_ops`` / ``fb_ops``: each program's :meth:`SkinnyGemm.launch_operands`."""
        fab, fb = self.fab.tactic, self.fb.tactic
        tidx, _, _ = cute.arch.thread_idx()
        smem = cutlass.memory.SmemAllocator()
        base = smem.allocate(self.area, 128)
        s_ticket = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), TICKET_BYTES)
        if tidx == 0:
            s_ticket[0] = cute.arch.atomic_add(m_chain.iterator + 2, cutlass.Int32(1), sem="relaxed", scope="gpu")
        cute.arch.sync_threads()
        ticket = s_ticket[0]
        m_tokens = m_x.shape[0]
        fab_rows = row_blocks(self.fab.n, fab.block_n)
        fab_tiles = fab_rows * cute.ceil_div(m_tokens, fab.block_t)
        if ticket < fab_tiles * fab.split_k:
            m_fab_t, m_work = fab_ops[0], fab_ops[1]
            self.fab.tile(SharedCarve(base, self.area), tidx, ticket % fab_rows, ticket % fab_tiles // fab_rows,
                          ticket // fab_tiles, m_x, m_w_fab, m_fab_t, m_work, m_arrivals, m_chain, None,
                          *fab_ops[2:], own_exit=False)
        else:
            f = ticket - fab_tiles * fab.split_k
            fb_rows = row_blocks(self.fb.n, fb.block_n)
            self.fb.tile(SharedCarve(base, self.area), tidx, f % fb_rows, f // fb_rows, 0, m_fa, m_w_fb, fb_ops[0],
                         None, None, m_chain, fab_tiles, *fb_ops[2:], own_exit=False)
        self._count_out(m_chain, tidx)

    @cute.jit
    def _count_out(self, m_chain, tidx):
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
