"""The Hopper wgmma skinny GEMM: tactics, compilation for sm_90a on the CPU, and on the GPU against an fp32 reference
for M from 17 to 256 tokens (token tiles smaller than M, split-K, partial row blocks, CUDA-graph replay)."""

import dataclasses

import pytest
import torch
from numerics import SENTINEL, assert_close, guarded

from kda_backend.kernels import compile_cache
from kda_backend.kernels.arrival_counters import SPLIT_K_COUNTERS
from kda_backend.kernels.compile_cache import KernelKey, compile_gemm
from kda_backend.kernels.skinny_gemm import Link, output_tiles
from kda_backend.kernels.wgmma_gemm import (
    MAX_TOKEN_TILE,
    WgmmaGemm,
    WgmmaTactic,
    default_wgmma_tactic,
    leaves_room,
    padded_rows_tactics,
    tokens_on_m_tactics,
    validate_wgmma_tactic,
    wgmma_block_t_for,
    wgmma_candidate_tactics,
    wgmma_output_tiles,
    weight_cluster_tactics,
)

K = 7168  # Kimi-K3 hidden size
QKVG_TP8, QKVG_TP4, FAB = 6144, 12288, 144  # rows of QKVG at TP8 and TP4, F_A/beta (vLLM's 16-row padding)
M_VALUES = [17, 24, 32, 40, 64, 100, 128, 200, 256]


def test_key_names_every_field():
    assert WgmmaTactic(128, 64, 32, 6, split_k=2).key() == "w128k64t32s6x2p"
    assert WgmmaTactic(64, 128, 256, 3, pdl=False).key() == "w64k128t256s3"
    assert WgmmaTactic(48, 64, 128, 8, tokens_on_m=True).key() == "w48k64t128s8mp"
    assert WgmmaTactic(96, 64, 64, 11, tokens_on_m=True, weight_cluster=2).key() == "w96k64t64s11mc2p"


def test_a_weight_cluster_splits_m_over_its_token_tiles_and_shares_whole_swizzle_atoms():
    """Tokens-on-M CTAs of one row block in a cluster of 2 along the token tiles: the token tile is M split over
    the cluster (a multiple of 8, at most 128), each CTA's barrier still counts the whole weight tile (both shares
    land in every CTA) and its own tokens; shares are whole 8-row swizzle atoms, tokens on M only."""
    tactic = WgmmaTactic(96, 64, 64, 11, tokens_on_m=True, weight_cluster=2)
    assert [tactic.for_tokens(m).block_t for m in (8, 17, 72, 96, 128, 200, 256)] == [8, 16, 40, 48, 64, 104, 128]
    assert tactic.stage_bytes() == (96 + 64) * 64 * 2 and tactic.ctas(QKVG_TP8, 128) == 128
    assert tactic.ctas(QKVG_TP8, 64) == 128  # the cluster's second tile holds no token, yet launches
    assert validate_wgmma_tactic(tactic, QKVG_TP8, K, K) is None
    for change, reason in [({"weight_cluster": 4}, "weight_cluster=4 must be one of (1, 2)"),
                           ({"block_n": 40}, "sharing block_n=40 rows in multiples of 8"),
                           ({"tokens_on_m": False}, "weight_cluster=2: only tokens_on_m CTAs share weight tiles")]:
        assert reason in validate_wgmma_tactic(dataclasses.replace(tactic, **change), QKVG_TP8, K, K)


