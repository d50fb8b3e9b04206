"""The fused stage: the whole projection stage in one Hopper launch, QKVG on most SMs and the side chain (F_A/beta,
then F_B) on the SMs QKVG leaves free, all as ``wgmma`` tiles of one grid. No fork and no second launch: the same
schedule, and the same bits, on every host, eager or in any graph mode.

Three forms, by QKVG's tactic; F_A/beta and F_B take QKVG's form and token tile (beside a weight cluster: swap-AB
over the cluster's tokens), so every CTA runs as many consumer warpgroups as QKVG's:

- tokens on the MMA's M side (:attr:`WgmmaTactic.tokens_on_m`), up to 64 tokens in one consumer warpgroup, or up to
  :data:`WIDE_TOKENS_ON_M_MAX_M` in two where QKVG's CTAs own 64 rows or more (Kimi-K3 TP 4: 96): F_B in at least
  :data:`FB_PASSES` row blocks of up to 256 rows (the MMA's N), one after another, each its own pipeline over one
  shared ring; in two consumer warpgroups F_B runs instead as a tail on QKVG's CTAs: each, after its QKVG tile,
  waits for F_A/beta like a side-chain CTA and computes one row block of F_B (Kimi-K3 TP 4: 24 rows on each of
  128 CTAs);
- swap-AB with rows below the 64-row atom (:attr:`WgmmaTactic.padded_rows`), any token tile up to 256 (the MMA's
  N), served from 65 to :data:`FUSED_MAX_M` tokens, above :data:`PADDED_ROWS_NARROW_MAX_M` tokens with QKVG's CTAs 8
  rows wider than tokens on M would take (:data:`PADDED_ROWS_WIDER`): where the SMs they leave hold them, F_A/beta's
  row blocks split along K over pairs of side-chain CTAs in thread-block clusters (:func:`split_side_chain`), then F_B
  in 64-row passes over a resident f_a tile: f_a and every pass's W_fb tiles load at once, one mbarrier per pass,
  and the passes' MMAs run as their tiles land;
- tokens on M with the two token tiles of each row block sharing every weight tile in a cluster
  (:attr:`WgmmaTactic.weight_cluster`, one consumer warpgroup each): the side chain then runs swap-AB over both tiles'
  tokens, as above, split in pairs where the SMs QKVG leaves hold them (110 CTAs of 112 rows leave 22 at TP 8). Not
  served by :func:`fused_stage_tactic`: on six H100s it ran within 0.2 us of the 56-row swap-AB form at M = 80..112
  (once 0.58 slower) and mostly up to 0.53 us faster at 120 / 128, twice slower (by up to 0.87; benchmarks/RESULTS.md,
  levers); not measured on H200. Its QKVG runs up to 1.0 us faster than the served form's in the stage's grid, but the
  side chain beside it costs 1.4 us at 128 tokens against 0.55-0.8 beside the served form (two H100s), and fewer
  side-chain CTAs or a later start lower that by 0.06 us at most.

- Grid: ``side`` side-chain CTAs (block indices ``0 .. side - 1``, dispatched first), then QKVG's row blocks of
  the stage's tactic, one CTA each (with a weight cluster one per token tile, in a cluster); ``side`` is what QKVG
  leaves of the SMs (4 of 132 for Kimi-K3 TP 8: 128 QKVG CTAs of 48 rows), or with F_A/beta split the pairs
  :func:`split_side_chain` places there (12 of the 22 that 110 CTAs of 56 rows leave). One token tile (a weight
  cluster's tiles): M up to the tactic's ``block_t`` (times the cluster).
- Side-chain CTA ``i`` first asks L2 for its W_fb tiles (TMA prefetch), then computes F_A/beta's row block ``i``
  (``ceil(fab_rows / side)`` rows, fewer than a QKVG CTA's, in the deepest ring an SM holds, so it finishes first;
  split, row block ``i // 2`` over half of K with its cluster peer ``i ^ 1``, the two summing it together),
  counts it in on ``chain[0]`` (release), waits until every side-chain CTA counted in, then computes its share of
  ``g1 = f_a @ W_fb^T``'s rows for every token: f_a (F_A/beta's first ``d`` columns,
  written by the side-chain CTAs) and W_fb arrive by TMA like any operand. The time QKVG's larger row blocks take
  beyond F_A/beta's covers F_B.
- The side-chain CTAs wait only for each other, and they are dispatched before QKVG's: the launch cannot deadlock
  (with F_B's tail, QKVG's CTAs wait for side-chain CTAs already resident, which wait for nothing). The last CTA
  past the wait resets both counters (``chain[1]`` counts them past it), so the stream's next launch finds them
  zero.
- Every tile is one CTA's, accumulated in a fixed order: bitwise deterministic.
"""

from __future__ import annotations

import dataclasses

