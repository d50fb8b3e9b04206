"""Skinny GEMM ``out[M, N] = x[M, K] @ w[N, K]^T`` on Hopper's warpgroup tensor cores (``wgmma``), for M of tens to
hundreds of tokens.

Algorithm (swap-AB, as :mod:`kda_backend.kernels.skinny_gemm`). The MMA's M mode is given to the weight rows and its
N mode to the tokens: each CTA owns ``block_n`` weight rows and ``block_t`` tokens and walks its share of K. N and K
are thousands, so the kernel is memory-bound on the weights (each read once); from some tens of tokens on, the
``mma.sync`` kernel's ldmatrix traffic and register-fed MMAs cost issue slots that ``wgmma`` spends on nothing: it reads
both operands from shared memory by descriptor, and one instruction covers 64 weight rows by up to 256 tokens.
With :attr:`WgmmaTactic.tokens_on_m` the roles turn round: the tokens (padded to 64 per warpgroup) fill the M mode and
the weight rows the N mode, so a CTA can own fewer than 64 rows and more SMs stream the weights (Kimi-K3's TP 8 QKVG:
128 CTAs of 48 rows against 96 of 64); the MMA's padding rows are never loaded, never stored. Under swap-AB a CTA
may as well own fewer rows than the 64-row atom (:attr:`WgmmaTactic.padded_rows`): the weights arrive in boxes of 8
rows and the atom's padding rows are never loaded, never stored, so 128 CTAs of 48 rows stream TP 8's QKVG with one
warpgroup reading each activation tile once, where tokens on M need two from 65 tokens on. Such a CTA may also
split K with its pair in a thread-block cluster of :data:`CLUSTER_SPLIT_K` (half the MMAs and activations each):
the fused stage's F_A/beta does (:mod:`kda_backend.kernels.wgmma_stage`).

- Warp specialization: one producer warp issues every load with the TMA unit into a ``stages``-deep ring of
  ``[block_n, block_k]`` weight and ``[block_t, block_k]`` activation tiles (K-major, 128-byte swizzle, the layout
  ``wgmma`` reads); one or two consumer warpgroups (64 weight rows per ``wgmma`` atom) only wait for a slot, issue the
  MMAs and free the slot. A slot's full/empty mbarrier pair is :class:`cutlass.pipeline.PipelineTmaAsync`'s: one
  transaction barrier per slot counts the bytes of both tiles. Tokens at or past M are zero-filled by the TMA unit
  (the activation tensor map covers exactly M rows), rows past N likewise, so neither needs a predicate in the loop.
- With :attr:`WgmmaTactic.weight_cluster` the token tiles of one row block run as a thread-block cluster that shares
  every weight tile: each CTA loads its share of the tile's rows by TMA multicast into every CTA of the cluster, a slot
  is refilled once the consumers of all of them freed it, and each producer waits for its last slots to be freed
  (remote arrivals) before its CTA exits.
- L2 evicts weight lines first (each is read once per layer) and activation lines last (every CTA along the rows
  reads them), see :mod:`kda_backend.kernels.l2_cache_policy`.
- Accumulation in fp32 registers; each consumer keeps one K-tile of MMAs in flight and frees the slot of the one
  before. No cross-warp reduction and no floating-point atomics, so results are bitwise deterministic; split-K
  (:attr:`WgmmaTactic.split_k`) sums its partials in split order inside the kernel, with the protocol of
  :class:`~kda_backend.kernels.skinny_gemm.Tactic`'s split-K (fp32 workspace, per-tile arrival counters that the
  last CTA resets), or with padded rows within the tile's thread-block cluster: each CTA stages its partial in its
  drained ring and sums its share of the tile from every CTA's through distributed shared memory.
- Programmatic dependent launch: the producer issues the weight tiles of the prologue before
  ``griddepcontrol.wait``, so they stream while the previous kernel (which produced x) drains; only activation
  loads wait for it.
- The output tile leaves through shared memory (the drained ring) as 16-byte runs of one token's rows; only tokens
  below M and rows below N are stored.

Shapes N, K and the row strides are compile-time constants; M is a runtime value up to ``block_t * grid_y``. The
kernel takes :class:`~kda_backend.kernels.skinny_gemm.SkinnyGemm`'s call signature, so the compile cache and the
provider launch either; it takes no part in the single-stream side chain
(:class:`~kda_backend.kernels.skinny_gemm.Link`).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass import pipeline
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils import hopper_helpers

from kda_backend.kernels.arrival_counters import SPLIT_K_COUNTERS
from kda_backend.kernels.cluster_smem import VECTOR_FLOATS, load_peer_f32x4
from kda_backend.kernels.l2_cache_policy import EVICT_FIRST, EVICT_LAST, l2_policy
from kda_backend.kernels.skinny_gemm import (
    COPY_BITS,
    ELEMS_PER_COPY,
    MAX_SMEM_BYTES,
    NO_LINK,
    SPLIT_K_FLAG_BYTES,
    Link,
    SplitKSchedule,
    check_optional_operands,
    output_tiles,
    row_blocks,
)

ATOM_ROWS = 64  # wgmma's M: weight rows (tokens with tokens_on_m) per instruction and warpgroup
BLOCK_ROWS = (64, 128, 256)  # weight rows per CTA under swap-AB
# With tokens_on_m the activations arrive in boxes of 8 tokens, and with padded_rows the weights in boxes of 8 rows:
# one 128-byte swizzle atom each, contiguous in the MMA's 64-row tile, so only the tile's real tokens or rows are
# loaded. One box of 64 tokens reaching past M is zero-filled by the TMA unit, which measured slow: TP 8 QKVG alone
# 31.0 / 29.5 us at M = 24 / 32 against 22.5 / 21.9 at 48 / 64
# (benchmarks/results/levers/wgmma-tokens-on-m-whole-box.log). Fewer boxes where the tile's tokens (rows) allow, up to
# one of 128, moved no served stage by more than 0.16 us on an H100 (benchmarks/results/levers/activation-box-size/).
BOX_ROWS = 8
MAX_TOKENS_ON_M = 2 * ATOM_ROWS  # the largest token tile with tokens_on_m: two consumer warpgroups
# Padded-rows CTAs split K in a cluster of this many (split_k), each loading half the activations and issuing half
# the MMAs: the fused stage's F_A/beta above 64 tokens (see wgmma_stage.split_side_chain).
CLUSTER_SPLIT_K = 2
# Tokens-on-M CTAs of one row block and neighbouring token tiles may share every weight tile in a cluster of this many
# (WgmmaTactic.weight_cluster), each loading its share of the tile's rows by TMA multicast into both.
WEIGHT_CLUSTERS = (1, 2)
# The autotuner's tokens_on_m candidates stop here: at M = 96 / 128 they took QKVG alone 26.71 / 29.82 us at best
# against 26.31 / 28.42 for swap-AB 64-row CTAs (H200, Kimi-K3 TP 8, benchmarks/results/levers/wgmma-tokens-on-m.log).
TOKENS_ON_M_CANDIDATES_UP_TO = 64
WARPGROUP_THREADS = 128
PRODUCER_THREADS = 32  # one warp issues the TMA loads
SWIZZLE_ATOM_BYTES = 1024  # a 128-byte swizzle repeats every 8 rows of 128 bytes; TMA needs the ring aligned to it
# Bytes before the ring: the slots' mbarrier pairs and the split-K flag, rounded up to the ring's alignment (dynamic
# shared memory starts 1024-byte aligned).
RING_OFFSET_BYTES = SWIZZLE_ATOM_BYTES
MAX_STAGES = 32  # their 16-byte mbarrier pairs and the flag fit before the ring
MAX_DEFAULT_STAGES = 12  # the deepest ring the default and the candidates use
MAX_ACC_REGISTERS = 128  # fp32 accumulators per consumer thread; more spill (255 registers per thread in all)
# The token tiles the candidates and the tile covering an M use: every multiple of 8, since the TMA unit zero-fills a
# box's tokens past M slowly (TP 8 QKVG alone at M = 72 with 48-row CTAs: 29.38 us with a 96-token tile, 22.40-22.58
# with a 72-token one, benchmarks/results/levers/wgmma-padded-rows.log; 64-row CTAs at M = 136: 59.89 us with a
# 192-token tile, 33.43 with a 136-token one, on two H200s, levers/wgmma-stream-k/).
TOKEN_TILES = tuple(range(8, 257, 8))
MAX_TOKEN_TILE = 256  # wgmma's N limit
SMS = 132  # H100 / H200 SXM: what the candidates' CTA counts aim at
CONSUMER_BARRIER = 1  # named barrier of the consumer warpgroups (0 is the whole CTA's)
REDUCE_REGISTERS = 64  # fp32 partials the split-K reduction holds at once per thread


@dataclasses.dataclass(frozen=True)
class WgmmaTactic(SplitKSchedule):
    """One specialization of the kernel.

    :param block_n: weight rows per CTA: 64 (one consumer warpgroup), 128 (two) or 256 (two, two ``wgmma`` atoms
        each), or a multiple of 8 below 64 in one padded atom (64-element K-tiles, split-K in a cluster of
        :data:`CLUSTER_SPLIT_K` or none); with ``tokens_on_m``
        any multiple of 8 up to 256 (the MMA's N). Where it does not divide N the last
        row block is partial (its rows past N are zero-filled and never stored).
    :param block_k: K elements per pipeline stage (64: one 128-byte swizzle atom, or 128), dividing K.
    :param block_t: tokens per CTA, a multiple of 8: the ``wgmma`` N, up to 256; with ``tokens_on_m`` up to
        :data:`MAX_TOKENS_ON_M`, covered by 64-token MMA atoms (one consumer warpgroup each). M above it uses more
        CTAs along grid y (each reads the whole weight block again, mostly from L2).
    :param stages: K-tiles in flight per CTA (shared memory ring slots).
    :param split_k: CTAs sharing one output tile along K (grid z), for N too small to give every SM a row block.
        Each writes an fp32 partial to a workspace ``[split_k, M, N]`` and counts itself in on the tile's arrival
        counter; the last to arrive sums the partials in split order, writes the output and resets the counter.
        With :attr:`padded_rows` the tile's CTAs form one thread-block cluster instead (:attr:`in_cluster`): each
        stages its partial in its drained ring and sums its share of the tile from every CTA's, in split order.
    :param tokens_on_m: the tokens fill the MMA's M side and the weight rows its N side, instead of swap-AB
        (64-element K-tiles, no split-K). A CTA may then own fewer than 64 weight rows, so more CTAs stream the
        weights.
    :param pdl: launch with programmatic dependent launch (weight prologue before ``griddepcontrol.wait``).
    :param weight_cluster: with ``tokens_on_m``, the CTAs of one row block and this many neighbouring token tiles
        (grid y) run as one thread-block cluster that shares every weight tile: each loads ``1 / weight_cluster``
        of the tile's rows by TMA multicast into every CTA of it, so L2 serves each weight byte once per cluster,
        not once per token tile. A slot is refilled once the consumers of every CTA of the cluster freed it. The
        token tile is then M split over the cluster (:meth:`for_tokens`). Measured on H200 for Kimi-K3 TP 8 QKVG
        alone, 128 CTAs of 96 rows in 11 slots: 23.37 / 24.82 us at M = 96 / 128, where the same CTAs without the
        cluster took 31.2-33.1 on another H200 (`benchmarks/results/levers/wgmma-weight-cluster/`, RESULTS.md).
    """

    family: ClassVar[str] = "wgmma"

    block_n: int = 128
    block_k: int = 64
    block_t: int = 32
    stages: int = 6
    split_k: int = 1
    tokens_on_m: bool = False
    pdl: bool = True
    weight_cluster: int = 1

    @property
    def padded_rows(self) -> bool:
        """Swap-AB with fewer weight rows than one ``wgmma`` atom's 64: the rows arrive in boxes of 8 and the MMA's
        padding rows stay unloaded and unstored, as the tokens do with ``tokens_on_m``."""
        return not self.tokens_on_m and self.block_n < ATOM_ROWS

    @property
    def mma_rows(self) -> int:
        """Weight rows one CTA's MMAs cover: ``block_n``, or one 64-row atom where :attr:`padded_rows`."""
        return ATOM_ROWS if self.padded_rows else self.block_n

    @property
    def in_cluster(self) -> bool:
        """Whether the split-K partials are summed in a thread-block cluster (padded rows), not a workspace."""
        return self.split_k > 1 and self.padded_rows

    @property
    def uses_workspace(self) -> bool:
        """Whether a launch takes an fp32 workspace and arrival counters (split-K outside a cluster)."""
        return self.split_k > 1 and not self.in_cluster

    def ctas(self, n: int, m: int) -> int:
        """CTAs of one launch: a weight cluster's token tiles come in whole clusters."""
        token_tiles = -(-m // self.block_t)
        token_tiles = -(-token_tiles // self.weight_cluster) * self.weight_cluster
        return row_blocks(n, self.block_n) * token_tiles * self.split_k

    def staging_stride(self) -> int:
        """Elements from one token to the next in the bf16 output tile staged in shared memory: the MMA's rows, 8 more
        where those are an even number of 16-byte runs. An odd number of runs puts consecutive tokens in different
        16-byte bank groups, so by the bank arithmetic the fragment's 2-byte stores (a warp writes 8 rows of 4 or 8
        tokens at once) and the 16-byte loads of the runs meet no conflicts (not profiled again). At 64 rows a token
        stride of 128 bytes set 4-way conflicts on every store (Nsight Compute, H200,
        `benchmarks/results/qkvg-profile/`); with this stride QKVG alone ran 0.2-0.4 us faster at M = 72..128
        (RESULTS.md, levers)."""
        runs = self.mma_rows // ELEMS_PER_COPY
        return self.mma_rows if runs % 2 else self.mma_rows + ELEMS_PER_COPY

    def staged_tile_bytes(self) -> int:
        """Shared memory of the staged bf16 output tile (:meth:`staging_stride` per token)."""
        return self.staging_stride() * self.mma_tokens * 2

    def partial_bytes(self) -> int:
        """The fp32 partial an in-cluster split stages in its drained ring: the MMA's whole tile (0 otherwise)."""
        return self.mma_rows * self.mma_tokens * 4 if self.in_cluster else 0

    @property
    def consumer_warpgroups(self) -> int:
        rows = self.block_t if self.tokens_on_m else self.block_n
        return 1 if rows <= ATOM_ROWS else 2

    @property
    def mma_tokens(self) -> int:
        """Tokens one CTA's MMAs cover: ``block_t``, or with ``tokens_on_m`` whole 64-token atoms."""
        return ATOM_ROWS * self.consumer_warpgroups if self.tokens_on_m else self.block_t

    @property
    def consumer_threads(self) -> int:
        return WARPGROUP_THREADS * self.consumer_warpgroups

    @property
    def threads(self) -> int:
        return self.consumer_threads + PRODUCER_THREADS

    def acc_registers(self) -> int:
        """fp32 accumulators each consumer thread holds."""
        return self.mma_rows * self.mma_tokens // self.consumer_warpgroups // WARPGROUP_THREADS

    def stage_bytes(self) -> int:
        """Bytes loaded into one ring slot, weight and activation tiles: what its transaction barrier counts."""
        return (self.block_n + self.block_t) * self.block_k * 2

    def slot_bytes(self) -> int:
        """Shared memory of one ring slot: the MMA's whole tiles (their padding rows and tokens stay unloaded)."""
        return (self.mma_rows + self.mma_tokens) * self.block_k * 2

    def smem_bytes(self) -> int:
        """The ring after the barrier area (the output tile and an in-cluster partial reuse the drained ring)."""
        return RING_OFFSET_BYTES + max(self.stages * self.slot_bytes(), self.partial_bytes())

    def with_activations_from_l2(self) -> WgmmaTactic:
        """Itself: the TMA unit reads activations from L2 already (API parity with
        :meth:`~kda_backend.kernels.skinny_gemm.Tactic.with_activations_from_l2`)."""
        return self

    def key(self) -> str:
        split = f"x{self.split_k}" if self.split_k > 1 else ""
        order = "m" if self.tokens_on_m else ""
        cluster = f"c{self.weight_cluster}" if self.weight_cluster > 1 else ""
        return (f"w{self.block_n}k{self.block_k}t{self.block_t}s{self.stages}{split}{order}{cluster}"
                f"{'p' if self.pdl else ''}")

    def for_tokens(self, m: int) -> WgmmaTactic:
        """This tactic with the token tile that runs ``m`` tokens: the smallest covering one (with ``tokens_on_m``
        ``m`` rounded up to a multiple of 8; with a weight cluster, the smallest whose cluster covers ``m``)."""
        if self.tokens_on_m:
            block_t = min(-(-m // (8 * self.weight_cluster)) * 8, MAX_TOKENS_ON_M)
        else:
            block_t = wgmma_block_t_for(m)
        return self if block_t == self.block_t else dataclasses.replace(self, block_t=block_t)


def validate_wgmma_tactic(tactic: WgmmaTactic, n: int, k: int, x_row_stride: int) -> str | None:
    """``None`` if ``tactic`` can run a GEMM with these static sizes, else why not."""
    t = tactic
    if n % ELEMS_PER_COPY:
        return f"N={n} must be a multiple of {ELEMS_PER_COPY} (16-byte output vectors)"
    if t.tokens_on_m:
        if t.block_n % 8 or not 8 <= t.block_n <= MAX_TOKEN_TILE:
            return f"block_n={t.block_n} must be a multiple of 8 from 8 to {MAX_TOKEN_TILE} (the MMA's N)"
        if t.block_t % BOX_ROWS or not BOX_ROWS <= t.block_t <= MAX_TOKENS_ON_M:
            return f"block_t={t.block_t} must be a multiple of 8 from 8 to {MAX_TOKENS_ON_M} with tokens_on_m"
        if t.block_k != 64:
            return f"block_k={t.block_k}: tokens_on_m loads 8-token boxes of one 64-element swizzle atom"
        if t.split_k != 1:
            return f"split_k={t.split_k}: tokens_on_m runs unsplit (its narrow CTAs fill the SMs)"
        if t.weight_cluster not in WEIGHT_CLUSTERS or t.block_n % (BOX_ROWS * t.weight_cluster):
            return (f"weight_cluster={t.weight_cluster} must be one of {WEIGHT_CLUSTERS}, sharing block_n={t.block_n} "
                    f"rows in multiples of {BOX_ROWS}")
    elif t.weight_cluster != 1:
        return f"weight_cluster={t.weight_cluster}: only tokens_on_m CTAs share weight tiles (1 otherwise)"
    elif t.padded_rows:
        if t.block_n % 8 or t.block_n < 8:
            return f"block_n={t.block_n} must be one of {BLOCK_ROWS}, or a multiple of 8 below {ATOM_ROWS}"
        if t.block_k != 64:
            return f"block_k={t.block_k}: rows below {ATOM_ROWS} load in 8-row boxes of one 64-element swizzle atom"
        if t.split_k not in (1, CLUSTER_SPLIT_K):
            return (f"split_k={t.split_k}: rows below {ATOM_ROWS} run unsplit or split in a cluster of "
                    f"{CLUSTER_SPLIT_K}")
    elif t.block_n not in BLOCK_ROWS:
        return f"block_n={t.block_n} must be one of {BLOCK_ROWS}, or a multiple of 8 below {ATOM_ROWS}"
    if t.block_k not in (64, 128) or k % t.block_k:
        return f"block_k={t.block_k} must be 64 or 128 dividing K={k}"
    if t.block_t % 8 or not 8 <= t.block_t <= MAX_TOKEN_TILE:
        return f"block_t={t.block_t} must be a multiple of 8 from 8 to {MAX_TOKEN_TILE}"
    if t.acc_registers() > MAX_ACC_REGISTERS:
        return (f"block_n={t.block_n} with block_t={t.block_t} needs {t.acc_registers()} accumulator registers per "
                f"thread > {MAX_ACC_REGISTERS}")
    if not 2 <= t.stages <= MAX_STAGES:
        return f"stages={t.stages} must be from 2 to {MAX_STAGES}"
    if t.split_k < 1 or (k // t.block_k) % t.split_k:
        return f"split_k={t.split_k} must divide the {k // t.block_k} K-tiles"
    if t.smem_bytes() > MAX_SMEM_BYTES:
        return f"needs {t.smem_bytes()} B of shared memory > {MAX_SMEM_BYTES}"
    if x_row_stride % ELEMS_PER_COPY:
        return f"x row stride {x_row_stride} must be a multiple of {ELEMS_PER_COPY} elements (16 bytes, TMA)"
    return None


def wgmma_output_tiles(tactic: WgmmaTactic, n: int, m: int) -> int:
    """Output tiles of one launch (one arrival counter each with split-K): the same count as the skinny kernel's."""
    return output_tiles(tactic, n, m)


def wgmma_block_t_for(m: int) -> int:
    """Smallest token tile of :data:`TOKEN_TILES` covering ``m`` (above 256 tokens, tiles of 256)."""
    return next((t for t in TOKEN_TILES if m <= t), MAX_TOKEN_TILE)


def max_stages(block_n: int, block_k: int, block_t: int, ctas_per_sm: int, tokens_on_m: bool = False) -> int:
    """Most ring slots that let ``ctas_per_sm`` CTAs of this tile share one SM's shared memory."""
    probe = WgmmaTactic(block_n, block_k, block_t, stages=1, tokens_on_m=tokens_on_m)
    budget = MAX_SMEM_BYTES // ctas_per_sm - RING_OFFSET_BYTES - 1024 * (ctas_per_sm - 1)  # 1 KB reserved per CTA
    return budget // probe.slot_bytes()


def leaves_room(tactic: WgmmaTactic) -> bool:
    """Whether ``tactic``'s CTA leaves at least half an SM's shared memory to the side chain's CTAs beside it."""
    return tactic.smem_bytes() <= MAX_SMEM_BYTES // 2


def tokens_on_m_rows(n: int) -> int:
    """Weight rows per CTA with ``tokens_on_m``: the fewest (a multiple of 8) giving at most :data:`SMS` row blocks,
    so every SM streams about one (Kimi-K3 QKVG: 48 rows at TP 8, 96 at TP 4, 24 at TP 16, 128 CTAs each)."""
    return -(-n // (SMS * 8)) * 8


def _fill_split(n: int, k: int, m: int, block_n: int, block_k: int, block_t: int) -> int:
    """The split-K for an output with too few tiles to keep half the SMs streaming: the smallest split of the K-tiles
    reaching :data:`SMS` CTAs, limited so the fp32 partials (written and read once each) stay below a quarter of the
    weight bytes and the output tiles within one stream's arrival counters. More tiles are not split (measured on
    H200 for Kimi-K3 TP8 QKVG alone, 96 row blocks of 64 split in two with two CTAs per SM: 33.6 / 37.7 us at
    M = 96 / 128 against 25.8 / 27.9 unsplit, `benchmarks/results/levers/wgmma-wide-ctas-split-k.log`)."""
    tiles = row_blocks(n, block_n) * -(-m // block_t)
    k_tiles = k // block_k
    if tiles >= SMS // 2 or tiles > SPLIT_K_COUNTERS:
        return 1
    limit = max(1, k // (16 * max(m, 1)))  # split * M * N * 8 B <= N * K * 2 B / 4
    splits = [s for s in range(1, k_tiles + 1) if k_tiles % s == 0 and s <= limit]
    return next((s for s in splits if tiles * s >= SMS), splits[-1])


def default_wgmma_tactic(n: int, k: int, m: int) -> WgmmaTactic:
    """A sound tactic without tuning: 64-row CTAs (the most row blocks), 64-element K-tiles and the deepest ring one
    CTA per SM allows (at most 12 K-tiles), split along K only where the row blocks leave most SMs idle. Measured on
    H200 for Kimi-K3 TP8 QKVG alone: 24.2 / 25.0 / 27.8 us at M = 32 / 64 / 128 (with PDL; the autotune log in
    `benchmarks/results/h200-all-engine-batch-sizes/tp8/`)."""
    block_t = wgmma_block_t_for(m)
    block_k = 64 if k % 64 == 0 else 128
    split_k = _fill_split(n, k, m, 64, block_k, block_t)
    ctas_per_sm = 2 if split_k > 1 else 1
    stages = max(2, min(MAX_DEFAULT_STAGES, max_stages(64, block_k, block_t, ctas_per_sm)))
    return WgmmaTactic(64, block_k, block_t, stages, split_k)


def tokens_on_m_tactics(n: int, k: int, m: int) -> list[WgmmaTactic]:
    """The ``tokens_on_m`` tactics worth timing at ``m`` tokens (none above :data:`TOKENS_ON_M_CANDIDATES_UP_TO` or
    where 64-element K-tiles do not divide K): :func:`tokens_on_m_rows` rows per CTA with PDL, in the deepest ring
    one CTA per SM allows (at most 12 K-tiles; also without PDL), the deepest that :func:`leaves_room` for the side
    chain, and the ring halfway between. Measured on H200 for Kimi-K3 TP 8 (`benchmarks/results/levers/
    wgmma-tokens-on-m.log`, `wgmma-tokens-on-m-stage.log`): without PDL QKVG alone took 1.5-1.7 us longer at
    M = 17..40; beside the tuned side chain the stage took 22.43 / 22.81 us at M = 24 / 32 with 10 stages against
    24.21 / 24.54 with 8, and 25.36 us at M = 64 with 8 stages against 26.04 with 10."""
    if m > TOKENS_ON_M_CANDIDATES_UP_TO or k % 64:
        return []
    probe = WgmmaTactic(tokens_on_m_rows(n), 64, 64, 1, tokens_on_m=True).for_tokens(m)
    deepest = min(MAX_DEFAULT_STAGES, max_stages(probe.block_n, 64, probe.block_t, 1, tokens_on_m=True))
    roomy = min(deepest, (MAX_SMEM_BYTES // 2 - RING_OFFSET_BYTES) // probe.slot_bytes())
    rings = [stages for stages in dict.fromkeys((deepest, (deepest + roomy) // 2, roomy)) if stages >= 2]
    if not rings:
        return []
    deep = dataclasses.replace(probe, stages=rings[0])
    return [deep, dataclasses.replace(deep, pdl=False), *(dataclasses.replace(probe, stages=s) for s in rings[1:])]


def padded_rows_tactics(n: int, k: int, m: int) -> list[WgmmaTactic]:
    """The swap-AB tactic whose CTAs hold fewer rows than one 64-row atom (:attr:`WgmmaTactic.padded_rows`):
    :func:`tokens_on_m_rows` rows per CTA, so every SM streams about one row block, with PDL in the deepest ring one
    CTA per SM allows (at most 12 K-tiles); none where that is 64 rows or more or 64-element K-tiles do not divide K.
    Measured on H200 for Kimi-K3 TP 8 QKVG alone (`benchmarks/results/levers/wgmma-padded-rows.log`): 22.40-22.58 /
    23.38 / 24.42-24.47 / 25.94 us at M = 72 / 96 / 112 / 128, 1.04-1.22x its floor, against 24.44 / 26.77 / - /
    31.89 for tokens-on-M CTAs of 48 rows in the same runs."""
    rows = tokens_on_m_rows(n)
    if rows >= ATOM_ROWS or k % 64:
        return []
    probe = WgmmaTactic(rows, 64, wgmma_block_t_for(m), 1)
    stages = min(MAX_DEFAULT_STAGES, max_stages(rows, 64, probe.block_t, 1))
    return [dataclasses.replace(probe, stages=stages)] if stages >= 2 else []


def weight_cluster_tactics(n: int, k: int, m: int) -> list[WgmmaTactic]:
    """The tokens-on-M tactic whose token tiles share weight tiles in clusters of 2
    (:attr:`WgmmaTactic.weight_cluster`), worth timing above :data:`TOKENS_ON_M_CANDIDATES_UP_TO` tokens: twice
    :func:`tokens_on_m_rows` rows per CTA (row blocks times the cluster's two token tiles give every SM about one
    CTA), with PDL, in the deepest ring one CTA per SM allows (at most 12 K-tiles); none where the rows exceed the
    MMA's N or 64-element K-tiles do not divide K. No ring that leaves room for a side chain beside it: on H200 for
    Kimi-K3 such rings took QKVG alone 1.3-1.5x as long (TP 8, 5 slots: 32.02 / 32.71 us at M = 96 / 128 against
    23.37 / 24.82 with 11; TP 4, 3 slots: 65.15 / 66.08 against 45.58 / 46.77 with 7), and beside the side chain
    TP 8's 5-slot ring took 3.7-4.1 us more again (`benchmarks/results/levers/wgmma-weight-cluster/`)."""
    rows = 2 * tokens_on_m_rows(n)
    if m <= TOKENS_ON_M_CANDIDATES_UP_TO or k % 64 or rows > MAX_TOKEN_TILE:
        return []
    probe = WgmmaTactic(rows, 64, 64, 1, tokens_on_m=True, weight_cluster=2).for_tokens(m)
    deepest = min(MAX_DEFAULT_STAGES, max_stages(rows, 64, probe.block_t, 1, tokens_on_m=True))
    return [dataclasses.replace(probe, stages=deepest)] if deepest >= 2 else []


def wgmma_candidate_tactics(n: int, k: int, m: int, x_row_stride: int) -> list[WgmmaTactic]:
    """Tactics worth timing for one GEMM (the autotuner's search space): the covering token tile, each row block
    size, the deepest ring for one and for two CTAs per SM, without split-K and with the split that fills the SMs;
    and :func:`tokens_on_m_tactics`, :func:`padded_rows_tactics` and :func:`weight_cluster_tactics`."""
    block_t = wgmma_block_t_for(m)
    found: list[WgmmaTactic] = []
    for block_n in (64, 128, 256):
        for block_k in (64, 128):
            for ctas_per_sm in (1, 2):
                stages = min(MAX_DEFAULT_STAGES, max_stages(block_n, block_k, block_t, ctas_per_sm))
                for split_k in sorted({1, _fill_split(n, k, m, block_n, block_k, block_t)}):
                    tactic = WgmmaTactic(block_n, block_k, block_t, stages, split_k)
                    if tactic not in found and validate_wgmma_tactic(tactic, n, k, x_row_stride) is None:
                        found.append(tactic)
    default = default_wgmma_tactic(n, k, m)
    extra = [*tokens_on_m_tactics(n, k, m), *padded_rows_tactics(n, k, m), *weight_cluster_tactics(n, k, m)]
    for tactic in [default, *extra]:
        if tactic not in found and validate_wgmma_tactic(tactic, n, k, x_row_stride) is None:
            found.append(tactic)
    return found


def _load_tile(tma, t_g, t_s, tile, k, slot, bar, policy, boxes: tuple[int, int] | None) -> None:
    """Start one operand tile's TMA load of K-tile ``k`` into ring slot ``slot``: one box where ``boxes`` is
    ``None``, else ``boxes = (per tile, per slot)`` boxes of 8 rows, those of tile ``tile`` along the operand (traced
    once per box: a static loop)."""
    if boxes is None:
        cute.copy(tma, t_g[None, k], t_s[None, slot], tma_bar_ptr=bar, cache_policy=policy)
        return
    per_tile, per_slot = boxes
    for j in range(per_tile):
        cute.copy(tma, t_g[None, tile * per_tile + j, k], t_s[None, slot * per_slot + j], tma_bar_ptr=bar,
                  cache_policy=policy)


class WgmmaGemm:
    """The kernel for one tactic and one static problem (N, K, row strides); M is a runtime value."""

    def __init__(
        self, tactic: WgmmaTactic, n: int, k: int, x_row_stride: int, w_row_stride: int, link: Link = NO_LINK
    ) -> None:
        if link != NO_LINK:
            raise ValueError(f"the wgmma kernel takes no part in the single-stream side chain, got {link}")
        reason = validate_wgmma_tactic(tactic, n, k, x_row_stride)
        if reason is not None:
            raise ValueError(reason)
        if w_row_stride % ELEMS_PER_COPY:
            raise ValueError(f"w row stride {w_row_stride} must be a multiple of {ELEMS_PER_COPY} elements (TMA)")
        self.tactic, self.link = tactic, link
        self.n, self.k = n, k
        self.partial = bool(n % tactic.block_n)  # the last row block holds rows past N (zero-filled, never stored)
        self.x_row_stride, self.w_row_stride = x_row_stride, w_row_stride

    def _check_roles(self, **operands) -> None:
        """At compile time: the split-K operands are given exactly where the tactic splits, and no chain operands
        (a ``None`` compiles as a constant, so a stray operand would be ignored silently)."""
        t = self.tactic
        used = {"m_work": t.uses_workspace, "m_arrivals": t.uses_workspace, "m_chain": False, "expected": False}
        check_optional_operands(f"tactic {t.key()}", used, operands)
        unused = [name for name, value in operands.items() if not used[name] and value is not None]
        if unused:
            raise ValueError(f"{', '.join(unused)} not used by tactic {t.key()}: pass None")

    def _operand_layouts(self, dtype):
        """``(tiled_mma, s_w_layout, s_x_layout, x_box, s_x_box_layout)``: the MMA and the ring's shared-memory
        layouts of both operands, the activations' TMA box and the ring as those boxes fill it."""
        t = self.tactic
        # Both operands K-major. Swap-AB: weights as wgmma's A (M = rows), activations as its B (N = tokens);
        # tokens_on_m: the other way round.
        mma_n = t.block_n if t.tokens_on_m else t.block_t
        tiled_mma = hopper_helpers.make_trivial_tiled_mma(
            dtype, dtype, OperandMajorMode.K, OperandMajorMode.K, cutlass.Float32,
            (t.consumer_warpgroups, 1, 1), tiler_mn=(ATOM_ROWS, mma_n),
        )
        if cutlass.const_expr(t.tokens_on_m):
            tile_mnk = (t.mma_tokens, t.block_n, t.block_k)
            s_x_layout = hopper_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, t.stages)
            s_w_layout = hopper_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, t.stages)
            # The same ring as boxes of 8 tokens: box j of slot s is rows 8j .. 8j + 7 of that slot's tile.
            x_box = (BOX_ROWS, t.block_k)
            s_x_box_layout = hopper_helpers.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (BOX_ROWS, t.block_n, t.block_k), dtype,
                t.stages * t.mma_tokens // BOX_ROWS,
            )
        else:
            tile_mnk = (t.mma_rows, t.block_t, t.block_k)
            s_w_layout = hopper_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, t.stages)
            s_x_layout = hopper_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, t.stages)
            x_box, s_x_box_layout = (t.block_t, t.block_k), s_x_layout
        return tiled_mma, s_w_layout, s_x_layout, x_box, s_x_box_layout

    def _w_boxes(self, dtype, s_w_layout):
        """``(w_box, s_w_box_layout)``: the weights' TMA box and the ring as those boxes fill it: one box per tile
        (``s_w_layout``, the weight ring's layout, itself), or where :attr:`WgmmaTactic.padded_rows` boxes of 8 rows,
        box j of slot s rows 8j .. 8j + 7 of that slot's 64-row tile (one 128-byte swizzle atom each); in a weight
        cluster of c CTAs boxes of ``block_n / c`` rows, box j of slot s the tile's j-th share (whole swizzle atoms,
        so the boxes lie in the tile exactly as its rows do)."""
        t = self.tactic
        if t.padded_rows:
            return (BOX_ROWS, t.block_k), hopper_helpers.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (BOX_ROWS, t.block_t, t.block_k), dtype,
                t.stages * t.mma_rows // BOX_ROWS,
            )
        if t.weight_cluster > 1:
            share = t.block_n // t.weight_cluster
            return (share, t.block_k), hopper_helpers.make_smem_layout_b(
                LayoutEnum.ROW_MAJOR, (t.mma_tokens, share, t.block_k), dtype, t.stages * t.weight_cluster,
            )
        return (t.block_n, t.block_k), s_w_layout

    def _operands(self, m_w: cute.Tensor, m_x: cute.Tensor):
        """``(w_tma, w_src, x_tma, x_src, s_w_layout, s_x_layout, s_x_box_layout, tiled_mma)``: the TMA atoms and
        coordinate tensors over ``m_w`` and ``m_x``, the ring layouts and the MMA. The tensor maps are encoded per
        call from the tensors, so x's covers this call's M (rows past it read as 0)."""
        tiled_mma, s_w_layout, s_x_layout, x_box, s_x_box_layout = self._operand_layouts(m_w.element_type)
        w_box, s_w_box_layout = self._w_boxes(m_w.element_type, s_w_layout)
        # In a weight cluster each share is one multicast into every CTA of it (the atom itself does not split it).
        t = self.tactic
        w_op = cpasync.CopyBulkTensorTileG2SMulticastOp() if t.weight_cluster > 1 else cpasync.CopyBulkTensorTileG2SOp()
        w_tma, w_src = cpasync.make_tiled_tma_atom(w_op, m_w, s_w_box_layout, w_box)
        x_tma, x_src = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m_x, s_x_box_layout, x_box)
        return w_tma, w_src, x_tma, x_src, s_w_layout, s_x_layout, s_x_box_layout, tiled_mma

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
        """``out = x @ w.T``: ``m_x`` (M, K), ``m_w`` (N, K), ``m_out`` (M, N) contiguous, all bf16. With split-K,
        ``m_work`` the fp32 workspace of :meth:`WgmmaTactic.workspace_shape`, contiguous, and
        ``m_arrivals`` int32 arrival counters (one per output tile, :func:`wgmma_output_tiles`), zero on entry and
        left zero on exit; else both ``None``. ``m_chain`` and ``expected`` are always ``None`` (no side-chain
        role), kept for :meth:`~kda_backend.kernels.skinny_gemm.SkinnyGemm.__call__`'s signature."""
        self._check_roles(m_work=m_work, m_arrivals=m_arrivals, m_chain=m_chain, expected=expected)
        t = self.tactic
        w_tma, w_src, x_tma, x_src, s_w_layout, s_x_layout, s_x_box_layout, tiled_mma = self._operands(m_w, m_x)
        # The kernel works on the swap-AB views: out transposed (N, M) and the split-K workspace as (N, M, split_k).
        m_out_t = cute.make_tensor(m_out.iterator, cute.select(m_out.layout, mode=[1, 0]))
        if cutlass.const_expr(m_work is not None):
            m_work = cute.make_tensor(m_work.iterator, cute.select(m_work.layout, mode=[2, 1, 0]))
        # A weight cluster's token tiles come in whole clusters: tiles past M load no real token and store nothing.
        token_tiles = cute.ceil_div(cute.ceil_div(m_x.shape[0], t.block_t), t.weight_cluster) * t.weight_cluster
        grid = (row_blocks(self.n, t.block_n), token_tiles, t.split_k)
        cluster = None
        if cutlass.const_expr(t.in_cluster):
            cluster = [1, 1, t.split_k]
        elif cutlass.const_expr(t.weight_cluster > 1):
            cluster = [1, t.weight_cluster, 1]
        self.kernel(
            w_tma, w_src, x_tma, x_src, m_out_t, m_work, m_arrivals, s_w_layout, s_x_layout, s_x_box_layout,
            tiled_mma,
        ).launch(grid=grid, block=[t.threads, 1, 1], cluster=cluster, smem=t.smem_bytes(), stream=stream,
                 use_pdl=t.pdl)

    @cute.kernel
    def kernel(
        self,
        w_tma: cute.CopyAtom,
        w_src: cute.Tensor,
        x_tma: cute.CopyAtom,
        x_src: cute.Tensor,
        m_out_t: cute.Tensor,
        m_work: cute.Tensor | None,
        m_arrivals: cute.Tensor | None,
        s_w_layout: cute.ComposedLayout,
        s_x_layout: cute.ComposedLayout,
        s_x_box_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
    ):
        """``w_tma`` / ``w_src`` and ``x_tma`` / ``x_src``: the TMA atoms and their coordinate tensors over w (N, K)
        and x (M, K); ``m_out_t`` (N, M): out transposed; ``m_work`` (N, M, split_k): the split-K workspace, or
        ``None`` as ``m_arrivals``; ``s_x_box_layout``: the activation ring as the TMA boxes fill it (``s_x_layout``
        itself under swap-AB). Warps
        ``0 .. 4 * consumer_warpgroups - 1`` consume, the last one produces."""
        tidx, _, _ = cute.arch.thread_idx()
        warp = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        bidx, bidy, bidz = cute.arch.block_idx()
        dtype = m_out_t.element_type

        mainloop, s_w, s_x, s_x_box, ring, s_last = self._ring(dtype, s_w_layout, s_x_layout, s_x_box_layout)
        self._tile_per_cta(mainloop, w_tma, w_src, x_tma, x_src, s_w, s_x, s_x_box, ring, m_out_t, m_work,
                           m_arrivals, s_last, tiled_mma, warp, tidx, bidx, bidy, bidz)

    def _ring(self, dtype, s_w_layout, s_x_layout, s_x_box_layout):
        """Shared memory of one CTA: ``(mainloop, s_w, s_x, s_x_box, ring, s_last)``: the ring's pipeline, its
        operand views, the ring's start (the output tile is staged there once it drained) and split-K's flag
        (``None`` without a workspace)."""
        t = self.tactic
        smem = cutlass.memory.SmemAllocator()
        barriers = smem.allocate_array(cutlass.Int64, 2 * t.stages, byte_alignment=8)
        s_last = None
        if cutlass.const_expr(t.uses_workspace):
            s_last = smem.allocate_tensor(cutlass.Int32, cute.make_layout(1), SPLIT_K_FLAG_BYTES)
        ring = smem.allocate_array(dtype, self.ring_elems(s_w_layout, s_x_layout), byte_alignment=SWIZZLE_ATOM_BYTES)
        mainloop, s_w, s_x, s_x_box = self._pipeline_on(barriers, ring, dtype, s_w_layout, s_x_layout, s_x_box_layout)
        return mainloop, s_w, s_x, s_x_box, ring, s_last

    @staticmethod
    def ring_elems(s_w_layout, s_x_layout) -> int:
        """Elements of the ring: every slot's weight tiles, then every slot's activation tiles."""
        return cute.cosize(s_w_layout.outer) + cute.cosize(s_x_layout.outer)

    def _pipeline_on(self, barriers, ring, dtype, s_w_layout, s_x_layout, s_x_box_layout):
        """``(mainloop, s_w, s_x, s_x_box)``: the ring's pipeline over ``2 * stages`` mbarriers at ``barriers``
        (initialized here, with a sync of the whole CTA) and its operand views over the ring at ``ring``."""
        t = self.tactic
        w_elems = cute.cosize(s_w_layout.outer)
        s_w = cute.make_tensor(cute.recast_ptr(ring, s_w_layout.inner, dtype=dtype), s_w_layout.outer)
        s_x = cute.make_tensor(cute.recast_ptr(ring + w_elems, s_x_layout.inner, dtype=dtype), s_x_layout.outer)
        s_x_box = cute.make_tensor(cute.recast_ptr(ring + w_elems, s_x_box_layout.inner, dtype=dtype),
                                   s_x_box_layout.outer)

        # One arrive per consumer warp frees a slot (PipelineTmaAsync signals from each warp's first lane); in a
        # weight cluster lane r of every consumer warp arrives on CTA r's barrier, so a slot is free once the
        # consumers of every CTA the producers multicast into have freed it. create() syncs the cluster after
        # initialising the barriers, before any multicast can land.
        cluster = t.weight_cluster
        mainloop = pipeline.PipelineTmaAsync.create(
            barrier_storage=barriers,
            num_stages=t.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, cluster * t.consumer_threads // 32),
            tx_count=t.stage_bytes(),
            cta_layout_vmnk=cute.make_layout((1, 1, cluster, 1)),
            mcast_mode_mn=(1, 0) if cluster > 1 else (1, 1),
        )
        return mainloop, s_w, s_x, s_x_box

    @cute.jit
    def _tile_per_cta(self, mainloop, w_tma, w_src, x_tma, x_src, s_w, s_x, s_x_box, ring, m_out_t, m_work,
                      m_arrivals, s_last, tiled_mma, warp, tidx, bidx, bidy, bidz):
        """One output tile (row block ``bidx``, token tile ``bidy``) and K-split ``bidz`` per CTA."""
        t = self.tactic
        m_tokens = m_out_t.shape[1]
        k_tiles = self.k // t.block_k // t.split_k
        k_first = bidz * k_tiles  # this CTA's K-tiles: [k_first, k_first + k_tiles)
        s_w_box = s_w
        if cutlass.const_expr(t.padded_rows or t.weight_cluster > 1):  # the weight ring as its boxes fill it
            _, s_w_box_layout = self._w_boxes(m_out_t.element_type, None)
            s_w_box = cute.make_tensor(cute.recast_ptr(ring, s_w_box_layout.inner, dtype=m_out_t.element_type),
                                       s_w_box_layout.outer)
        # (TMA, k_tiles of K) global and (TMA, stages) shared views of each operand.
        t_sw, t_gw, t_sx, t_gx = self._tma_views(w_tma, w_src, x_tma, x_src, s_w_box, s_x_box, bidx, bidy)

        if warp == t.consumer_threads // 32:
            self._produce(mainloop, w_tma, t_gw, t_sw, x_tma, t_gx, t_sx, bidx, bidy, k_first, k_tiles)
            if cutlass.const_expr(t.in_cluster):
                # The cluster barriers count every thread: the producer waits out both, see _reduce_in_cluster.
                self._cluster_sync()
                self._cluster_sync()
        else:
            # The consumers never release the next launch: a CTA's first launch_dependents is the one that counts,
            # and it must come after the producer's wait for x (a side chain launched behind QKVG with x_ready loads
            # x without waiting, see skinny_gemm.Link).
            g_o = cute.local_tile(m_out_t, (t.block_n, t.block_t), (bidx, bidy))
            c_o = cute.local_tile(cute.make_identity_tensor(m_out_t.shape), (t.block_n, t.block_t), (bidx, bidy))
            # The MMAs' (rows, tokens) tile, staged in the drained ring on its way out.
            s_o = cute.make_tensor(ring, cute.make_layout((t.mma_rows, t.mma_tokens), stride=(1, t.staging_stride())))
            thr_mma = tiled_mma.get_slice(tidx)
            acc = self._consume(mainloop, tiled_mma, thr_mma, s_w, s_x, s_o, k_tiles)
            if cutlass.const_expr(t.in_cluster):
                self._reduce_in_cluster(acc, thr_mma, ring, g_o, c_o, m_tokens, tidx, bidz)
            elif cutlass.const_expr(t.split_k > 1):
                self._reduce_split_k(acc, thr_mma, thr_mma.partition_C(c_o), m_tokens, m_work, m_arrivals, s_last,
                                     bidx, bidy, bidz, tidx)
                # Only the CTA that arrived last holds the full sum; the others are done.
                if s_last[0] == t.split_k - 1:
                    self._store_tile(acc, thr_mma, s_o, g_o, c_o, m_tokens, tidx)
            else:
                self._store_tile(acc, thr_mma, s_o, g_o, c_o, m_tokens, tidx)

    def _tma_views(self, w_tma, w_src, x_tma, x_src, s_w, s_x_box, row_block, token_tile):
        """The TMA partitions ``(t_sw, t_gw, t_sx, t_gx)`` of the weight and activation tiles: the shared ring's
        (TMA, stages) and the global tiles' (TMA, K-tiles) of row block ``row_block`` and token tile
        ``token_tile``; with ``tokens_on_m`` the activations' as (TMA, boxes of all stages) and (TMA, boxes of all
        tokens, K-tiles)."""
        t = self.tactic
        if cutlass.const_expr(t.padded_rows):
            g_w = cute.local_tile(w_src, (BOX_ROWS, t.block_k), (None, None))
        elif cutlass.const_expr(t.weight_cluster > 1):
            g_w = cute.local_tile(w_src, (t.block_n // t.weight_cluster, t.block_k), (None, None))
        else:
            g_w = cute.local_tile(w_src, (t.block_n, t.block_k), (row_block, None))
        if cutlass.const_expr(t.tokens_on_m):
            g_x = cute.local_tile(x_src, (BOX_ROWS, t.block_k), (None, None))
        else:
            g_x = cute.local_tile(x_src, (t.block_t, t.block_k), (token_tile, None))
        t_sw, t_gw = cpasync.tma_partition(
            w_tma, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2), cute.group_modes(g_w, 0, 2)
        )
        t_sx, t_gx = cpasync.tma_partition(
            x_tma, 0, cute.make_layout(1), cute.group_modes(s_x_box, 0, 2), cute.group_modes(g_x, 0, 2)
        )
        return t_sw, t_gw, t_sx, t_gx

    @cute.jit
    def _produce(self, mainloop, w_tma, t_gw, t_sw, x_tma, t_gx, t_sx, row_block, token_tile, k_first,
                 k_tiles: cutlass.Constexpr[int]):
        """The producer warp: fill the ring with this CTA's K-tiles in order, each slot once its consumers freed it
        (in a weight cluster: the consumers of every CTA of it). The TMA copies elect their issuing lane themselves;
        the whole warp runs this."""
        t = self.tactic
        cpasync.prefetch_descriptor(w_tma)
        cpasync.prefetch_descriptor(x_tma)
        w_policy, x_policy = l2_policy(EVICT_FIRST), l2_policy(EVICT_LAST)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
        prologue = min(t.stages, k_tiles)
        # Weights need nothing from the previous kernel: the ring's first tiles start before the PDL wait. Each
        # slot's barrier expects both tiles' bytes, so it completes once the activations land too.
        for s in cutlass.range_constexpr(prologue):
            mainloop.producer_acquire(state)  # the ring starts empty: no wait
            self._load_w(w_tma, t_gw, t_sw, row_block, token_tile, k_first + s, s, mainloop.producer_get_barrier(state),
                         w_policy)
            state.advance()
        if cutlass.const_expr(t.pdl):
            cute.arch.griddepcontrol_wait()
            # The CTA releases the next kernel here, once x is complete: its weight prologue overlaps our tail.
            cute.arch.griddepcontrol_launch_dependents()
        for s in cutlass.range_constexpr(prologue):
            self._load_x(x_tma, t_gx, t_sx, token_tile, k_first + s, s, mainloop.sync_object_full.get_barrier(s),
                         x_policy)
        for k in cutlass.range(prologue, k_tiles, unroll=1):
            mainloop.producer_acquire(state)
            bar = mainloop.producer_get_barrier(state)
            self._load_w(w_tma, t_gw, t_sw, row_block, token_tile, k_first + k, state.index, bar, w_policy)
            self._load_x(x_tma, t_gx, t_sx, token_tile, k_first + k, state.index, bar, x_policy)
            state.advance()
        if cutlass.const_expr(t.weight_cluster > 1):
            # The CTA stays until the cluster's consumers freed its slots: they arrive on its barriers remotely.
            mainloop.producer_tail(state)

    def _load_w(self, w_tma, t_gw, t_sw, row_block, token_tile, k, slot, bar, policy) -> None:
        """Start the weight tile's TMA load of K-tile ``k`` into ring slot ``slot``: one box, or where
        :attr:`WgmmaTactic.padded_rows` one box per 8 of the row block's rows; in a weight cluster the share of the
        CTA's rank (its token tile's place in the cluster), multicast into every CTA of the cluster."""
        t = self.tactic
        if cutlass.const_expr(t.weight_cluster > 1):
            rank = token_tile % t.weight_cluster  # the cluster runs along the token tiles (grid y)
            everyone = cutlass.Int16((1 << t.weight_cluster) - 1)
            cute.copy(w_tma, t_gw[None, row_block * t.weight_cluster + rank, k],
                      t_sw[None, slot * t.weight_cluster + rank], tma_bar_ptr=bar, mcast_mask=everyone,
                      cache_policy=policy)
            return
        boxes = (t.block_n // BOX_ROWS, t.mma_rows // BOX_ROWS) if t.padded_rows else None
        _load_tile(w_tma, t_gw, t_sw, row_block, k, slot, bar, policy, boxes)

    def _load_x(self, x_tma, t_gx, t_sx, token_tile, k, slot, bar, policy) -> None:
        """Start the activation tile's TMA load of K-tile ``k`` into ring slot ``slot``: one box, or with
        ``tokens_on_m`` one box per 8 of the tile's tokens (the MMA's padding tokens stay unloaded)."""
        t = self.tactic
        boxes = (t.block_t // BOX_ROWS, t.mma_tokens // BOX_ROWS) if t.tokens_on_m else None
        _load_tile(x_tma, t_gx, t_sx, token_tile, k, slot, bar, policy, boxes)

    @cute.jit
    def _consume(self, mainloop, tiled_mma, thr_mma, s_w, s_x, s_o, k_tiles: cutlass.Constexpr[int]) -> cute.Tensor:
        """The consumer warpgroups: accumulate this CTA's K-tiles, one K-tile of MMAs in flight; each slot is freed
        once the MMAs reading it completed. Returns the fp32 accumulator fragment of the (rows, tokens) tile ``s_o``
        (block_n, mma_tokens)."""
        t = self.tactic
        s_a, s_b = (s_x, s_w) if t.tokens_on_m else (s_w, s_x)
        t_ra = tiled_mma.make_fragment_A(thr_mma.partition_A(s_a))
        t_rb = tiled_mma.make_fragment_B(thr_mma.partition_B(s_b))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(self._mma_view(s_o)).shape, cutlass.Float32)
        acc.fill(0.0)
        tiled_mma.set(warpgroup.Field.ACCUMULATE, True)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        self._mma_tile(mainloop, tiled_mma, acc, t_ra, t_rb, read)
        read.advance()
        for _ in cutlass.range(1, k_tiles, unroll=1):
            self._mma_tile(mainloop, tiled_mma, acc, t_ra, t_rb, read)
            read.advance()
            # The K-tile before this one is done: its slot may be refilled.
            warpgroup.wait_group(1)
            mainloop.consumer_release(release)
            release.advance()
        warpgroup.wait_group(0)
        if cutlass.const_expr(t.weight_cluster > 1):
            mainloop.consumer_release(release)  # the cluster's producers wait for every slot before they exit
        return acc

    @cute.jit
    def _mma_tile(self, mainloop, tiled_mma, acc, t_ra, t_rb, read):
        """Wait for the ring slot ``read`` and issue its MMAs (one commit group)."""
        mainloop.consumer_wait(read)
        warpgroup.fence()
        for kb in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
            cute.gemm(tiled_mma, acc, t_ra[None, None, kb, read.index], t_rb[None, None, kb, read.index], acc)
        warpgroup.commit_group()

    def _mma_view(self, tile: cute.Tensor) -> cute.Tensor:
        """A (rows, tokens) tile as the MMA's C sees it: itself under swap-AB, transposed with ``tokens_on_m``.
        The output and staging tiles keep (rows, tokens) order in both forms; only the MMA partitions differ."""
        if self.tactic.tokens_on_m:
            return cute.make_tensor(tile.iterator, cute.select(tile.layout, mode=[1, 0]))
        return tile

    def _cluster_sync(self) -> None:
        """Barrier of every thread of the cluster's CTAs: shared-memory writes before it (release) are visible to
        every CTA of the cluster after it (acquire)."""
        cute.arch.cluster_arrive()
        cute.arch.cluster_wait()

    @cute.jit
    def _reduce_in_cluster(self, acc, thr_mma, ring, g_o, c_o, m_tokens, tidx, rank):
        """In-cluster split-K: stage this CTA's fp32 partial (the MMA's whole tile, token-major) in its drained ring;
        once every split's is there, sum share ``rank`` of the tile's 8-row vectors from every CTA's ring in split
        order (as :meth:`_reduce_split_k` does) and store them as bf16. Only real tokens' and rows' vectors are read
        and stored. The second cluster barrier keeps every ring alive until the whole cluster has read it."""
        t = self.tactic
        self._consumers_sync()  # every consumer's MMAs have completed: the ring is free
        s_p = cute.make_tensor(cute.recast_ptr(ring, dtype=cutlass.Float32),
                               cute.make_layout((t.mma_rows, t.mma_tokens), stride=(1, t.mma_rows)))
        thr_mma.partition_C(s_p).store(acc.load())
        self._cluster_sync()
        vec = (ELEMS_PER_COPY, 1)
        v_g, v_c = cute.zipped_divide(g_o, vec), cute.zipped_divide(c_o, vec)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), g_o.element_type, num_bits_per_copy=COPY_BITS)
        row_vectors = t.block_n // ELEMS_PER_COPY
        vectors = row_vectors * t.block_t  # vector i: rows 8 (i % row_vectors) .. + 7 of token i // row_vectors
        share = -(-vectors // t.split_k)
        total = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), cutlass.Float32)
        out = cute.make_rmem_tensor(cute.make_layout(ELEMS_PER_COPY), g_o.element_type)
        for j in cutlass.range_constexpr(-(-share // t.consumer_threads)):
            v = j * t.consumer_threads + tidx
            i = rank * share + v
            if v < share and i < vectors:
                if self._in_bounds(v_c[(0, i)], m_tokens):
                    # Every split's loads are issued before the first add: one wait for the cluster, not split_k.
                    base = s_p.iterator + (i % row_vectors) * ELEMS_PER_COPY + (i // row_vectors) * t.mma_rows
                    parts = [load_peer_f32x4(base, split) + load_peer_f32x4(base + VECTOR_FLOATS, split)
                             for split in range(t.split_k)]
                    for e in cutlass.range_constexpr(ELEMS_PER_COPY):
                        value = parts[0][e]
                        for split in cutlass.range_constexpr(1, t.split_k):
                            value = value + parts[split][e]
                        total[e] = value
                    out.store(total.load().to(g_o.element_type))
                    cute.copy(store, out, v_g[(None, i)])
        self._cluster_sync()

    def _consumers_sync(self) -> None:
        """Barrier of the consumer warpgroups only (the producer warp may have exited)."""
        cute.arch.barrier(barrier_id=CONSUMER_BARRIER, number_of_threads=self.tactic.consumer_threads)

    def _in_bounds(self, coord, m_tokens):
        """Whether the output element at ``coord`` (row, token) exists; rows are checked only where the last row
        block is partial (a static property)."""
        if self.partial:
            return cute.elem_less(coord, (self.n, m_tokens))
        return cute.elem_less(coord[1], m_tokens)

    @cute.jit
    def _store_tile(self, acc, thr_mma, s_o, g_o, c_o, m_tokens, tidx):
        """Write the accumulator as bf16, real rows and tokens only. The fragment holds scattered 2-byte elements
        (neighbouring rows belong to other threads), so it is staged token-major in the drained ring (``s_o``) and
        leaves as 16-byte runs of one token's rows."""
        t = self.tactic
        # Every consumer's MMAs have completed (and with them the last TMA writes): the ring is free.
        self._consumers_sync()
        t_so = thr_mma.partition_C(self._mma_view(s_o))
        t_so.store(acc.load().to(s_o.element_type))
        self._consumers_sync()
        if cutlass.const_expr(t.tokens_on_m or t.padded_rows):
            s_o = cute.local_tile(s_o, (t.block_n, t.block_t), (0, 0))  # the tile's rows and tokens, not the padding
        vec = (ELEMS_PER_COPY, 1)
        v_s, v_g, v_c = cute.zipped_divide(s_o, vec), cute.zipped_divide(g_o, vec), cute.zipped_divide(c_o, vec)
        store = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), s_o.element_type, num_bits_per_copy=COPY_BITS)
        vectors = t.block_n * t.block_t // ELEMS_PER_COPY
        for j in cutlass.range_constexpr(-(-vectors // t.consumer_threads)):
            i = j * t.consumer_threads + tidx
            if i < vectors and self._in_bounds(v_c[(0, i)], m_tokens):
                cute.copy(store, v_s[(None, i)], v_g[(None, i)])

    @cute.jit
    def _reduce_split_k(self, acc, thr_mma, t_co, m_tokens, m_work, m_arrivals, s_last, bidx, bidy, bidz, tidx):
        """Publish this CTA's partial and count it in; in the CTA that arrives last, replace ``acc`` with the sum
        of every split's partial, in split order (``s_last[0] == split_k - 1`` there). Only real tokens' and rows'
        partials are written and read."""
        t = self.tactic
        tile_shape = (t.block_n, t.block_t)
        t_gp = thr_mma.partition_C(cute.local_tile(m_work[None, None, bidz], tile_shape, (bidx, bidy)))
        for i in cutlass.range_constexpr(cute.size(acc)):
            if self._in_bounds(t_co[i], m_tokens):
                t_gp[i] = acc[i]
        # Release: every thread's partial is visible device-wide before thread 0 counts the CTA in.
        cute.arch.fence_acq_rel_gpu()
        self._consumers_sync()
        tile = bidy * row_blocks(self.n, t.block_n) + bidx
        if tidx == 0:
            s_last[0] = cute.arch.atomic_add(m_arrivals.iterator + tile, cutlass.Int32(1), sem="acq_rel", scope="gpu")
        self._consumers_sync()
        if s_last[0] == t.split_k - 1:
            cute.arch.fence_acq_rel_gpu()
            # Loads of a chunk of elements from every split are issued before the first add, so the last CTA waits
            # for L2 about once per chunk, not per split; chunks bound the registers they hold. L2 loads (.cg): this
            # SM's L1 may hold a stale copy of a line another CTA wrote since.
            partials = [
                thr_mma.partition_C(cute.local_tile(m_work[None, None, s], tile_shape, (bidx, bidy)))
                for s in range(t.split_k)
            ]
            chunk = max(1, REDUCE_REGISTERS // t.split_k)
            size = cute.size(acc)
            for first in cutlass.range_constexpr(0, size, chunk):
                parts = []
                for t_gs in partials:
                    part = []
                    for i in cutlass.range_constexpr(first, min(first + chunk, size)):
                        value = cutlass.Float32(0.0)
                        if self._in_bounds(t_co[i], m_tokens):
                            value = cute.arch.load(
                                t_gs.iterator + cute.crd2idx(i, t_gs.layout), cutlass.Float32, cop="cg"
                            )
                        part.append(value)
                    parts.append(part)
                for j in cutlass.range_constexpr(len(parts[0])):
                    total = parts[0][j]
                    for s in cutlass.range_constexpr(1, t.split_k):
                        total = total + parts[s][j]
                    acc[first + j] = total
            if tidx == 0:
                # Stream order makes the reset visible to the next kernel that uses these counters.
                m_arrivals[tile] = 0
