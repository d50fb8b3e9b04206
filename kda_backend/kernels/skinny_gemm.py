"""Skinny low-M GEMM ``out[M, N] = x[M, K] @ w[N, K]^T`` in the CuTe DSL, for the KDA projection stage.

Algorithm (swap-AB). At decode M is 1..16 while N and K are thousands, so the MMA's M mode is given to the weight
rows and its N mode to the tokens: each CTA owns ``block_n`` weight rows and ``block_t`` tokens (padded: rows of x
at or past M are never loaded and read as zeros) and walks the whole K extent. The kernel is memory-bound on the
weights, so everything serves keeping weight bytes in flight:

- ``stages`` K-tiles of ``[block_n, block_k]`` weights and ``[block_t, block_k]`` activations are in flight through
  ``cp.async`` (16-byte, L2-only) into a swizzled shared-memory ring; one barrier per K-tile. L2 evicts weight
  lines first (each is read once per layer) and activation lines last (every CTA reads them), see
  :mod:`kda_backend.kernels.l2_cache_policy`. Activations may instead come by TMA or bulk copies
  (:attr:`Tactic.x_tma`, :attr:`Tactic.x_bulk`).
- Tensor cores (``mma.sync`` m16n8k16, bf16 in, fp32 accumulate) via ``ldmatrix``; warps split the weight rows (and
  the tokens, for an odd number of 16-row tiles), so there is no cross-warp reduction and no floating-point
  atomics: results are bitwise deterministic (split-K sums its partials in split order inside the kernel, see
  :class:`Tactic`).
- The output tile leaves through shared memory as 16-byte runs of one token's rows.
- Programmatic dependent launch: weight tiles of the prologue are issued before ``griddepcontrol.wait``, so they
  stream while the previous kernel (which produced x) drains; only activation loads wait for it.
- Activations are loaded once per CTA per K-tile (each x element read ``N / block_n`` times in total, from L2).

The same kernel serves the three roles: QKVG (N = 4*hD, K = hidden), F_A/beta (N = fab_rows, K = hidden, few
CTAs so it can run beside QKVG) and F_B (N = hD, K = D, x a strided view of F_A/beta's output).
Shapes N, K and the row strides are compile-time constants; M is a runtime value up to ``block_t * grid_y``.

One entry point, :meth:`SkinnyGemm.__call__`, serves every launch: x, w and out as torch holds them, then the
operands of optional roles (split-K's workspace and arrival counters, the chain counters of the side chain trailing
QKVG on one stream, see :class:`Link`), each ``None`` where the tactic and link give the kernel no such role. The
DSL compiles a ``None`` argument as a constant (TVM-FFI then checks only that the call passes ``None`` there), so
the key specialises the kernel and an unused role costs it nothing.

N need only be a multiple of 8 (one 16-byte vector of output rows): SGLang pads F_A/beta to 8 rows, 136 at TP16.
Where ``block_n`` does not divide N, the last row block is partial: its weight rows past N are never loaded (their
shared-memory rows are zero-filled once) and its accumulator rows past N are never stored or published to the
split-K workspace. N is static, so this is a compile-time specialization: where ``block_n`` divides N the kernel
compiles exactly as without it.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.memory

from kda_backend.kernels.l2_cache_policy import (
    EVICT_FIRST,
    EVICT_LAST,
    bulk_copy_with_policy,
    copy_with_policy,
    copy_with_policy_where,
    l2_policy,
)

MMA_SHAPE = (16, 8, 16)  # mma.sync m16n8k16 for bf16
COPY_BITS = 128  # cp.async 16-byte vectors
ELEMS_PER_COPY = COPY_BITS // 16  # bf16 elements per 16-byte vector
MAX_SMEM_BYTES = 227 * 1024  # per-CTA opt-in limit on SM 9.0 and 10.x
SPLIT_K_FLAG_BYTES = 128  # shared word telling a split-K CTA's threads that it arrived last (one aligned slot)
# bf16 elements after each activation row of an x_bulk ring: 16 bytes, so ldmatrix's 8 rows hit 8 bank groups.
X_BULK_ROW_PAD = 8


class SplitKSchedule:
    """What a launch of either kernel family's tactic needs on the host: output tiles of ``block_n`` rows by
    ``block_t`` tokens, ``split_k`` CTAs each (a mixin of :class:`Tactic` and
    :class:`~kda_backend.kernels.wgmma_gemm.WgmmaTactic`, whose dataclass fields these are)."""

    @property
    def uses_workspace(self) -> bool:
        """Whether a launch takes an fp32 workspace and arrival counters (split-K)."""
        return self.split_k > 1

    def workspace_shape(self, m: int, n: int) -> tuple[int, int, int]:
        """The fp32 workspace ``[split_k, M, N]`` of a split-K launch over ``m`` tokens and ``n`` rows."""
        return self.split_k, m, n

    def ctas(self, n: int, m: int) -> int:
        """CTAs of one launch over ``n`` rows and ``m`` tokens."""
        return output_tiles(self, n, m) * self.split_k

    def counters(self, n: int, m: int) -> int:
        """Arrival counters of one split-K launch over ``n`` rows and ``m`` tokens: one per output tile."""
        return output_tiles(self, n, m)


@dataclasses.dataclass(frozen=True)
class Tactic(SplitKSchedule):
    """One specialization of the kernel.

    :param block_n: weight rows per CTA (multiple of 16, dividing N rounded up to 16 rows; the last CTA along N
        holds fewer rows where it does not divide N).
    :param block_k: K elements per pipeline stage (multiple of 64, divides K).
    :param block_t: tokens per CTA (16, 32 or 64); M above it uses more CTAs along grid y.
    :param stages: K-tiles in flight.
    :param pdl: launch with programmatic dependent launch; the next kernel may launch as soon as this one has
        issued its prologue (measured on H200: 2-8% faster than releasing it after the main loop).
    :param x_via_l1: load activations through L1 (``cp.async.ca``) so CTAs sharing an SM can share them.
    :param split_k: CTAs sharing one output tile along K (grid z). Gives a skinny-N GEMM (F_A/beta) many small
        CTAs, which fit beside the QKVG kernel's CTAs when both run concurrently. Each CTA writes an fp32 partial
        to a workspace ``[split_k, M, N]`` and counts itself in on the tile's arrival counter; the last to arrive
        sums the partials in split order (deterministic whichever CTA is last), writes the output and resets the
        counter. The reduction stays inside the kernel so the side chain is F_A/beta -> F_B, two kernels, and F_B
        launches programmatically behind it (a separate reduction kernel made the chain end after QKVG's).
    :param x_tma: load activations with the TMA unit: bulk tensor copies issued by one elected lane of warp 0 and
        completed on a per-slot mbarrier (rows past M arrive zero-filled), instead of 16-byte ``cp.async`` by every
        thread. Measured on H200 for Kimi-K3 QKVG: 0.5 us faster alone at M = 16, far slower when most of the
        token tile is zero-filled and beside the side chain, so it is an autotuner candidate, not a default.
    :param x_bulk: load activations with bulk copies (``cp.async.bulk``, no tensor map): one per real token row
        and K-tile, issued by the lanes of warp 0 and completed on a per-slot mbarrier, into an unswizzled ring
        with padded rows. Rows past M are never loaded (zero-filled once), unlike ``x_tma``'s zero-filled box.
        Measured on H200 for Kimi-K3 TP8 QKVG: 0.5 us faster alone than any other path at M = 1, but each further
        row costs about 0.9 us (one bulk copy per row and K-tile), so it is a candidate for a single token only
        (:func:`~kda_backend.kernels.tactics.tactic_bucket`).
    """

    block_n: int = 64
    block_k: int = 128
    block_t: int = 16
    stages: int = 6
    pdl: bool = True
    x_via_l1: bool = True
    split_k: int = 1
    x_tma: bool = False
    x_bulk: bool = False

    @property
    def warp_grid(self) -> tuple[int, int]:
        """(warps along weight rows, warps along tokens). Warps split the 16-row MMA tiles, at most 4 of them; an
        odd number of tiles (48 rows: one CTA per SM for Kimi-K3 QKVG) leaves one warp on the rows, so a second
        takes half of each 16-token tile, which keeps the copy passes at a power-of-two row count."""
        rows = self.block_n // MMA_SHAPE[0]
        along_rows = max(w for w in (4, 2, 1) if rows % w == 0)
        return along_rows, 2 if along_rows == 1 and rows > 1 else 1

    @property
    def warps(self) -> int:
        along_rows, along_tokens = self.warp_grid
        return along_rows * along_tokens

    @property
    def threads(self) -> int:
        return 32 * self.warps

    def smem_bytes(self) -> int:
        x_row = self.block_k + (X_BULK_ROW_PAD if self.x_bulk else 0)
        ring = self.stages * (self.block_n * self.block_k + self.block_t * x_row) * 2
        barriers = -(-self.stages * 8 // 128) * 128 if self.x_tma or self.x_bulk else 0  # one 8-byte mbarrier per slot
        return ring + self.epilogue_bytes() + barriers + (SPLIT_K_FLAG_BYTES if self.split_k > 1 else 0)

    def epilogue_bytes(self) -> int:
        """The bf16 output tile, staged in shared memory so it leaves in 16-byte stores."""
        return self.block_n * self.block_t * 2

    def with_activations_from_l2(self) -> Tactic:
        """This tactic loading activations by ``cp.async`` from L2 (what a launch that cannot trust L1 or the async
        proxy needs, see :func:`validate_link`)."""
        return dataclasses.replace(self, x_via_l1=False, x_tma=False, x_bulk=False)

    def key(self) -> str:
        split = f"x{self.split_k}" if self.split_k > 1 else ""
        return (
            f"n{self.block_n}k{self.block_k}t{self.block_t}s{self.stages}{split}"
            f"{'p' if self.pdl else ''}{'L' if self.x_via_l1 else ''}{'T' if self.x_tma else ''}"
            f"{'B' if self.x_bulk else ''}"
        )


def row_blocks(rows: int, block_n: int) -> int:
    """CTAs along ``rows`` weight rows (the last one partial where ``block_n`` does not divide ``rows``)."""
    return -(-rows // block_n)


def padded_rows(rows: int) -> int:
    """``rows`` in whole 16-row MMA tiles: what ``block_n`` must divide."""
    return row_blocks(rows, MMA_SHAPE[0]) * MMA_SHAPE[0]


def _rows_reason(what: str, rows: int, block_n: int) -> str | None:
    """Why ``block_n``-row CTAs cannot cover ``rows`` weight rows, or ``None``: the rows come in whole output
    vectors, and only the last row block may be partial, by less than one 16-row MMA tile."""
    if rows % ELEMS_PER_COPY:
        return f"{what}={rows} must be a multiple of {ELEMS_PER_COPY} (16-byte output vectors)"
    if block_n % MMA_SHAPE[0] or padded_rows(rows) % block_n:
        return f"block_n={block_n} must be a multiple of 16 dividing {what}={rows} rounded up to 16 rows"
    return None


def validate_tactic(tactic: Tactic, n: int, k: int, x_row_stride: int) -> str | None:
    """``None`` if ``tactic`` can run a GEMM with these static sizes, else why not."""
    reason = _rows_reason("N", n, tactic.block_n)
    if reason is not None:
        return reason
    if tactic.block_k % 64 or k % tactic.block_k:
        return f"block_k={tactic.block_k} must be a multiple of 64 dividing K={k}"
    if tactic.block_t not in (16, 32, 64):
        return f"block_t={tactic.block_t} must be 16, 32 or 64"
    if tactic.stages < 2:
        return f"stages={tactic.stages} must be >= 2"
    if sum((tactic.x_tma, tactic.x_via_l1, tactic.x_bulk)) > 1:
        return "x_tma, x_via_l1 and x_bulk exclude each other (one activation path)"
    if tactic.split_k < 1 or (k // tactic.block_k) % tactic.split_k:
        return f"split_k={tactic.split_k} must divide the {k // tactic.block_k} K-tiles"
    lanes_per_row = tactic.block_k // ELEMS_PER_COPY
    if tactic.threads < lanes_per_row:
        return f"{tactic.threads} threads cannot cover a row of {lanes_per_row} 16-byte vectors"
    if tactic.smem_bytes() > MAX_SMEM_BYTES:
        return f"needs {tactic.smem_bytes()} B of shared memory > {MAX_SMEM_BYTES}"
    if x_row_stride % ELEMS_PER_COPY:
        return f"x row stride {x_row_stride} must be a multiple of {ELEMS_PER_COPY} elements (16 bytes)"
    return None


@dataclasses.dataclass(frozen=True)
class Link:
    """How one launch takes part in the overlap on one stream (where the host allows no fork): QKVG, then F_A/beta
    (``x_ready``, ``signals``), then F_B (``waits``), each launched programmatically behind the one before; the same
    kernels as the forked overlap, so the same bits. The signaling and the waiting launch share ``chain``, the
    stream's int32 chain counters (the first two serve them), which are zero before and after them. Where their
    tactics allow, the two are one launch (:mod:`~kda_backend.kernels.side_chain_gemm`).

    :param waits: load x only after ``chain[0]`` reached the launch's ``expected`` count (every tile of the
        signaling launch before it). Each CTA then counts itself in on ``chain[1]``; the last resets both counters.
        The kernel ends with ``griddepcontrol.wait``, so it never completes before the launch it waits for.
    :param signals: each output tile, once stored (a split-K tile once reduced), counts itself in on ``chain[0]``.
    :param x_ready: launched programmatically right behind the kernel that waited for x (QKVG), so x is complete
        when this launch starts: no ``griddepcontrol.wait`` before loading x; the next launch is released at once,
        and the kernel ends with ``griddepcontrol.wait``, so it never completes before the launch before it.
        It touches the chain and split-K counters before any wait of its own, so it relies on that QKVG releasing
        it only after its own wait, and on the previous side chain on the stream having completed by then (every
        kernel in between waits for its predecessor before it completes, or is launched without PDL).
    """

    waits: bool = False
    signals: bool = False
    x_ready: bool = False


NO_LINK = Link()  # a plain GEMM


def validate_link(link: Link, tactic: Tactic) -> str | None:
    """``None`` if ``tactic`` can take part in the overlap on one stream as ``link`` says, else why not."""
    if link.waits and link.signals:
        return "a launch either waits or signals, not both"
    if link.x_ready and link.waits:
        return "x_ready is for a launch behind QKVG's (signals), not a waiting one"
    if link.waits and tactic.split_k > 1:
        return "a waiting launch cannot split K"
    if link.waits and (tactic.x_via_l1 or tactic.x_tma or tactic.x_bulk):
        # x was written moments ago by other SMs: only L2 holds it coherently, and TMA and bulk copies read through
        # another proxy.
        return "a waiting launch loads x from L2 only (x_via_l1, x_tma and x_bulk are not allowed)"
    if link.x_ready and tactic.x_via_l1:
        # It never waited for the kernel that wrote x, so this SM's L1 may still hold an older copy.
        return "an x_ready launch loads x from L2 (x_via_l1 is not allowed)"
    return None


def check_optional_operands(what: str, used: dict[str, bool], operands: dict[str, object]) -> None:
    """At compile time: each optional operand of a kernel call is given where ``used`` says its role is."""
    missing = [name for name, value in operands.items() if used[name] and value is None]
    if missing:
        raise ValueError(f"{', '.join(missing)} required by {what}")


def output_tiles(tactic: SplitKSchedule, n: int, m: int) -> int:
    """Output tiles of one launch over ``n`` weight rows and ``m`` tokens (each split-K CTA works on one of them):
    what split-K counts per tile and what a waiting launch counts in."""
    return row_blocks(n, tactic.block_n) * -(-m // tactic.block_t)


def block_t_for(m: int) -> int:
    """Smallest token tile covering ``m`` (larger M spreads over grid y in tiles of 64)."""
    return next((t for t in (16, 32, 64) if m <= t), 64)


# A skinny-N GEMM with fewer row blocks than this is split along K (its CTAs then fit beside QKVG's).
SPLIT_BELOW_ROW_BLOCKS = 32
SPLIT_TARGET_CTAS = 128


def default_tactic(n: int, k: int, m: int) -> Tactic:
    """A sound tactic without tuning: 16-row CTAs, so even small N spreads over many SMs, with 4 stages of
    256-element K-tiles (64 KB of shared memory per CTA; 94-98 % of copy bandwidth for Kimi-K3 TP8 QKVG on H200).
    The side chain still fits beside these CTAs because every launch asks for the maximum shared-memory carveout
    (:data:`kda_backend.kernels.compile_cache.SMEM_CARVEOUT_PERCENT`). Skinny N (F_A/beta) is split along K into
    about ``SPLIT_TARGET_CTAS`` CTAs of three small stages each: at 16 tokens 26 KB with their reserve, which still
    fit in the 32 KB three QKVG CTAs leave, and beside QKVG they overlap 0.2-0.3 us better than two stages on H200."""
    if n % ELEMS_PER_COPY:
        raise ValueError(f"N={n} is not a multiple of {ELEMS_PER_COPY}")
    if k % 64:
        raise ValueError(f"K={k} is not a multiple of 64")
    block_t = block_t_for(m)
    blocks = row_blocks(n, 16)
    if blocks < SPLIT_BELOW_ROW_BLOCKS and k % 128 == 0 and k // 128 > 4:
        k_tiles = k // 128
        splits = [s for s in range(1, k_tiles + 1) if k_tiles % s == 0 and blocks * s <= SPLIT_TARGET_CTAS]
        return Tactic(block_n=16, block_k=128, block_t=block_t, stages=3, split_k=max(splits))
    block_k = next(b for b in (256, 128, 64) if k % b == 0)
    return Tactic(block_n=16, block_k=block_k, block_t=block_t, stages=max(2, min(4, k // block_k)))


def candidate_tactics(n: int, k: int, m: int, x_row_stride: int) -> list[Tactic]:
    """Tactics worth timing for one GEMM (the autotuner's search space), each filling its ring
    (:func:`fills_its_ring`). Measured on H200 for Kimi-K3 TP8 F_B (one K-tile) at M = 40 / 64: 4 slots against 2
    took the stage 31.1 / 33.7 us against 27.3 / 29.1 without a fork (side chain trailing QKVG), forked within
    0.2 us."""
    block_t = block_t_for(m)
    found = []
    k_tiles_128 = k // 128
    skinny = row_blocks(n, 16) < SPLIT_BELOW_ROW_BLOCKS
    splits = [1] + ([d for d in (2, 4, 7, 8, 14, 16) if k_tiles_128 % d == 0] if skinny else [])
    for split_k in splits:
        for stages in (2, 3):
            for via_l1 in (True, False):
                tactic = Tactic(16, 128, block_t, stages, x_via_l1=via_l1, split_k=split_k)
                if split_k > 1 and fills_its_ring(tactic, k) and validate_tactic(tactic, n, k, x_row_stride) is None:
                    found.append(tactic)
    x_paths = ({"x_via_l1": False}, {"x_via_l1": True}, {"x_via_l1": False, "x_tma": True})
    if m == 1:
        x_paths += ({"x_via_l1": False, "x_bulk": True},)
    for block_n in (16, 32, 48, 64):
        for block_k in (128, 256, 512):
            for stages in (2, 3, 4, 6):
                for x_path in x_paths:
                    tactic = Tactic(block_n, block_k, block_t, stages, **x_path)
                    if fills_its_ring(tactic, k) and validate_tactic(tactic, n, k, x_row_stride) is None:
                        found.append(tactic)
    return found


def fills_its_ring(tactic: Tactic, k: int) -> bool:
    """Whether a CTA of ``tactic`` over ``k`` has a K-tile for every slot of its ring (any 2-slot ring does): the
    kernel fills only as many slots as it has tiles, so a deeper ring computes the same bits in more shared memory,
    which costs the side chain trailing QKVG on one stream (see :func:`candidate_tactics`)."""
    return tactic.stages <= max(2, k // tactic.block_k // tactic.split_k)


class SkinnyGemm:
    """The kernel for one tactic and one static problem (N, K, row strides); M is a runtime value."""

    def __init__(
        self, tactic: Tactic, n: int, k: int, x_row_stride: int, w_row_stride: int, link: Link = NO_LINK
    ) -> None:
        reason = validate_tactic(tactic, n, k, x_row_stride) or validate_link(link, tactic)
        if reason is not None:
            raise ValueError(reason)
        self.tactic, self.link = tactic, link
        self.n, self.k = n, k
        # The last row block is partial (see the module docstring): rows are then checked on load and store.
        self.partial = bool(n % tactic.block_n)
        self.x_row_stride, self.w_row_stride = x_row_stride, w_row_stride

    def _smem_layout(self, rows: int, for_tma: bool = False) -> cute.ComposedLayout:
        """K-major ``[rows, block_k, stages]`` ring, swizzled so ldmatrix reads are bank-conflict free: 128-byte
        rows of 8-row atoms, 16-byte chunks XOR-ed by the row. The same swizzle two ways: on element offsets
        (cp.async rings), or with ``for_tma`` on byte addresses, the form the TMA unit's 128-byte swizzle mode is
        recognised in (the tensor then carries it on its pointer, see :meth:`kernel`)."""
        t = self.tactic
        atom_k = 128 * 8 // 16  # bf16 elements per 128-byte row
        swizzle = cute.make_swizzle(3, 4, 3) if for_tma else cute.make_swizzle(3, 3, 3)
        atom = cute.make_composed_layout(swizzle, 0, cute.make_layout((8, atom_k), stride=(atom_k, 1)))
        return cute.tile_to_shape(atom, (rows, t.block_k, t.stages), (0, 1, 2))

    def _g2s_copy(self, dtype) -> cute.TiledCopy:
        """The 16-byte cp.async tiled copy whose partitions the weight and activation loads walk. It only partitions:
        the copies are :mod:`kda_backend.kernels.l2_cache_policy`'s, which carry an L2 cache policy."""
        t = self.tactic
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.cpasync.LoadCacheMode.GLOBAL),
            dtype,
            num_bits_per_copy=COPY_BITS,
        )
        lanes = t.block_k // ELEMS_PER_COPY
        threads = cute.make_layout((t.threads // lanes, lanes), stride=(lanes, 1))
        return cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, ELEMS_PER_COPY)))

    def _check_roles(self, **operands) -> None:
        """At compile time: every optional operand this kernel's roles use is given (see :meth:`__call__`)."""
        t, link = self.tactic, self.link
        used = {"m_work": t.split_k > 1, "m_arrivals": t.split_k > 1, "m_chain": link.signals or link.waits,
                "expected": link.waits}
        check_optional_operands(f"tactic {t.key()} with {link}", used, operands)

    @cute.jit
    def __call__(
        self,
        m_x: cute.Tensor,
        m_w: cute.Tensor,
        m_out: cute.Tensor,
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        m_chain: cute.Tensor | None,
        expected: cutlass.Int32 | None,
        stream,
    ):
        """``out = x @ w.T``: ``m_x`` (M, K), ``m_w`` (N, K), ``m_out`` (M, N) contiguous, all bf16. The optional
        operands serve the roles the tactic and link give this kernel, and are ``None`` where it has no such role
        (compiled as constants: an unused slot costs nothing in the kernel and only a type check per call):

        - with ``split_k > 1``, ``m_work`` the fp32 workspace (split_k, M, N) contiguous, and ``m_arrivals`` int32
          arrival counters (one per output tile, ``output_tiles``), zero on entry and left zero on exit;
        - with ``link.signals`` or ``link.waits``, ``m_chain`` the stream's int32 chain counters (see :class:`Link`);
        - with ``link.waits``, ``expected`` the count ``chain[0]`` must reach before x is loaded.
        """
        self._check_roles(m_work=m_work, m_arrivals=m_arrivals, m_chain=m_chain, expected=expected)
        t = self.tactic
        operands = self.launch_operands(m_x, m_w, m_out, m_work)
        grid = (row_blocks(self.n, t.block_n), cute.ceil_div(m_x.shape[0], t.block_t), t.split_k)
        self.kernel(m_x, m_w, *operands[:2], m_arrivals, m_chain, expected, *operands[2:]).launch(
            grid=grid, block=[t.threads, 1, 1], smem=t.smem_bytes(), stream=stream, use_pdl=t.pdl
        )

    def launch_operands(self, m_x: cute.Tensor, m_w: cute.Tensor, m_out: cute.Tensor, m_work: cute.Tensor | None):
        """What :meth:`tile` takes besides the tensors as the caller holds them, built at trace time:
        ``(m_out_t, m_work, s_w_layout, s_x_layout, g2s_w, x_copy, x_src, mma)``, where the kernel works on the
        swap-AB views, out transposed (N, M) and the workspace as (N, M, split_k)."""
        t = self.tactic
        dtype = m_w.element_type
        along_rows, along_tokens = t.warp_grid
        mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaF16BF16Op(dtype, cutlass.Float32, MMA_SHAPE),
            cute.make_layout((along_rows, along_tokens, 1)),
            permutation_mnk=(along_rows * MMA_SHAPE[0], 2 * MMA_SHAPE[1], MMA_SHAPE[2]),
        )
        s_w_layout = self._smem_layout(t.block_n)
        if cutlass.const_expr(t.x_bulk):
            # Unswizzled (a bulk copy writes one row's K-tile as contiguous bytes), rows padded against bank conflicts.
            row = t.block_k + X_BULK_ROW_PAD
            s_x_layout = cute.make_layout((t.block_t, t.block_k, t.stages), stride=(row, 1, t.block_t * row))
        else:
            s_x_layout = self._smem_layout(t.block_t, for_tma=t.x_tma)
        g2s_w = self._g2s_copy(dtype)
        if cutlass.const_expr(t.x_tma):
            # The descriptor is encoded per call from m_x, so it covers this call's M (rows past it read as zero).
            x_copy, x_src = cute.nvgpu.cpasync.make_tiled_tma_atom(
                cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp(), m_x, s_x_layout, (t.block_t, t.block_k)
            )
        else:
            # The weights' tiled copy partitions the activation tiles too (bulk copies do not use it).
            x_copy, x_src = g2s_w, m_x
        m_out_t = cute.make_tensor(m_out.iterator, cute.select(m_out.layout, mode=[1, 0]))
        if cutlass.const_expr(m_work is not None):
            m_work = cute.make_tensor(m_work.iterator, cute.select(m_work.layout, mode=[2, 1, 0]))
        return m_out_t, m_work, s_w_layout, s_x_layout, g2s_w, x_copy, x_src, mma

    @cute.kernel
    def kernel(
        self,
        m_x: cute.Tensor,
        m_w: cute.Tensor,
        m_out_t: cute.Tensor,
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        m_chain: cute.Tensor | None,
        expected: cutlass.Int32 | None,
        s_w_layout: cute.ComposedLayout,
        s_x_layout: cute.ComposedLayout | cute.Layout,
        g2s_w: cute.TiledCopy,
        x_copy: cute.TiledCopy | cute.CopyAtom,
        x_src: cute.Tensor,
        mma: cute.TiledMma,
    ):
        """``m_out_t`` (N, M): out transposed; ``m_work`` (N, M, split_k): the split-K workspace, or ``None``, as
        the other optional operands (see :meth:`__call__`). ``x_copy`` / ``x_src``: the cp.async tiled copy (unused
        with ``x_bulk``) and ``m_x``, or with ``x_tma`` the TMA atom and its coordinate tensor over ``m_x``."""
        tidx, _, _ = cute.arch.thread_idx()
        bidx, bidy, bidz = cute.arch.block_idx()
        self.tile(cutlass.memory.SmemAllocator(), tidx, bidx, bidy, bidz, m_x, m_w, m_out_t, m_work, m_arrivals,
                  m_chain, expected, s_w_layout, s_x_layout, g2s_w, x_copy, x_src, mma)

    @cute.jit
    def tile(
        self,
        smem,
        tidx,
        bidx,
        bidy,
        bidz,
        m_x: cute.Tensor,
        m_w: cute.Tensor,
        m_out_t: cute.Tensor,
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        m_chain: cute.Tensor | None,
        expected: cutlass.Int32 | None,
        s_w_layout: cute.ComposedLayout,
        s_x_layout: cute.ComposedLayout | cute.Layout,
        g2s_w: cute.TiledCopy,
        x_copy: cute.TiledCopy | cute.CopyAtom,
        x_src: cute.Tensor,
        mma: cute.TiledMma,
        own_exit: cutlass.Constexpr[bool] = True,
    ):
        """One CTA's output tile ``(bidx, bidy)`` (and K part ``bidz``) with thread ``tidx``, its shared memory from
        ``smem`` (anything with ``SmemAllocator``'s ``allocate_tensor`` and ``allocate_array``). Operands as for
        :meth:`kernel`. ``own_exit=False``: a launch of several programs (:mod:`kda_backend.kernels.side_chain_gemm`)
        ends the CTA itself, so a linked tile leaves out its own exit (the waiting launch's count-out and the final
        ``griddepcontrol.wait``)."""
        t, link = self.tactic, self.link
        m_tokens = m_x.shape[0]
        k_tiles = self.k // t.block_k // t.split_k
        k_first = bidz * k_tiles  # this CTA's K-tiles: [k_first, k_first + k_tiles)

        # Tiles of this CTA: gW (block_n, block_k, k_tiles), gX (block_t, block_k, k_tiles), gO (block_n, block_t)
        g_w = cute.local_tile(m_w, (t.block_n, t.block_k), (bidx, None))
        g_x = cute.local_tile(x_src, (t.block_t, t.block_k), (bidy, None))
        g_o = cute.local_tile(m_out_t, (t.block_n, t.block_t), (bidx, bidy))
        c_x = cute.local_tile(cute.make_identity_tensor(m_x.shape), (t.block_t, t.block_k), (bidy, None))
        c_o = cute.local_tile(cute.make_identity_tensor(m_out_t.shape), (t.block_n, t.block_t), (bidx, bidy))

        s_w = smem.allocate_tensor(m_w.element_type, s_w_layout, 128)
        if cutlass.const_expr(t.x_tma):
            s_x = smem.allocate_tensor(m_x.element_type, s_x_layout.outer, 128, swizzle=s_x_layout.inner)
        else:
            s_x = smem.allocate_tensor(m_x.element_type, s_x_layout, 128)
        # Output tile staging, token-major like out (rows of one token contiguous).
        s_o = smem.allocate_tensor(
            m_out_t.element_type, cute.make_layout((t.block_n, t.block_t), stride=(1, t.block_n)), 16
        )

        thr_g2s_w = g2s_w.get_slice(tidx)
        t_gw = thr_g2s_w.partition_S(g_w)
        t_sw = thr_g2s_w.partition_D(s_w)
        p_w = None
        if cutlass.const_expr(self.partial):
            # Rows of this CTA's weight block that exist (all but in the last block).
            rows_left = self.n - bidx * t.block_n
            t_cw = thr_g2s_w.partition_S(cute.make_identity_tensor((t.block_n, t.block_k)))
            # Predicates per (vector, row, k-vector) with the K mode broadcast (stride 0), as for x below.
            p_w = cute.make_rmem_tensor(
                cute.make_layout(
                    (t_sw.shape[0][1], cute.size(t_sw, mode=[1]), cute.size(t_sw, mode=[2])),
                    stride=(cute.size(t_sw, mode=[1]), 1, 0),
                ),
                cutlass.Boolean,
            )
            for v in cutlass.range_constexpr(p_w.shape[0]):
                for r in cutlass.range_constexpr(p_w.shape[1]):
                    row = t_cw[(0, v), r, 0][0]
                    p_w[v, r, 0] = cute.elem_less(row, rows_left)
                    # Rows past the weight are never loaded; zero-filled once, they stay zero in every stage.
                    if rows_left <= row:
                        t_sw[(None, v), r, None, None].fill(0)
        x_full = None  # with activations by TMA or bulk copies: "slot s holds its x tile", one mbarrier per slot
        if cutlass.const_expr(t.x_tma or t.x_bulk):
            x_full = smem.allocate_array(cutlass.Int64, t.stages, byte_alignment=8)
            if tidx == 0:
                if cutlass.const_expr(t.x_tma):
                    cute.nvgpu.cpasync.prefetch_descriptor(x_copy)
                for s in cutlass.range_constexpr(t.stages):
                    cute.arch.mbarrier_init(x_full + s, 1)
            cute.arch.mbarrier_init_fence()
        if cutlass.const_expr(t.x_tma):
            t_sx, t_gx = cute.nvgpu.cpasync.tma_partition(
                x_copy, 0, cute.make_layout(1), cute.group_modes(s_x, 0, 2), cute.group_modes(g_x, 0, 2)
            )
            p_x = None
        elif cutlass.const_expr(t.x_bulk):
            t_gx, t_sx, p_x = g_x, s_x, None
            # Token rows at or past M are never loaded; zero-filled once, they stay zero in every stage.
            thr_g2s_w.partition_D(s_x).fill(0)
        else:
            thr_g2s_x = x_copy.get_slice(tidx)
            t_gx = thr_g2s_x.partition_S(g_x)
            t_sx = thr_g2s_x.partition_D(s_x)
            t_cx = thr_g2s_x.partition_S(c_x)
            # Token rows at or past M are never loaded; zero-filled once, they stay zero in every stage.
            # Predicates per (vector, row, k-vector) with the K mode broadcast (stride 0).
            p_x = cute.make_rmem_tensor(
                cute.make_layout(
                    (t_sx.shape[0][1], cute.size(t_sx, mode=[1]), cute.size(t_sx, mode=[2])),
                    stride=(cute.size(t_sx, mode=[1]), 1, 0),
                ),
                cutlass.Boolean,
            )
            for v in range(p_x.shape[0]):
                for r in range(p_x.shape[1]):
                    p_x[v, r, 0] = cute.elem_less(t_cx[(0, v), r, 0, 0][0], m_tokens)
            t_sx.fill(0)
        cute.arch.sync_threads()

        # Prologue: weights need nothing from the previous kernel, so they start before the PDL wait. Group s
        # of cp.async holds x tile s, and group 0 also every prologue weight tile, so "group s done" means
        # both operands of K-tile s have landed.
        w_policy, x_policy = l2_policy(EVICT_FIRST), l2_policy(EVICT_LAST)
        for s in cutlass.range_constexpr(t.stages - 1):
            if s < k_tiles:
                self._load_w(t_gw, t_sw, p_w, k_first + s, s, w_policy)
        if cutlass.const_expr(link.waits):
            # The next kernel may take the slots QKVG's CTAs free as early as it would behind QKVG itself; it still
            # waits for this launch to complete (which waits for QKVG's, see _count_out).
            if cutlass.const_expr(t.pdl):
                cute.arch.griddepcontrol_launch_dependents()
            # x is the signaling launch's output, which may still be running: wait for its tiles only.
            # Relaxed polls and one fence after: an acquire load invalidates this SM's L1 each time, which the
            # QKVG CTAs beside it use to share activations.
            if tidx == 0:
                arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
                while arrived < expected:
                    arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
                cute.arch.fence_acq_rel_gpu()
            cute.arch.sync_threads()
        elif cutlass.const_expr(link.x_ready):
            if cutlass.const_expr(t.pdl):
                cute.arch.griddepcontrol_launch_dependents()
        elif cutlass.const_expr(t.pdl):
            cute.arch.griddepcontrol_wait()
            # Releasing the next kernel this early lets its weight prologue overlap our tail.
            cute.arch.griddepcontrol_launch_dependents()
        for s in cutlass.range_constexpr(t.stages - 1):
            if s < k_tiles:
                self._load_x(
                    x_copy, t_gx, t_sx, p_x, x_full, k_first + s, s, tidx, m_tokens - bidy * t.block_t, x_policy
                )
            cute.arch.cp_async_commit_group()

        thr_mma = mma.get_slice(tidx)
        t_rw = mma.make_fragment_A(thr_mma.partition_A(s_w)[None, None, None, 0])
        t_rx = mma.make_fragment_B(thr_mma.partition_B(s_x)[None, None, None, 0])
        t_go = thr_mma.partition_C(g_o)
        t_co = thr_mma.partition_C(c_o)
        acc = mma.make_fragment_C(t_go)
        acc.fill(0.0)

        s2r_w = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, 4), m_w.element_type), mma
        )
        # A warp reads its tokens' 16-element K slice as 8x8 matrices: four for 16 tokens, two for 8.
        x_matrices = 4 // t.warp_grid[1]
        s2r_x = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(False, x_matrices), m_x.element_type), mma
        )
        thr_s2r_w = s2r_w.get_slice(tidx)
        thr_s2r_x = s2r_x.get_slice(tidx)
        t_sw_read = thr_s2r_w.partition_S(s_w)
        t_rw_view = thr_s2r_w.retile(t_rw)
        t_sx_read = thr_s2r_x.partition_S(s_x)
        t_rx_view = thr_s2r_x.retile(t_rx)
        k_blocks = cute.size(t_rw, mode=[2])

        for k_tile in range(k_tiles):
            cute.arch.cp_async_wait_group(t.stages - 2)
            if cutlass.const_expr(t.x_tma or t.x_bulk):
                cute.arch.mbarrier_wait(x_full + k_tile % t.stages, (k_tile // t.stages) % 2)
            cute.arch.sync_threads()
            # The slot refilled now was consumed in the previous iteration; the barrier above protects it.
            nxt = k_tile + t.stages - 1
            if nxt < k_tiles:
                slot = nxt % t.stages
                k_load = k_first + nxt
                self._load_w(t_gw, t_sw, p_w, k_load, slot, w_policy)
                self._load_x(
                    x_copy, t_gx, t_sx, p_x, x_full, k_load, slot, tidx, m_tokens - bidy * t.block_t, x_policy
                )
            cute.arch.cp_async_commit_group()
            read = k_tile % t.stages
            for kb in cutlass.range(k_blocks, unroll_full=True):
                cute.copy(s2r_w, t_sw_read[None, None, kb, read], t_rw_view[None, None, kb])
                cute.copy(s2r_x, t_sx_read[None, None, kb, read], t_rx_view[None, None, kb])
                cute.gemm(mma, acc, t_rw[None, None, kb], t_rx[None, None, kb], acc)

        if cutlass.const_expr(t.split_k > 1):
            s_last = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), SPLIT_K_FLAG_BYTES)
            self._reduce_split_k(acc, thr_mma, t_co, m_tokens, m_work, m_arrivals, s_last, bidx, bidy, bidz, tidx)
            # Only the CTA that arrived last holds the full sum; the others are done.
            if s_last[0] == t.split_k - 1:
                self._store_tile(acc, thr_mma, s_o, g_o, c_o, self.n, m_tokens, tidx)
                if cutlass.const_expr(link.signals):
                    self._signal(m_chain, tidx)
        else:
            self._store_tile(acc, thr_mma, s_o, g_o, c_o, self.n, m_tokens, tidx)
            if cutlass.const_expr(link.signals):
                self._signal(m_chain, tidx)
        if cutlass.const_expr(own_exit and link.waits):
            self._count_out(m_chain, tidx)
        elif cutlass.const_expr(own_exit and link.x_ready and t.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def _signal(self, m_chain, tidx):
        """Count this CTA's stored tile in on ``chain[0]``; release: the whole tile is visible device-wide first."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.atomic_add(m_chain.iterator, cutlass.Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _load_w(self, t_gw, t_sw, p_w, k, slot, policy):
        """Start loading weight K-tile ``k`` into ring slot ``slot``, only the rows ``p_w`` holds where the row block
        is partial; L2 evicts these lines first (``policy``, see :mod:`kda_backend.kernels.l2_cache_policy`)."""
        src, dst = t_gw[None, None, None, k], t_sw[None, None, None, slot]
        if cutlass.const_expr(self.partial):
            copy_with_policy_where(src, dst, p_w, policy, False)
        else:
            copy_with_policy(src, dst, policy)

    @cute.jit
    def _count_out(self, m_chain, tidx):
        """A waiting launch's exit: count this CTA in on ``chain[1]`` (it passed its wait); the last CTA resets both
        counters for the next pair on the stream. Then wait for the launch before to complete, so that kernels
        after this one see a completed stage, as with any other launch."""
        if tidx == 0:
            ctas = cute.arch.grid_dim()
            passed = cute.arch.atomic_add(m_chain.iterator + 1, cutlass.Int32(1), sem="relaxed", scope="gpu")
            if passed == ctas[0] * ctas[1] * ctas[2] - 1:
                m_chain[0] = 0
                m_chain[1] = 0
        if cutlass.const_expr(self.tactic.pdl):
            cute.arch.griddepcontrol_wait()

    @cute.jit
    def _load_x(self, x_copy, t_gx, t_sx, p_x, x_full, k, slot, tidx, rows_left, policy):
        """Start loading activation K-tile ``k`` into ring slot ``slot`` (see :attr:`Tactic.x_tma` and
        :attr:`Tactic.x_bulk`); ``rows_left``: tokens of this CTA's tile and after it (at least one). L2 keeps these
        lines last (``policy``): every CTA along the weight rows reads them."""
        t = self.tactic
        if cutlass.const_expr(t.x_bulk):
            # Warp 0, one row per lane: the barrier expects the real rows' bytes only.
            if tidx < 32:
                rows = cutlass.min(rows_left, t.block_t)
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(x_full + slot, rows * t.block_k * 2)
                for j in cutlass.range_constexpr(-(-t.block_t // 32)):
                    row = j * 32 + tidx
                    if row < rows:
                        src = cute.group_modes(t_gx[row, None, k], 0, 1)
                        dst = cute.group_modes(t_sx[row, None, slot], 0, 1)
                        bulk_copy_with_policy(src, dst, t.block_k * 2, x_full + slot, policy)
        elif cutlass.const_expr(t.x_tma):
            # Warp 0 only: the TMA copy elects one lane itself (elect.sync needs the whole warp present).
            if tidx < 32:
                if tidx == 0:
                    cute.arch.mbarrier_arrive_and_expect_tx(x_full + slot, t.block_t * t.block_k * 2)
                cute.copy(x_copy, t_gx[None, k], t_sx[None, slot], tma_bar_ptr=x_full + slot, cache_policy=policy)
        else:
            copy_with_policy_where(t_gx[None, None, None, k], t_sx[None, None, None, slot], p_x, policy, t.x_via_l1)

    def _in_bounds(self, coord, rows, m_tokens):
        """Whether the output element at ``coord`` (row, token) exists in an output of ``rows`` rows; rows are
        checked only where the last row block is partial (a static property)."""
        if rows % self.tactic.block_n:
            return cute.elem_less(coord, (rows, m_tokens))
        return cute.elem_less(coord[1], m_tokens)

    @cute.jit
    def _store_tile(self, acc, thr_mma, s_o, g_o, c_o, rows, m_tokens, tidx):
        """Write the accumulator as the output dtype, real rows (of ``rows``) and tokens only. The MMA fragment
        holds scattered 2-byte elements (neighbours belong to other tokens), so it goes through shared memory and
        leaves as 16-byte runs of one token's rows (measured on H200: 0.1-0.3 us faster than storing the fragment
        directly at M = 8..16)."""
        t = self.tactic
        t_so = thr_mma.partition_C(s_o)
        t_so.store(acc.load().to(s_o.element_type))
        cute.arch.sync_threads()
        vec = (ELEMS_PER_COPY, 1)
        v_s, v_g, v_c = cute.zipped_divide(s_o, vec), cute.zipped_divide(g_o, vec), cute.zipped_divide(c_o, vec)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), s_o.element_type, num_bits_per_copy=COPY_BITS)
        vectors = t.block_n * t.block_t // ELEMS_PER_COPY
        for j in cutlass.range_constexpr((vectors + t.threads - 1) // t.threads):
            i = j * t.threads + tidx
            if i < vectors and self._in_bounds(v_c[(0, i)], rows, m_tokens):
                cute.copy(store, v_s[(None, i)], v_g[(None, i)])

    @cute.jit
    def _reduce_split_k(self, acc, thr_mma, t_co, m_tokens, m_work, m_arrivals, s_last, bidx, bidy, bidz, tidx):
        """Publish this CTA's partial and count it in; in the CTA that arrives last, replace ``acc`` with the sum
        of every split's partial, in split order (``s_last[0] == split_k - 1`` there). Only real tokens' partials
        are written and read (measured on H200: writing whole padded token tiles costs 0.5-0.8 us at low M)."""
        t = self.tactic
        tile_shape = (t.block_n, t.block_t)
        t_gp = thr_mma.partition_C(cute.local_tile(m_work[None, None, bidz], tile_shape, (bidx, bidy)))
        for i in range(cute.size(acc)):
            if self._in_bounds(t_co[i], self.n, m_tokens):
                t_gp[i] = acc[i]
        # Release: every thread's partial is visible device-wide before thread 0 counts the CTA in.
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        tile = bidy * row_blocks(self.n, t.block_n) + bidx
        if tidx == 0:
            s_last[0] = cute.arch.atomic_add(m_arrivals.iterator + tile, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        cute.arch.sync_threads()
        if s_last[0] == t.split_k - 1:
            cute.arch.fence_acq_rel_gpu()
            # Every load is issued before the first add, so the last CTA waits for L2 about once, not per split
            # (measured: 0.6 us less at M = 16). L2 loads (.cg): this SM's L1 may hold a stale copy of a line
            # another CTA wrote since.
            parts = []
            for s in cutlass.range_constexpr(t.split_k):
                t_gs = thr_mma.partition_C(cute.local_tile(m_work[None, None, s], tile_shape, (bidx, bidy)))
                part = []
                for i in cutlass.range_constexpr(cute.size(acc)):
                    value = cutlass.Float32(0.0)
                    if self._in_bounds(t_co[i], self.n, m_tokens):
                        value = cute.arch.load(t_gs.iterator + cute.crd2idx(i, t_gs.layout), cutlass.Float32, cop="cg")
                    part.append(value)
                parts.append(part)
            for i in cutlass.range_constexpr(cute.size(acc)):
                total = parts[0][i]
                for s in cutlass.range_constexpr(1, t.split_k):
                    total = total + parts[s][i]
                acc[i] = total
            if tidx == 0:
                # Stream order makes the reset visible to the next kernel that uses these counters.
                m_arrivals[tile] = 0