def test_tokens_on_m_tiles_take_64_tokens_per_warpgroup():
    """Tokens on the MMA's M side: one consumer warpgroup per 64 tokens (the MMA pads the tile to them, in shared
    memory only), any multiple of 8 weight rows per CTA (48 rows: 128 CTAs for TP 8 QKVG), token tiles of M rounded
    up to 8, at most 128; 64-element K-tiles and no split-K."""
    tactic = WgmmaTactic(48, 64, 64, 8, tokens_on_m=True)
    assert tactic.consumer_warpgroups == 1 and tactic.acc_registers() == 24 and tactic.ctas(QKVG_TP8, 64) == 128
    assert [tactic.for_tokens(m).block_t for m in (17, 64, 65, 128, 256)] == [24, 64, 72, 128, 128]
    small = tactic.for_tokens(17)
    assert small.mma_tokens == 64 and small.stage_bytes() == (48 + 24) * 64 * 2
    assert small.smem_bytes() == 1024 + 8 * (48 + 64) * 64 * 2
    assert tactic.for_tokens(100).consumer_warpgroups == 2 and tactic.for_tokens(100).mma_tokens == 128
    assert validate_wgmma_tactic(tactic, QKVG_TP8, K, K) is None
    for change, reason in [({"block_t": 136}, "block_t=136 must be a multiple of 8 from 8 to 128"),
                           ({"block_n": 44}, "block_n=44 must be a multiple of 8"),
                           ({"block_k": 128}, "block_k=128: tokens_on_m loads 8-token boxes"),
                           ({"split_k": 2}, "split_k=2: tokens_on_m runs unsplit")]:
        assert reason in validate_wgmma_tactic(dataclasses.replace(tactic, **change), QKVG_TP8, K, K)
    tactic = WgmmaTactic()
    assert tactic.with_activations_from_l2() is tactic and tactic.family == "wgmma"