import cutlass
import cutlass.cute as cute
import cutlass.memory
from cutlass.cute.nvgpu import cpasync, warpgroup
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils import hopper_helpers

from kda_backend.kernels.l2_cache_policy import EVICT_FIRST, EVICT_LAST, l2_policy
from kda_backend.kernels.skinny_gemm import MAX_SMEM_BYTES, row_blocks
from kda_backend.kernels.wgmma_gemm import (
    ATOM_ROWS,
    CLUSTER_SPLIT_K,
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
# Tokens-on-M QKVG serves up to 64 tokens: above, its 48-row CTAs need a second consumer warpgroup and fall behind
# (M = 96: 27.9 us alone against the floor's 20.9; the fused stage with them 34.3-34.8 us). Swap-AB CTAs serve above,
# PADDED_ROWS_WIDER rows wider, in the ring PADDED_ROWS_STAGES gives their token tile. With 48-row CTAs the 4 SMs left
# hold F_A/beta only over all of K, which keeps their tensor cores busy about as long as QKVG's (split_side_chain), so
# F_B ends after QKVG; 56-row CTAs (110 at TP 8) leave 22. Measured on H200 for Kimi-K3 TP 8 (qkvg_tactics.py,
# benchmarks/results/levers/fused-stage-split-side-chain/): the stage took 23.67 / 24.87 / 25.46 / 27.19 us at
# M = 72 / 96 / 104 / 128 with 56-row CTAs in 9 slots (24.21 / 25.27 / 25.85 / 27.80 in 8), QKVG alone 23.67 / 24.76
# / 25.32 / 27.22, against 24.04 / 26.97 / 29.05 / 33.26 with 48-row CTAs in 8 slots (alone 23.30 / 24.07 / 24.67 /
# 26.30). Above 128 tokens the same form stays ahead of sequential cuBLAS in the deepest ring that fits each token tile
# (benchmarks/results/levers/fused-stage-above-128/): the stage took 28.33 / 29.66 us at M = 136 / 152 in 8 slots
# (29.09 / 30.68 in 7) and 31.69 at 160 in 7 (33.02 in 6), where sequential cuBLAS took 31.34 / 33.23 / 32.67 in a
# `bench` on the same H200; 32.44 / 33.95 at 176 / 192 in 7 slots and 38.26 at 224 in 6, against sequential
# cuBLAS's 41.52 / 39.03 / 46.03 and the plan's 35.44 / 36.63 / 39.46 in another H200's `bench`
# (benchmarks/results/h200-large-m/tp8-token-tiles/). The stage stops at 224 tokens: with 256-token tiles in 5 slots it
# took 42.01 / 42.27 / 43.67 us at M = 232 / 240 / 256 against sequential cuBLAS's 43.99 / 41.14 / 39.50 on the same
# H200 (benchmarks/results/levers/fused-stage-256/), never past the autotuner's 5 % margin.
TOKENS_ON_M_MAX_M = 64
# QKVG CTAs of 64 rows or more (Kimi-K3 TP 4: 96) take tokens on M in two consumer warpgroups up to 128 tokens: each
# activation byte feeds twice the rows of TP 8's 48-row CTAs. QKVG alone, H200, TP 4 (qkvg_tactics.py --tp 4,
# benchmarks/results/levers/fused-stage-tp4/qkvg-alone.log): 42.67 / 43.92 / 46.46 us at M = 72 / 96 / 128 with 7
# slots (1.02-1.11x its floor), 42.75-44.49 with 6 or 8, against cuBLAS's 45.96 / 45.45 / 45.56 and 49.28 / 50.33 for
# swap-AB CTAs of 128 rows at M = 72 / 96. The fused stage on H100 (rings-h100.log beside it): 63.72-67.22 us at
# M = 72..128 with 7 slots, 64.73-67.42 with 6, 67.23-70.91 with 8. On H200 its side chain finishes after QKVG above
# 64 tokens when F_B's passes run there one after another: they add 7-8 us after F_A/beta
# (levers/fused-stage-tp4/f-b-cost.log). Above 64 tokens F_B therefore runs as a tail on QKVG's CTAs: 48.08 / 49.06 us
# at M = 96 / 128 against 51.28 / 52.41 with the passes (levers/fused-stage-tp4/f-b-tail/); at 48 / 64 tokens, where
# the passes end within QKVG's time, the tail ran 0.4-1.4 us slower, and at TP 8 0.6-1.1 us slower.
WIDE_TOKENS_ON_M_STAGES = ((128, 7),)  # (largest token tile, slots)
WIDE_TOKENS_ON_M_MAX_M = WIDE_TOKENS_ON_M_STAGES[-1][0]
PADDED_ROWS_STAGES = ((128, 9), (152, 8), (192, 7), (224, 6))  # (largest token tile, slots)
PADDED_ROWS_WIDER = 8  # rows QKVG's swap-AB CTAs take beyond tokens_on_m_rows (see above TOKENS_ON_M_MAX_M)
# Up to PADDED_ROWS_NARROW_MAX_M tokens the swap-AB form keeps tokens_on_m_rows where those are at least
# PADDED_ROWS_NARROW_MIN_ROWS (TP 8: 128 CTAs of 48 rows): F_A/beta over all of K on the 4 SMs they leave, then F_B,
# still end within QKVG's time there. Measured on H200 for Kimi-K3 TP 8, 9 slots, output tiles staged at
# WgmmaTactic.staging_stride (qkvg_tactics.py, benchmarks/results/levers/fused-stage-swap-ab-48-rows/ and
# staged-output-bank-conflicts/): the stage took 22.82-22.83 us at M = 72 with 48-row CTAs against 23.08-23.32 with
# 56-row ones, 23.90-24.08 against 23.98 at 80, and 24.89-24.94 / 25.28-25.33 / 26.96-26.99 against 24.38 / 24.38 /
# 24.78 at 88 / 96 / 104. Narrower CTAs (TP 16: 24 rows) were not measured in this form and keep the wider one: their
# side chain's padded F_A/beta atoms are as many MMAs as TP 8's, beside half the QKVG per CTA.
PADDED_ROWS_NARROW_MAX_M = 72
PADDED_ROWS_NARROW_MIN_ROWS = 48
FUSED_MAX_M = PADDED_ROWS_STAGES[-1][0]
STAGE_COUNTERS = 2  # chain[0]: side-chain CTAs whose F_A/beta tile is stored; chain[1]: side-chain CTAs past the wait
FB_PASSES = 2  # tokens_on_m: the fewest F_B row blocks per side-chain CTA (a wgmma tile holds at most 256 rows)
MAX_TILE_ROWS = 256  # tokens_on_m: weight rows are the MMA's N


@dataclasses.dataclass(frozen=True)
class StagePlan:
    """How one stage launch divides the work: the tactics of QKVG, F_A/beta and F_B (all of one form and one token
    tile), the side-chain CTAs, and where F_B runs: ``fb_passes`` row blocks per side-chain CTA, or with
    ``fb_tail`` one row block of ``fb.block_n`` rows on each of QKVG's first CTAs after its QKVG tile."""

    qkvg: WgmmaTactic
    fab: WgmmaTactic
    fb: WgmmaTactic
    side: int
    fb_passes: int
    fb_tail: bool = False

    @property
    def fb_resident(self) -> bool:
        """Whether F_B runs as 64-row passes over one resident f_a tile (the side chain's swap-AB form)."""
        return not self.fab.tokens_on_m

    def fb_smem_bytes(self) -> int:
        """F_B's shared memory: one pass's ring, which the passes take in turn (tokens on M), or every pass's W_fb
        tiles, the resident f_a tile and one staged output tile (swap-AB)."""
        fb = self.fb
        if not self.fb_resident:
            return fb.stages * fb.slot_bytes()
        return (self.fb_passes * fb.stages * fb.block_n + fb.stages * fb.block_t) * fb.block_k * 2 + \
            fb.staged_tile_bytes()

    def fb_barriers(self) -> int:
        """F_B's mbarriers: a full/empty pair per slot of every pass (tokens on M), or one per pass (swap-AB)."""
        return self.fb_passes if self.fb_resident else self.fb_passes * 2 * self.fb.stages

    def waiters(self, fb_rows: int) -> int:
        """CTAs that wait for F_A/beta before F_B: the side chain's, or with ``fb_tail`` the QKVG CTAs that own one
        of F_B's ``fb_rows // fb.block_n`` row blocks."""
        return row_blocks(fb_rows, self.fb.block_n) if self.fb_tail else self.side


def plan_stage(tactic: WgmmaTactic, qkvg_rows: int, fab_rows: int, fb_rows: int, k: int, d: int,
               sms: int = SMS) -> StagePlan | str:
    """The :class:`StagePlan` of QKVG ``tactic`` on ``sms`` SMs, or why these shapes do not fit the fused stage."""
    if not (tactic.tokens_on_m or tactic.padded_rows) or tactic.split_k != 1:
        return f"tactic {tactic.key()}: the fused stage takes an unsplit tokens_on_m or padded-rows tactic"
    cluster = tactic.weight_cluster
    if cluster > 1 and tactic.consumer_warpgroups > 1:
        return (f"tactic {tactic.key()}: the fused stage takes a weight cluster's token tiles in one consumer "
                "warpgroup each")
    qkvg_ctas = row_blocks(qkvg_rows, tactic.block_n) * cluster
    side = sms - qkvg_ctas
    if side < 1:
        return f"QKVG's {qkvg_ctas} CTAs leave none of {sms} SMs to the side chain"
    if side % cluster:
        return f"QKVG's {qkvg_ctas} CTAs leave {side} of {sms} SMs, not whole clusters of {cluster}"
    fab_block = -(-fab_rows // (side * 8)) * 8
    if d % 64 or d > fab_rows:
        return f"F_B's K={d} must be a multiple of 64 within F_A/beta's {fab_rows} rows"
    # Where QKVG takes tokens on M in two consumer warpgroups (above 64 tokens), F_B's passes one after another on
    # the side-chain CTAs end well after QKVG: F_B runs as a tail on QKVG's CTAs instead (see WIDE_TOKENS_ON_M_STAGES).
    tail = tactic.tokens_on_m and tactic.consumer_warpgroups > 1
    # A weight cluster's CTAs each hold a share of M's tokens; its side chain runs swap-AB over all of them.
    swap_ab_side = not tactic.tokens_on_m or cluster > 1
    side_t = tactic.block_t * cluster  # the side chain's token tile: every token of the launch
    split = None
    if tail:
        # One row block of F_B (a multiple of 8 rows) on each of QKVG's first CTAs, its K-tiles all in one ring.
        rows = -(-fb_rows // (qkvg_ctas * 8)) * 8
        fb = dataclasses.replace(tactic, block_n=rows, stages=d // 64, pdl=False)
        passes = 1
    elif not swap_ab_side:
        # The fewest passes (at least FB_PASSES) splitting a side-chain CTA's share of F_B's rows into row blocks of
        # a multiple of 8 within the MMA's N.
        share = fb_rows // side if fb_rows % side == 0 else 0
        passes = next((n for n in range(FB_PASSES, share // 8 + 1)
                       if share % (8 * n) == 0 and share // n <= MAX_TILE_ROWS), None)
        if passes is None:
            return (f"F_B's {fb_rows} rows do not split into {side} shares of row blocks of a multiple of 8 up to "
                    f"{MAX_TILE_ROWS}")
        # A pass's K-tiles all load at once: its ring is as deep as F_B's K-tiles.
        fb = dataclasses.replace(tactic, block_n=share // passes, stages=d // 64, pdl=False)
    else:
        # Swap-AB: F_A/beta split along K over pairs of side-chain CTAs where the SMs QKVG leaves hold them (see
        # split_side_chain); F_B's rows are the MMA's M, one 64-row atom per pass (one consumer warpgroup).
        split = split_side_chain(qkvg_ctas, side, fab_rows, fb_rows, k)
        if split is not None:
            fab_block, side = split
        elif cluster > 1:
            # Beside 128 weight-cluster CTAs (Kimi-K3 TP 8: 96 rows each) 4 SMs are left. F_A/beta over all of K
            # there ends after QKVG above 72 tokens beside 48-row swap-AB CTAs (see PADDED_ROWS_NARROW_MAX_M); split
            # in two pairs of 72-row blocks (two padded atoms each) beside the cluster it ended after QKVG from 104
            # tokens and gained nothing below, and in the cluster's own form (80-row blocks, each in a cluster of the
            # two token tiles) after QKVG at every M from 88 (H100, benchmarks/RESULTS.md, levers).
            return f"a weight cluster's {qkvg_ctas} CTAs leave {side} SMs, too few for F_A/beta split along K"
        if fb_rows % (side * ATOM_ROWS):
            return f"F_B's {fb_rows} rows do not split into {side} shares of {ATOM_ROWS}-row passes"
        passes = fb_rows // (side * ATOM_ROWS)
        fb = WgmmaTactic(ATOM_ROWS, 64, side_t, d // 64, pdl=False)
    # F_A/beta's CTA streams its weights at the rate of its ring's bytes in flight, so it takes the deepest ring the
    # SM holds (the launch's shared memory is one size for all CTAs, one CTA per SM): fewer rows in more slots than
    # a QKVG CTA, it finishes before QKVG and leaves that time to F_B. Under swap-AB its MMAs bound it, so there it
    # splits K where the free SMs hold the pairs (split_side_chain).
    fab_probe = dataclasses.replace(tactic, block_n=fab_block, block_t=side_t, stages=1,
                                    split_k=CLUSTER_SPLIT_K if split else 1, tokens_on_m=not swap_ab_side,
                                    weight_cluster=1)
    ring = MAX_SMEM_BYTES - RING_OFFSET_BYTES
    fab_stages = ring // fab_probe.slot_bytes()
    fab = dataclasses.replace(fab_probe, stages=min(MAX_STAGES, fab_stages))
    # Each side-chain CTA (each pair, where F_A/beta splits K) owns one F_A/beta row block: one past the rows would
    # store past them, since only a partial last row block checks its rows.
    owners = side // fab.split_k
    if row_blocks(fab_rows, fab.block_n) < owners:
        return (f"F_A/beta's {fab_rows} rows in row blocks of {fab.block_n} leave some of the {owners} side-chain "
                f"{'pairs' if fab.split_k > 1 else 'CTAs'} without rows")
    found = StagePlan(tactic, fab, fb, side, passes, tail)
    if found.fb_smem_bytes() > ring:
        return f"F_B's {passes} passes of {fb.stages} K-tiles need more than {ring} bytes of shared memory"
    if 2 * max(tactic.stages, fab.stages) + found.fb_barriers() > RING_OFFSET_BYTES // 8:
        return f"the stage's mbarriers do not fit in {RING_OFFSET_BYTES} bytes"
    reason = (validate_wgmma_tactic(tactic, qkvg_rows, k, k) or validate_wgmma_tactic(fab, fab_rows, k, k)
              or validate_wgmma_tactic(fb, fb_rows, d, fab_rows))
    return reason or found


def split_side_chain(qkvg_ctas: int, free: int, fab_rows: int, fb_rows: int, k: int) -> tuple[int, int] | None:
    """``(rows, ctas)``: F_A/beta's row blocks of ``rows`` (one padded 64-row atom), each split along K over a pair of
    side-chain CTAs in a thread-block cluster, on ``ctas`` of the ``free`` SMs that QKVG's ``qkvg_ctas`` CTAs leave,
    F_B's ``fb_rows`` then in whole 64-row passes over them; the most CTAs that fit, or ``None``.

    Why: above 64 tokens a side-chain CTA is bound by its MMAs, not its loads. One 64-row atom over all of K keeps an
    SM's tensor cores busy 18 us at 128 tokens on H200, whether 40 of its rows are real or 64 (4 CTAs alone, Kimi-K3
    TP 8's F_A/beta: 18.12 / 18.17 us; over half of K 10.14; two atoms over half of K 20.09), longer than QKVG leaves
    F_B after it (benchmarks/results/levers/fused-stage-split-side-chain/)."""
    if (k // 64) % CLUSTER_SPLIT_K:
        return None
    for rows in range(8, ATOM_ROWS, 8):
        ctas = CLUSTER_SPLIT_K * row_blocks(fab_rows, rows)
        if ctas <= free and (ctas + qkvg_ctas) % CLUSTER_SPLIT_K == 0 and fb_rows % (ctas * ATOM_ROWS) == 0:
            return rows, ctas
    return None


def _fused_form(rows: int, m: int) -> tuple[bool, tuple[tuple[int, int], ...]]:
    """``(tokens_on_m, rings)`` of QKVG's fused tactic at ``m`` tokens with ``rows`` per CTA: tokens on M up to
    :data:`TOKENS_ON_M_MAX_M` tokens; above, tokens on M in two consumer warpgroups where a CTA owns 64 rows or
    more, else swap-AB. The rings' last token tile is the form's largest M."""
    if m <= TOKENS_ON_M_MAX_M:
        return True, FUSED_STAGES
    return (True, WIDE_TOKENS_ON_M_STAGES) if rows >= ATOM_ROWS else (False, PADDED_ROWS_STAGES)


def why_no_fused_tactic(qkvg_rows: int, k: int, m: int) -> str | None:
    """Why :func:`fused_stage_tactic` has no QKVG tactic at ``m`` tokens for these shapes, or ``None``."""
    if k % 64:
        return f"K={k} does not split into 64-element K-tiles"
    rows = tokens_on_m_rows(qkvg_rows)
    tokens_on_m, rings = _fused_form(rows, m)
    if m <= rings[-1][0]:
        return None
    if tokens_on_m:
        return (f"QKVG's {rows}-row CTAs take tokens on M, up to {rings[-1][0]} tokens (no swap-AB form for "
                f"{ATOM_ROWS} rows or more)")
    return f"M={m} above its token tile"


def fused_stage_tactic(qkvg_rows: int, k: int, m: int) -> WgmmaTactic | None:
    """QKVG's tactic in the fused stage at ``m`` tokens, one token tile covering ``m``:
    :func:`~kda_backend.kernels.wgmma_gemm.tokens_on_m_rows` rows per CTA, tokens on M in the ring
    :data:`FUSED_STAGES` gives the token tile up to :data:`TOKENS_ON_M_MAX_M` tokens; above, tokens on M in the ring
    :data:`WIDE_TOKENS_ON_M_STAGES` gives it where a CTA owns 64 rows or more, else swap-AB in the ring
    :data:`PADDED_ROWS_STAGES` gives it, with :data:`PADDED_ROWS_WIDER` rows more (still below one atom) unless ``m``
    is at most :data:`PADDED_ROWS_NARROW_MAX_M` and a CTA owns :data:`PADDED_ROWS_NARROW_MIN_ROWS` rows or more;
    ``None`` where :func:`why_no_fused_tactic` says why not."""
    if why_no_fused_tactic(qkvg_rows, k, m) is not None:
        return None
    rows = tokens_on_m_rows(qkvg_rows)
    tokens_on_m, rings = _fused_form(rows, m)
    narrow = m <= PADDED_ROWS_NARROW_MAX_M and rows >= PADDED_ROWS_NARROW_MIN_ROWS
    if not tokens_on_m and not narrow:
        rows = min(rows + PADDED_ROWS_WIDER, ATOM_ROWS - 8)
    tactic = WgmmaTactic(rows, 64, 64, 1, tokens_on_m=tokens_on_m).for_tokens(m)
    stages = next(slots for tile, slots in rings if tactic.block_t <= tile)
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
        """The barrier area, then the largest shared memory of the three GEMMs (:meth:`StagePlan.fb_smem_bytes`)."""
        p = self.plan
        rings = (p.qkvg.stages * p.qkvg.slot_bytes(), p.fab.smem_bytes() - RING_OFFSET_BYTES, p.fb_smem_bytes())
        return RING_OFFSET_BYTES + max(rings)

    def barriers(self) -> int:
        """mbarriers: a full/empty pair per slot of the larger of QKVG's and F_A/beta's rings, then F_B's."""
        p = self.plan
        return 2 * max(p.qkvg.stages, p.fab.stages) + p.fb_barriers()

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
        grid = (p.side + row_blocks(self.qkvg.n, p.qkvg.block_n) * p.qkvg.weight_cluster, 1, 1)
        # With F_A/beta split in clusters, or QKVG's token tiles sharing weights in them, every CTA of the grid is in
        # one (side-chain pairs and QKVG's clusters never synchronize with each other).
        cluster = None
        if cutlass.const_expr(p.qkvg.weight_cluster > 1):
            cluster = [p.qkvg.weight_cluster, 1, 1]
        elif cutlass.const_expr(p.fab.in_cluster):
            cluster = [CLUSTER_SPLIT_K, 1, 1]
        self.stage_kernel(*q_ops, *f_ops, *b_ops, *outs, m_chain).launch(
            grid=grid, block=[p.qkvg.threads, 1, 1], cluster=cluster, smem=self.smem_bytes(), stream=stream,
            use_pdl=p.qkvg.pdl,
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
        fb_barriers = barriers + 2 * max(p.qkvg.stages, p.fab.stages)
        if bidx >= p.side:
            if cutlass.const_expr(p.fb_tail):
                if bidx - p.side < p.waiters(self.fb.n):
                    if tidx == p.qkvg.consumer_threads:  # the producer warp's first thread
                        self._prefetch_fb_weights(b_w_tma, b_w_src, ring, b_s_w, dtype, bidx - p.side, 1)
            mainloop, s_w, s_x, s_x_box = self.qkvg._pipeline_on(barriers, ring, dtype, q_s_w, q_s_x, q_s_x_box)
            # A weight cluster's CTAs are its row block's token tiles, the cluster rank the token tile.
            row_block, token_tile = (bidx - p.side) // p.qkvg.weight_cluster, (bidx - p.side) % p.qkvg.weight_cluster
            self.qkvg._tile_per_cta(mainloop, q_w_tma, q_w_src, q_x_tma, q_x_src, s_w, s_x, s_x_box, ring, m_qkvg_t,
                                    None, None, None, q_mma, warp, tidx, row_block, token_tile, 0)
            if cutlass.const_expr(p.fb_tail):
                if bidx - p.side < p.waiters(self.fb.n):
                    self._wait_for_side_chain(m_chain, tidx)
                    fb_loop, fb_s_w, fb_s_x, fb_s_x_box = self.fb._pipeline_on(fb_barriers, ring, dtype, b_s_w,
                                                                               b_s_x, b_s_x_box)
                    self.fb._tile_per_cta(fb_loop, b_w_tma, b_w_src, b_x_tma, b_x_src, fb_s_w, fb_s_x, fb_s_x_box,
                                          ring, m_g1_t, None, None, None, b_mma, warp, tidx, bidx - p.side, 0, 0)
        else:
            if cutlass.const_expr(not p.fb_tail):
                if tidx == p.qkvg.consumer_threads:  # the producer warp's first thread
                    self._prefetch_fb_weights(b_w_tma, b_w_src, ring, b_s_w, dtype, bidx * p.fb_passes, p.fb_passes)
            mainloop, s_w, s_x, s_x_box = self.fab._pipeline_on(barriers, ring, dtype, f_s_w, f_s_x, f_s_x_box)
            row_block, k_half = bidx, 0
            if cutlass.const_expr(p.fab.in_cluster):  # row block bidx // 2, K-half (cluster rank) bidx % 2
                row_block, k_half = bidx // CLUSTER_SPLIT_K, bidx % CLUSTER_SPLIT_K
            self.fab._tile_per_cta(mainloop, f_w_tma, f_w_src, f_x_tma, f_x_src, s_w, s_x, s_x_box, ring, m_fab_t,
                                   None, None, None, f_mma, warp, tidx, row_block, 0, k_half)
            if cutlass.const_expr(p.fb_tail):
                self._count_in(m_chain, tidx)
            else:
                if cutlass.const_expr(p.fb_resident):
                    if tidx == 0:  # made visible by the wait's CTA barrier
                        for j in cutlass.range_constexpr(p.fb_passes):
                            cute.arch.mbarrier_init(fb_barriers + j, 1)
                        cute.arch.mbarrier_init_fence()
                self._count_in(m_chain, tidx)
                self._wait_for_side_chain(m_chain, tidx)
                if cutlass.const_expr(p.fb_resident):
                    self._fb_on_resident_f_a(b_w_tma, b_w_src, b_x_tma, b_x_src, b_mma, fb_barriers, ring, m_g1_t,
                                             warp, tidx, bidx)
                else:
                    # F_B's passes one after another in one ring, each with its own barriers: each pass's pipeline
                    # syncs the CTA, so the pass before has stored its output tile from the ring by then; the proxy
                    # fence orders those generic reads before the next pass's TMA writes.
                    for j in cutlass.range_constexpr(p.fb_passes):
                        if cutlass.const_expr(j > 0):
                            cute.arch.fence_proxy("async.shared", space="cta")
                        mainloop, s_w, s_x, s_x_box = self.fb._pipeline_on(
                            fb_barriers + j * 2 * p.fb.stages, ring, dtype, b_s_w, b_s_x, b_s_x_box
                        )
                        self.fb._tile_per_cta(mainloop, b_w_tma, b_w_src, b_x_tma, b_x_src, s_w, s_x, s_x_box,
                                              ring, m_g1_t, None, None, None, b_mma, warp, tidx,
                                              bidx * p.fb_passes + j, 0, 0)

    @cute.jit
    def _fb_on_resident_f_a(self, b_w_tma, b_w_src, b_x_tma, b_x_src, b_mma, bars, ring, m_g1_t, warp, tidx,
                            side_cta):
        """Swap-AB F_B of side-chain CTA ``side_cta``: ``fb_passes`` row blocks of 64 rows, ``g1 = f_a @ W_fb^T``
        for every token. The ring holds every pass's W_fb tiles, then f_a's ``[block_t, d]`` tile (loaded once),
        then one staged output tile. The producer warp issues every load at once, pass ``j``'s on mbarrier
        ``bars + j`` (pass 0's with f_a's); the consumer warpgroup runs each pass's MMAs once its tiles landed and
        stores its rows."""
        p, t = self.plan, self.plan.fb
        dtype = m_g1_t.element_type
        k_tiles = t.stages  # F_B's K-tiles (d / block_k)
        tile_mnk = (ATOM_ROWS, t.block_t, t.block_k)
        s_w_layout = hopper_helpers.make_smem_layout_a(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, p.fb_passes * k_tiles)
        s_x_layout = hopper_helpers.make_smem_layout_b(LayoutEnum.ROW_MAJOR, tile_mnk, dtype, k_tiles)
        w_elems, x_elems = cute.cosize(s_w_layout.outer), cute.cosize(s_x_layout.outer)
        s_w = cute.make_tensor(cute.recast_ptr(ring, s_w_layout.inner, dtype=dtype), s_w_layout.outer)
        s_x = cute.make_tensor(cute.recast_ptr(ring + w_elems, s_x_layout.inner, dtype=dtype), s_x_layout.outer)
        s_o = cute.make_tensor(ring + w_elems + x_elems,
                               cute.make_layout((ATOM_ROWS, t.block_t), stride=(1, t.staging_stride())))
        if warp == t.consumer_threads // 32:
            g_x = cute.local_tile(b_x_src, (t.block_t, t.block_k), (0, None))
            t_sx, t_gx = cpasync.tma_partition(
                b_x_tma, 0, cute.make_layout(1), cute.group_modes(s_x, 0, 2), cute.group_modes(g_x, 0, 2)
            )
            w_policy, x_policy = l2_policy(EVICT_FIRST), l2_policy(EVICT_LAST)
            w_bytes = k_tiles * ATOM_ROWS * t.block_k * 2
            for j in cutlass.range_constexpr(p.fb_passes):
                t_sw, t_gw = self._fb_weight_tiles(b_w_tma, b_w_src, s_w, side_cta * p.fb_passes + j)
                if tidx == t.consumer_threads:
                    x_bytes = k_tiles * t.block_t * t.block_k * 2 if j == 0 else 0
                    cute.arch.mbarrier_arrive_and_expect_tx(bars + j, w_bytes + x_bytes)
                for kt in cutlass.range_constexpr(k_tiles):
                    if cutlass.const_expr(j == 0):
                        cute.copy(b_x_tma, t_gx[None, kt], t_sx[None, kt], tma_bar_ptr=bars, cache_policy=x_policy)
                    cute.copy(b_w_tma, t_gw[None, kt], t_sw[None, j * k_tiles + kt], tma_bar_ptr=bars + j,
                              cache_policy=w_policy)
        else:
            m_tokens = m_g1_t.shape[1]
            thr_mma = b_mma.get_slice(tidx)
            t_ra = b_mma.make_fragment_A(thr_mma.partition_A(s_w))
            t_rb = b_mma.make_fragment_B(thr_mma.partition_B(s_x))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(s_o).shape, cutlass.Float32)
            for j in cutlass.range_constexpr(p.fb_passes):
                row_block = side_cta * p.fb_passes + j
                cute.arch.mbarrier_wait(bars + j, 0)
                acc.fill(0.0)
                b_mma.set(warpgroup.Field.ACCUMULATE, True)
                warpgroup.fence()
                for kt in cutlass.range_constexpr(k_tiles):
                    for kb in cutlass.range_constexpr(cute.size(t_ra, mode=[2])):
                        cute.gemm(b_mma, acc, t_ra[None, None, kb, j * k_tiles + kt], t_rb[None, None, kb, kt], acc)
                warpgroup.commit_group()
                warpgroup.wait_group(0)
                g_o = cute.local_tile(m_g1_t, (ATOM_ROWS, t.block_t), (row_block, 0))
                c_o = cute.local_tile(cute.make_identity_tensor(m_g1_t.shape), (ATOM_ROWS, t.block_t), (row_block, 0))
                self.fb._store_tile(acc, thr_mma, s_o, g_o, c_o, m_tokens, tidx)

    def _fb_weight_tiles(self, b_w_tma, b_w_src, s_w, row_block):
        """``(t_sw, t_gw)``: the TMA partitions of F_B's row block ``row_block``: the shared ring's (TMA, slots) and
        the global tile's (TMA, K-tiles)."""
        t = self.plan.fb
        g_w = cute.local_tile(b_w_src, (t.block_n, t.block_k), (row_block, None))
        return cpasync.tma_partition(
            b_w_tma, 0, cute.make_layout(1), cute.group_modes(s_w, 0, 2), cute.group_modes(g_w, 0, 2)
        )

    def _prefetch_fb_weights(self, b_w_tma, b_w_src, ring, b_s_w, dtype, first_block, blocks):
        """Start reading the W_fb tiles of F_B's row blocks ``first_block .. first_block + blocks - 1`` into L2 (TMA
        prefetch), so F_B's loads find them there."""
        t = self.plan.fb
        s_w = cute.make_tensor(cute.recast_ptr(ring, b_s_w.inner, dtype=dtype), b_s_w.outer)
        for j in range(blocks):
            _, t_gw = self._fb_weight_tiles(b_w_tma, b_w_src, s_w, first_block + j)
            for k in range(self.d // t.block_k):
                cute.prefetch(b_w_tma, t_gw[None, k])

    @cute.jit
    def _count_in(self, m_chain, tidx):
        """Count this side-chain CTA's F_A/beta tile in on ``chain[0]`` (the whole CTA). Release: each thread's
        stores are visible device-wide before thread 0 counts in."""
        cute.arch.fence_acq_rel_gpu()
        cute.arch.sync_threads()
        if tidx == 0:
            cute.arch.atomic_add(m_chain.iterator, cutlass.Int32(1), sem="release", scope="gpu")

    @cute.jit
    def _wait_for_side_chain(self, m_chain, tidx):
        """Wait until every side-chain CTA counted its F_A/beta tile in (the whole CTA). The last of the plan's
        :meth:`~StagePlan.waiters` past the wait resets both counters (``chain[1]`` counts them), so the stream's
        next launch finds them zero. Acquire: thread 0's fence after the wait orders the CTA's later reads, and
        the async-proxy fences let TMA read what generic stores wrote (the F_A/beta outputs in global memory, the
        staged tile in the ring)."""
        p = self.plan
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_threads()
        if tidx == 0:
            # Relaxed polls, one fence after.
            arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            while arrived < p.side:
                arrived = cute.arch.load(m_chain.iterator, cutlass.Int32, sem="relaxed", scope="gpu")
            cute.arch.fence_acq_rel_gpu()
            past = cute.arch.atomic_add(m_chain.iterator + 1, cutlass.Int32(1), sem="relaxed", scope="gpu")
            if past == p.waiters(self.fb.n) - 1:  # every waiting CTA has seen chain[0] complete
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