def test_the_staged_output_tile_puts_consecutive_tokens_in_other_bank_groups():
    """The token stride of the staged bf16 tile is an odd number of 16-byte runs: the MMA's rows, or 8 more."""
    cases = [(WgmmaTactic(64, 64, 128, 9), 72), (WgmmaTactic(48, 64, 128, 9), 72), (WgmmaTactic(128, 64, 64, 6), 136),
             (WgmmaTactic(48, 64, 64, 8, tokens_on_m=True), 56), (WgmmaTactic(96, 64, 128, 7, tokens_on_m=True), 104),
             (WgmmaTactic(24, 64, 64, 12, tokens_on_m=True), 24), (WgmmaTactic(40, 64, 64, 12, tokens_on_m=True), 40)]
    for tactic, stride in cases:
        assert tactic.staging_stride() == stride, tactic.key()
        assert (stride // 8) % 2 == 1 and tactic.staged_tile_bytes() == stride * tactic.mma_tokens * 2
        assert tactic.staged_tile_bytes() <= tactic.stages * tactic.slot_bytes()  # it fits in the drained ring


def test_workspace_and_ctas_by_schedule():
    """Split-K: a workspace [split_k, M, N], one CTA per tile and split, one arrival counter per tile; unsplit: no
    workspace."""
    split, plain = WgmmaTactic(64, 64, 128, 4, split_k=2), WgmmaTactic(64, 64, 128, 9)
    assert split.uses_workspace and split.workspace_shape(100, QKVG_TP8) == (2, 100, QKVG_TP8)
    assert split.ctas(QKVG_TP8, 100) == 96 * 2
    assert split.counters(QKVG_TP8, 100) == 96
    assert not plain.uses_workspace and plain.ctas(QKVG_TP8, 100) == 96


def test_threads_and_shared_memory():
    """One or two consumer warpgroups and one producer warp; the ring after a 1 KB barrier area."""
    assert WgmmaTactic(block_n=64).threads == 160 and WgmmaTactic(block_n=256).threads == 288
    assert WgmmaTactic(128, 64, 32, 6).smem_bytes() == 1024 + 6 * (128 + 32) * 64 * 2


@pytest.mark.parametrize(
    "tactic,n,k,xs,match",
    [
        (WgmmaTactic(), 100, K, K, "N=100 must be a multiple of 8"),
        (WgmmaTactic(block_n=96), QKVG_TP8, K, K, "block_n=96 must be one of (64, 128, 256), or a multiple of 8"),
        (WgmmaTactic(block_n=44), QKVG_TP8, K, K, "block_n=44 must be one of (64, 128, 256), or a multiple of 8"),
        (WgmmaTactic(block_n=48, block_k=128, stages=4), QKVG_TP8, K, K, "rows below 64 load in 8-row boxes"),
        (WgmmaTactic(block_n=48, split_k=4), QKVG_TP8, K, K, "split_k=4: rows below 64 run unsplit or split in a"),
        (WgmmaTactic(block_k=256), QKVG_TP8, K, K, "block_k=256 must be 64 or 128"),
        (WgmmaTactic(block_k=128, stages=4), QKVG_TP8, 7104, 7104, "dividing K=7104"),
        (WgmmaTactic(block_t=20), QKVG_TP8, K, K, "block_t=20 must be a multiple of 8"),
        (WgmmaTactic(block_t=264), QKVG_TP8, K, K, "block_t=264"),
        (WgmmaTactic(block_n=256, block_t=192, stages=2), QKVG_TP8, K, K, "192 accumulator registers"),
        (WgmmaTactic(stages=1), QKVG_TP8, K, K, "stages=1"),
        (WgmmaTactic(split_k=3), QKVG_TP8, K, K, "split_k=3 must divide the 112 K-tiles"),

        (WgmmaTactic(128, 64, 256, 6), QKVG_TP8, K, K, "shared memory"),
        (WgmmaTactic(), QKVG_TP8, K, 7172, "x row stride 7172"),
    ],
)
def test_validate_reasons(tactic, n, k, xs, match):
    reason = validate_wgmma_tactic(tactic, n, k, xs)
    assert reason is not None and match in reason


def test_rows_below_one_atom_pad_the_mma_not_the_loads():
    """Swap-AB CTAs of fewer than 64 rows (128 CTAs of 48 at TP 8): the 64-row MMA and its ring slot include the
    padding rows, the loads and the transaction count only the real ones."""
    tactic = WgmmaTactic(48, 64, 128, 9)
    assert tactic.padded_rows and tactic.mma_rows == 64 and tactic.consumer_warpgroups == 1
    assert tactic.stage_bytes() == (48 + 128) * 64 * 2 and tactic.slot_bytes() == (64 + 128) * 64 * 2
    assert tactic.acc_registers() == 64 and tactic.ctas(QKVG_TP8, 128) == 128
    assert not WgmmaTactic(64, 64, 128, 9).padded_rows
    assert not WgmmaTactic(48, 64, 64, 8, tokens_on_m=True).padded_rows


def test_padded_rows_split_k_in_a_cluster_without_workspace():
    """Padded rows over half of K each: no workspace or counters, the fp32 partial of the MMA's whole tile staged in
    the drained ring."""
    tactic = WgmmaTactic(24, 64, 128, 9, split_k=2)
    assert tactic.padded_rows and tactic.in_cluster and not tactic.uses_workspace
    assert tactic.key() == "w24k64t128s9x2p" and tactic.ctas(FAB, 128) == 12
    assert tactic.partial_bytes() == 64 * 128 * 4 and WgmmaTactic(24, 64, 128, 9).partial_bytes() == 0
    assert dataclasses.replace(tactic, stages=1).smem_bytes() == 1024 + 64 * 128 * 4
    assert validate_wgmma_tactic(tactic, FAB, K, K) is None
    assert not WgmmaTactic(64, 64, 64, 8, split_k=2).in_cluster and WgmmaTactic(64, 64, 64, 8, split_k=2).uses_workspace


def test_the_autotuner_times_the_padded_rows_tactic_where_a_row_block_is_below_one_atom():
    from kda_backend.autotune import WGMMA_CANDIDATES, wgmma_shortlist

    assert padded_rows_tactics(QKVG_TP8, K, 72) == [WgmmaTactic(48, 64, 72, 12)]
    assert padded_rows_tactics(QKVG_TP8, K, 128) == [WgmmaTactic(48, 64, 128, 9)]
    assert padded_rows_tactics(QKVG_TP4, K, 128) == []  # 96 rows per CTA: one atom and a half, no padding
    for m in (64, 128):
        picks = wgmma_shortlist(QKVG_TP8, K, m, K)
        assert len(picks) <= WGMMA_CANDIDATES and padded_rows_tactics(QKVG_TP8, K, m)[0] in picks
        assert all(t in picks for t in tokens_on_m_tactics(QKVG_TP8, K, m))


def test_partial_row_blocks_and_odd_token_tiles_are_valid():
    """Rows past N and tokens past M are zero-filled by the TMA unit: any N % 8 == 0 and any multiple of 8 tokens."""
    for n in (136, 144, 152, QKVG_TP8 + 8):
        assert validate_wgmma_tactic(WgmmaTactic(64, 64, 24, 6), n, K, K) is None
    assert validate_wgmma_tactic(WgmmaTactic(64, 64, 200, 4), QKVG_TP8, K, K) is None


def test_block_t_covers_m():
    assert [wgmma_block_t_for(m) for m in (1, 17, 24, 33, 65, 100, 129, 250, 256, 300)] == [8, 24, 24, 40, 72, 104,
                                                                                        136, 256, 256, 256]


@pytest.mark.parametrize("n", [QKVG_TP8, QKVG_TP4, FAB, 136, 152])
@pytest.mark.parametrize("m", M_VALUES)
def test_candidates_are_valid_and_include_default(n, m):
    candidates = wgmma_candidate_tactics(n, K, m, K)
    default = default_wgmma_tactic(n, K, m)
    assert validate_wgmma_tactic(default, n, K, K) is None and default in candidates
    assert 0 < len(candidates) <= 28 and len(set(candidates)) == len(candidates)
    for tactic in candidates:
        assert validate_wgmma_tactic(tactic, n, K, K) is None
        assert tactic.block_t * tactic.weight_cluster >= min(m, MAX_TOKEN_TILE)  # one tile (or cluster) covers M
        if tactic.uses_workspace:
            assert wgmma_output_tiles(tactic, n, m) == output_tiles(tactic, n, m) <= SPLIT_K_COUNTERS


@pytest.mark.parametrize("n,rows", [(QKVG_TP8, 96), (QKVG_TP4, 192), (3072, 48)])
def test_weight_cluster_candidates_give_every_sm_one_cta_above_64_tokens(n, rows):
    """Weight clusters from 65 tokens: twice the tokens-on-M rows per CTA, so the row blocks times the cluster's two
    token tiles are about one CTA per SM (128 at TP 8, 4 and 16), in the deepest ring only (one that leaves room for
    the side chain measured far slower alone)."""
    assert weight_cluster_tactics(n, K, 64) == [] and weight_cluster_tactics(n, 7160, 128) == []
    for m in (72, 128, 200, 256):
        (deep,) = weight_cluster_tactics(n, K, m)
        assert (deep.block_n, deep.weight_cluster, deep.tokens_on_m, deep.pdl) == (rows, 2, True, True)
        assert deep.ctas(n, m) == 128 and deep.block_t == -(-m // 16) * 8 and deep.stages <= 12
        assert validate_wgmma_tactic(deep, n, K, K) is None and not leaves_room(deep)
        deeper = dataclasses.replace(deep, stages=deep.stages + 1)
        assert deep.stages == 12 or "shared memory" in validate_wgmma_tactic(deeper, n, K, K)
        clusters = [t for t in wgmma_candidate_tactics(n, K, m, K) if t.weight_cluster > 1]
        assert clusters == [deep]


@pytest.mark.parametrize("n,rows", [(QKVG_TP8, 48), (QKVG_TP4, 96), (3072, 24)])
def test_tokens_on_m_candidates_give_every_sm_a_row_block(n, rows):
    """Tokens-on-M candidates: the fewest rows per CTA that need at most one CTA per SM (128 CTAs for Kimi-K3's
    QKVG at TP 4, 8 and 16), with PDL in the deepest ring up to 12 K-tiles (also without PDL), the deepest that
    leaves half the SM to the side chain and the one halfway; none above 64 tokens."""
    tactics = tokens_on_m_tactics(n, K, 64)
    assert {t.block_n for t in tactics} == {rows} and rows * 128 == n
    assert all(t.tokens_on_m and t.block_t == 64 for t in tactics)
    deep, roomy = max(t.stages for t in tactics), min(t.stages for t in tactics)
    assert [(t.stages, t.pdl) for t in tactics] == [(deep, True), (deep, False), ((deep + roomy) // 2, True),
                                                    (roomy, True)]
    assert deep <= 12 and not leaves_room(dataclasses.replace(tactics[0], stages=roomy + 1))
    assert all(leaves_room(t) == (t.stages == roomy) for t in tactics)
    assert set(tactics) <= set(wgmma_candidate_tactics(n, K, 64, K))
    assert tokens_on_m_tactics(n, K, 65) == [] and tokens_on_m_tactics(n, K, 17)[0].block_t == 24


def test_skinny_n_is_split_to_fill_the_sms():
    """F_A/beta's three 64-row blocks alone would leave most SMs idle: the default splits K (less at large M, where
    the fp32 partials would outweigh the weights)."""
    assert default_wgmma_tactic(FAB, K, 32).split_k > 1
    assert default_wgmma_tactic(FAB, K, 32).split_k >= default_wgmma_tactic(FAB, K, 256).split_k
    assert default_wgmma_tactic(QKVG_TP8, K, 17).split_k == default_wgmma_tactic(QKVG_TP4, K, 64).split_k == 1


def test_side_chain_links_are_refused():
    with pytest.raises(ValueError, match="side chain"):
        WgmmaGemm(WgmmaTactic(), QKVG_TP8, K, K, K, Link(signals=True, x_ready=True))


def test_compile_cache_covers_the_kernel_source():
    from kda_backend.kernels import wgmma_gemm

    assert wgmma_gemm.__file__ in compile_cache.KERNEL_SOURCES


COMPILE_CASES = [
    (WgmmaTactic(128, 64, 32, 8), QKVG_TP8),
    (WgmmaTactic(128, 64, 64, 8), QKVG_TP8),
    (WgmmaTactic(64, 64, 128, 8), QKVG_TP8),
    (WgmmaTactic(128, 64, 256, 4), QKVG_TP8),
    (WgmmaTactic(256, 64, 128, 4), QKVG_TP8),
    (WgmmaTactic(64, 128, 24, 6), QKVG_TP8),
    (WgmmaTactic(64, 64, 40, 8, split_k=2), QKVG_TP8),
    (WgmmaTactic(128, 64, 64, 6), QKVG_TP4),
    (WgmmaTactic(64, 64, 32, 6, split_k=14), FAB),
    (WgmmaTactic(64, 64, 24, 6, split_k=7), 136),
    (WgmmaTactic(48, 64, 24, 10, tokens_on_m=True), QKVG_TP8),
    (WgmmaTactic(48, 64, 64, 10, tokens_on_m=True), QKVG_TP8),
    (WgmmaTactic(96, 64, 104, 6, tokens_on_m=True, pdl=False), QKVG_TP4),
    (WgmmaTactic(48, 64, 40, 8, tokens_on_m=True), 136),
    (WgmmaTactic(48, 64, 128, 9), QKVG_TP8),
    (WgmmaTactic(24, 64, 96, 10, pdl=False), 136),
    (WgmmaTactic(24, 64, 128, 9, split_k=2), FAB),
    (WgmmaTactic(96, 64, 64, 11, tokens_on_m=True, weight_cluster=2), QKVG_TP8),
    (WgmmaTactic(96, 64, 128, 7, tokens_on_m=True, weight_cluster=2, pdl=False), QKVG_TP4),
    (WgmmaTactic(48, 64, 40, 8, tokens_on_m=True, weight_cluster=2), 136),
]


@pytest.mark.parametrize("tactic,n", COMPILE_CASES, ids=lambda c: c.key() if isinstance(c, WgmmaTactic) else f"N{c}")
def test_compiles_for_sm90a_on_cpu(tactic, n, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    assert validate_wgmma_tactic(tactic, n, K, K) is None
    assert compile_gemm(KernelKey(tactic, n, K, K, K, "sm_90a")) is not None


def _gpu_tactics(m):
    """A covering tile with each row block size that fits it, and tiles smaller than M (grid y > 1)."""
    block_t = wgmma_block_t_for(m)
    tactics = [default_wgmma_tactic(QKVG_TP8, K, m), WgmmaTactic(128, 64, block_t, 4 if block_t > 128 else 6)]
    if block_t <= 128:
        tactics.append(WgmmaTactic(256, 64, block_t, 4))
    tactics.append(WgmmaTactic(64, 64, 16, 8))
    if m > 64:
        tactics.append(WgmmaTactic(128, 64, 48, 6))
    tactics.append(WgmmaTactic(48, 64, block_t, 4))  # rows padded to the 64-row atom
    if m <= 128:
        tactics.append(WgmmaTactic(48, 64, 64, 8, tokens_on_m=True).for_tokens(m))
        tactics.append(WgmmaTactic(48, 64, 64, 6, tokens_on_m=True).for_tokens(8 * (m // 16) or 8))  # tile < M
    return tactics


def _check(tactic, m, n, seed=0):
    from kda_backend.providers.cute_provider import launch

    generator = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=generator)
    w = torch.randn(n, K, device="cuda", dtype=torch.bfloat16, generator=generator) * K**-0.5
    (out, guard), (again, _) = guarded(m, n), guarded(m, n)
    launch(tactic, x, w, out)
    assert_close(out, x.float() @ w.float().t(), tactic.key())
    assert (guard == SENTINEL).all(), f"{tactic.key()}: stored past the output"
    launch(tactic, x, w, again)
    assert torch.equal(out, again), tactic.key()


@pytest.mark.gpu
@pytest.mark.parametrize("m", M_VALUES, ids=lambda m: f"M{m}")
def test_qkvg_matches_reference(m):
    for tactic in _gpu_tactics(m):
        _check(tactic, m, QKVG_TP8)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "tactic,n",
    [
        (WgmmaTactic(64, 64, 128, 4, split_k=2), QKVG_TP8),
        (WgmmaTactic(64, 64, 24, 6, split_k=14), FAB),
        (WgmmaTactic(64, 64, 128, 6, split_k=7), 136),
        (WgmmaTactic(256, 64, 64, 4), FAB),
        (WgmmaTactic(128, 64, 64, 6), QKVG_TP4),
    ],
    ids=lambda c: c.key() if isinstance(c, WgmmaTactic) else f"N{c}",
)
@pytest.mark.parametrize("m", [17, 100, 256], ids=lambda m: f"M{m}")
def test_split_k_and_partial_row_blocks_match_reference(tactic, n, m):
    """Split-K sums its partials in a fixed order (bit-identical relaunches); rows past N (144 and 136 rows in 64- and
    256-row blocks) are zero-filled and never stored. Split tactics keep their output tiles within one stream's
    arrival counters at every M here."""
    _check(tactic, m, n)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [17, 24, 61, 64, 100, 128], ids=lambda m: f"M{m}")
def test_tokens_on_m_matches_reference_with_partial_row_blocks(m):
    """Tokens on the MMA's M side: padding tokens in shared memory are never loaded and never stored; rows past N
    (136 rows in 48-row blocks) neither."""
    _check(WgmmaTactic(48, 64, 64, 8, tokens_on_m=True).for_tokens(m), m, 136, seed=m)
    _check(WgmmaTactic(96, 64, 64, 6, tokens_on_m=True, pdl=False).for_tokens(m), m, QKVG_TP4, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [8, 17, 72, 100, 128, 200, 256], ids=lambda m: f"M{m}")
def test_weight_clusters_match_reference_with_partial_row_blocks(m):
    """Token tiles in clusters of 2 sharing every weight tile by multicast: each CTA's rows land in both; a tile
    past M (M = 8: one 8-token tile, the cluster's second CTA loads no real token) stores nothing; rows past N (136
    rows in 48-row blocks, shares of 24) are never stored; relaunches are bit-identical."""
    _check(WgmmaTactic(96, 64, 64, 7, tokens_on_m=True, weight_cluster=2).for_tokens(m), m, QKVG_TP8, seed=m)
    _check(WgmmaTactic(48, 64, 64, 8, tokens_on_m=True, weight_cluster=2, pdl=False).for_tokens(m), m, 136, seed=m)
    _check(WgmmaTactic(96, 64, 32, 8, tokens_on_m=True, weight_cluster=2), m, QKVG_TP4, seed=m)  # 4+ tiles along y


@pytest.mark.gpu
@pytest.mark.parametrize("tactic", [WgmmaTactic(128, 64, 48, 6), WgmmaTactic(64, 64, 128, 4, split_k=2),
                                    WgmmaTactic(48, 64, 104, 8, tokens_on_m=True),
                                    WgmmaTactic(96, 64, 56, 11, tokens_on_m=True, weight_cluster=2),
                                    WgmmaTactic(24, 64, 104, 9, split_k=2)],
                         ids=lambda t: t.key())
def test_graph_replay_equals_eager(tactic):
    """A captured launch replayed on new inputs (same buffers) equals an eager launch on them, bit for bit."""
    from kda_backend.providers.cute_provider import launch

    m, n = 100, QKVG_TP8
    x = torch.randn(m, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, K, device="cuda", dtype=torch.bfloat16) * K**-0.5
    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
    launch(tactic, x, w, out)  # compiled (and split-K counters reserved) before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch(tactic, x, w, out)
    for seed in (1, 2):
        generator = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(m, K, device="cuda", dtype=torch.bfloat16, generator=generator))
        w.copy_(torch.randn(n, K, device="cuda", dtype=torch.bfloat16, generator=generator) * K**-0.5)
        out.fill_(float("nan"))
        graph.replay()
        eager = torch.full_like(out, float("nan"))
        launch(tactic, x, w, eager)
        torch.cuda.synchronize()
        assert torch.equal(out, eager)
        assert_close(out, x.float() @ w.float().t(), tactic.key())


def test_entry_point_refuses_missing_and_stray_operands_at_compile(monkeypatch):
    """Split-K operands are required where the tactic splits; chain operands (no side-chain role) are refused."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, K), (K, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (QKVG_TP8, K), (K, 1), assumed_align=16)
    out = make_fake_tensor(cutlass.BFloat16, (m, QKVG_TP8), (QKVG_TP8, 1), assumed_align=16)
    chain = make_fake_tensor(cutlass.Int32, (2,), (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    options = "--enable-tvm-ffi --gpu-arch sm_90a"
    tactic = WgmmaTactic(64, 64, 32, 6, split_k=2)
    with pytest.raises(ValueError, match=f"m_work, m_arrivals required by tactic {tactic.key()}"):
        cute.compile(WgmmaGemm(tactic, QKVG_TP8, K, K, K), x, w, out, None, None, None, None, stream,
                     options=options)
    plain = WgmmaGemm(WgmmaTactic(64, 64, 32, 6), QKVG_TP8, K, K, K)
    with pytest.raises(ValueError, match="m_chain not used by tactic w64k64t32s6p: pass None"):
        cute.compile(plain, x, w, out, None, None, chain, None, stream, options=options)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 72, 100, 128, 200], ids=lambda m: f"M{m}")
def test_rows_below_one_atom_match_reference_with_partial_row_blocks(m):
    """Swap-AB CTAs of 48 and 24 rows: the MMA's padding rows are never loaded and never stored; rows past N (136
    rows in blocks of 48 and of 24) neither; a token tile smaller than M runs along grid y."""
    _check(WgmmaTactic(48, 64, 64, 4).for_tokens(m), m, QKVG_TP8, seed=m)
    _check(WgmmaTactic(48, 64, 64, 4).for_tokens(m), m, 136, seed=m)
    _check(WgmmaTactic(24, 64, 32, 6, pdl=False), m, 136, seed=m)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 17, 72, 100, 128, 200], ids=lambda m: f"M{m}")
def test_padded_rows_split_in_a_cluster_match_reference(m):
    """Padded rows over half of K each, summed in the cluster in split order (bit-identical relaunches): the atom's
    padding rows are never loaded and never stored; rows past N (152 rows in 48-row blocks) neither; a token tile
    smaller than M runs along grid y."""
    _check(WgmmaTactic(24, 64, 64, 4, split_k=2).for_tokens(m), m, FAB, seed=m)
    _check(WgmmaTactic(48, 64, 64, 4, split_k=2, pdl=False).for_tokens(m), m, 152, seed=m)
    _check(WgmmaTactic(56, 64, 8 * (m // 16) or 8, 6, split_k=2), m, QKVG_TP8, seed=m)
