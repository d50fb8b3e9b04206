"""The fused Hopper stage (QKVG's tiles and the side chain's in one grid): its shape rules and sm_90a compile on the
CPU; on a GPU, against fp32 with outputs poisoned, determinism, its counters left zero, and graph replay against
eager."""

import pytest
import torch

from kda_backend.geometry import preset
from kda_backend.kernels.compile_cache import FusedStageKey, compile_gemm
from kda_backend.providers.base import GemmCall
from kda_backend.providers.cute_provider import CuteDslProvider
from kda_backend.kernels.wgmma_gemm import RING_OFFSET_BYTES, WgmmaTactic, validate_wgmma_tactic
from kda_backend.kernels.wgmma_stage import (
    FUSED_MAX_M,
    FUSED_STAGES,
    PADDED_ROWS_STAGES,
    STAGE_COUNTERS,
    TOKENS_ON_M_MAX_M,
    WIDE_TOKENS_ON_M_MAX_M,
    WIDE_TOKENS_ON_M_STAGES,
    WgmmaStage,
    compile_stage,
    fused_stage_tactic,
    plan_stage,
    split_side_chain,
    validate_stage,
)

G = preset("kimi-k3", 8)
SHAPES = (G.qkvg_rows, G.fab_rows, G.local_width, G.hidden_size, G.head_dim)
G4 = preset("kimi-k3", 4)
SHAPES4 = (G4.qkvg_rows, G4.fab_rows, G4.local_width, G4.hidden_size, G4.head_dim)


def _tactic(m, stages=10):
    return WgmmaTactic(48, 64, 64, stages, tokens_on_m=True).for_tokens(m)


def _tp4(m):
    """TP 4's fused QKVG tactic at ``m`` tokens: 96-row CTAs, tokens on M."""
    return fused_stage_tactic(G4.qkvg_rows, G4.hidden_size, m)


def _swap_ab(m, stages=5):
    """A swap-AB QKVG tactic of 48-row CTAs, the token tile covering ``m`` (5 slots fit every tile up to 256)."""
    return WgmmaTactic(48, 64, 64, stages).for_tokens(m)


def _fused(m):
    """TP 8's fused QKVG tactic at ``m`` tokens (above 64: swap-AB CTAs of 56 rows, the ring by token tile)."""
    return fused_stage_tactic(G.qkvg_rows, G.hidden_size, m)


def _wide(m, stages=8):
    """A swap-AB QKVG tactic of 56-row CTAs (110 at TP 8, 22 SMs left to the side chain), the token tile covering
    ``m``."""
    return WgmmaTactic(56, 64, 64, stages).for_tokens(m)


def _cluster(m):
    """A QKVG tactic whose two token tiles share every weight tile in a cluster (tokens on M, 110 CTAs of 112 rows
    at TP 8), the cluster's tiles covering ``m``."""
    return WgmmaTactic(112, 64, 64, 10, tokens_on_m=True, weight_cluster=2).for_tokens(m)


def test_above_64_tokens_the_fused_stage_takes_swap_ab_qkvg():
    for m, rows in ((65, 48), (72, 48), (80, 56), (FUSED_MAX_M, 56)):
        tactic = fused_stage_tactic(G.qkvg_rows, G.hidden_size, m)
        assert tactic.padded_rows and tactic.block_n == rows and tactic.block_t >= m
        assert validate_stage(tactic, *SHAPES) is None


def test_above_128_tokens_the_fused_ring_is_the_deepest_that_fits_its_tile():
    assert [_fused(m).stages for m in (128, 136, 152, 160, 192, 200, FUSED_MAX_M)] == [9, 8, 8, 7, 7, 6, 6]
    assert FUSED_MAX_M == 224
    for m in (136, 160, 200, FUSED_MAX_M):
        plan = plan_stage(_fused(m), *SHAPES)
        assert plan.fab.in_cluster and plan.side == 12 and plan.fb_resident


def test_the_side_chain_takes_the_sms_qkvg_leaves():
    plan = plan_stage(_tactic(48), *SHAPES)
    assert plan.side == 4  # 128 QKVG CTAs of 48 rows on 132 SMs
    assert (plan.fab.block_n, plan.fb.block_n) == (40, 192)  # F_A/beta's 144 rows in 4 blocks, F_B's 1536 in 8
    assert plan.fab.block_t == plan.fb.block_t == plan.qkvg.block_t == 48
    assert plan.fab.stages == 17  # the deepest 40-row ring in an SM's shared memory
    assert WgmmaStage(_tactic(48), *SHAPES).smem_bytes() == RING_OFFSET_BYTES + 17 * plan.fab.slot_bytes()


def test_above_64_tokens_the_side_chain_is_swap_ab_with_f_a_resident():
    plan = plan_stage(_swap_ab(128, stages=8), *SHAPES)
    assert plan.side == 4 and plan.fb_resident
    assert (plan.fab.block_n, plan.fab.padded_rows, plan.fab.block_t) == (40, True, 128)
    assert plan.fab.stages == 9  # the deepest ring of 40 rows and 128 tokens in an SM's shared memory
    # F_B's 1536 rows: 6 passes of 64 per side-chain CTA, f_a's [128, 128] tile loaded once beside their W_fb tiles.
    assert (plan.fb.block_n, plan.fb.block_t, plan.fb.stages, plan.fb_passes) == (64, 128, 2, 6)
    assert plan.fb_smem_bytes() == (6 * 128 * 64 + 128 * 128 + 72 * 128) * 2  # the output tile staged 72 rows apart
    assert plan.fb_barriers() == 6
    stage = WgmmaStage(_swap_ab(128, stages=8), *SHAPES)
    assert stage.barriers() == 2 * 9 + 6
    assert stage.smem_bytes() == RING_OFFSET_BYTES + 9 * plan.fab.slot_bytes()


def test_where_qkvg_leaves_enough_sms_f_a_beta_splits_k_over_pairs_of_side_chain_ctas():
    plan = plan_stage(_wide(128), *SHAPES)
    # 110 QKVG CTAs leave 22 SMs: F_A/beta's 144 rows in 6 blocks of 24, each over a cluster of 2 (12 CTAs), and F_B's
    # 1536 rows in 2 passes of 64 on each of them (the most side-chain CTAs F_B's passes divide).
    assert plan.side == 12 and plan.fb_resident and plan.fb_passes == 2
    assert (plan.fab.block_n, plan.fab.split_k, plan.fab.in_cluster, plan.fab.block_t) == (24, 2, True, 128)
    assert plan.fab.stages == 9 and not plan.fab.uses_workspace
    assert split_side_chain(110, 22, G.fab_rows, G.local_width, G.hidden_size) == (24, 12)
    assert split_side_chain(128, 4, G.fab_rows, G.local_width, G.hidden_size) is None  # 48-row QKVG: 4 SMs left
    assert split_side_chain(110, 22, G.fab_rows, G.local_width, 7104) is None  # 111 K-tiles do not halve
    assert split_side_chain(111, 21, G.fab_rows, G.local_width, G.hidden_size) is None  # no pairing of the grid
    stage = WgmmaStage(_wide(128), *SHAPES)
    assert stage.smem_bytes() == RING_OFFSET_BYTES + 9 * plan.fab.slot_bytes()


def test_a_weight_cluster_qkvg_leaves_the_side_chain_swap_ab_over_every_token():
    plan = plan_stage(_cluster(128), *SHAPES)
    # 55 row blocks of 112 rows, two token tiles of 64 each: 110 CTAs in clusters of 2, 22 SMs left; the side chain
    # as beside 56-row swap-AB CTAs, over the cluster's 128 tokens.
    assert plan.qkvg.block_t == 64 and plan.side == 12 and plan.fb_resident and not plan.fab.tokens_on_m
    assert (plan.fab.block_n, plan.fab.in_cluster, plan.fab.block_t, plan.fab.weight_cluster) == (24, True, 128, 1)
    assert (plan.fb.block_n, plan.fb.block_t, plan.fb_passes) == (64, 128, 2)
    # 128 CTAs of 96 rows leave 4 SMs: F_A/beta would stream all of K there, ending after QKVG.
    assert "leave 4 SMs, too few for F_A/beta split along K" in validate_stage(
        WgmmaTactic(96, 64, 48, 11, tokens_on_m=True, weight_cluster=2), *SHAPES)
    assert "one consumer warpgroup each" in validate_stage(
        WgmmaTactic(96, 64, 128, 5, tokens_on_m=True, weight_cluster=2), *SHAPES)
    assert "not whole clusters of 2" in validate_stage(_cluster(128), *SHAPES, sms=131)


@pytest.mark.parametrize("m", [96, 128])
def test_the_weight_cluster_stage_compiles_for_sm90a(m):
    assert compile_stage(WgmmaStage(_cluster(m), *SHAPES), "sm_90a") is not None


def test_the_side_chain_splits_only_under_swap_ab():
    assert not plan_stage(_swap_ab(128), *SHAPES).fab.in_cluster  # 4 SMs left: 40-row blocks over all of K
    assert not plan_stage(_tactic(48), *SHAPES).fab.in_cluster


@pytest.mark.parametrize("m", [72, 256])
def test_the_swap_ab_stage_compiles_for_sm90a(m):
    assert compile_stage(WgmmaStage(_swap_ab(m), *SHAPES), "sm_90a") is not None


def test_shapes_the_one_launch_stage_refuses():
    assert validate_stage(_tactic(48), *SHAPES) is None
    assert "unsplit tokens_on_m" in validate_stage(WgmmaTactic(64, 64, 64, 12), *SHAPES)
    split = WgmmaTactic(48, 64, 128, 5, split_k=2)  # QKVG split along K in clusters
    assert validate_wgmma_tactic(split, G.qkvg_rows, G.hidden_size, G.hidden_size) is None
    assert "the fused stage takes an unsplit tokens_on_m or padded-rows tactic" in validate_stage(split, *SHAPES)
    # On more SMs than Kimi-K3's 40-row F_A/beta blocks cover, a side-chain CTA would own rows past F_A/beta's.
    assert "row blocks of 8 leave some of the 32 side-chain CTAs without rows" in validate_stage(_tactic(32), *SHAPES,
                                                                                                sms=160)
    assert "leave none of 132 SMs" in validate_stage(WgmmaTactic(40, 64, 64, 8, tokens_on_m=True), *SHAPES)
    assert "F_B's 1544 rows do not split into 4 shares" in validate_stage(_tactic(48), G.qkvg_rows, G.fab_rows, 1544,
                                                                          G.hidden_size, G.head_dim)
    assert "F_B's 2 passes of 8 K-tiles need more" in validate_stage(_tactic(48), G.qkvg_rows, 528, G.local_width,
                                                                     G.hidden_size, 512)
    assert "do not split into 4 shares of 64-row passes" in validate_stage(_swap_ab(96), G.qkvg_rows, G.fab_rows,
                                                                          1600, G.hidden_size, G.head_dim)
    assert "F_B's 12 passes of 4 K-tiles need more" in validate_stage(_swap_ab(96), G.qkvg_rows, 272, 3072,
                                                                       G.hidden_size, 256)
    with pytest.raises(ValueError, match="unsplit tokens_on_m"):
        WgmmaStage(WgmmaTactic(64, 64, 64, 12), *SHAPES)


@pytest.mark.parametrize("m", [24, 64, 128])
def test_compiles_for_sm90a(m):
    assert compile_stage(WgmmaStage(_tactic(m), *SHAPES), "sm_90a") is not None


def test_the_largest_fused_tile_compiles_for_sm90a():
    assert compile_stage(WgmmaStage(_fused(FUSED_MAX_M), *SHAPES), "sm_90a") is not None


def test_compiles_through_the_kernel_cache_for_sm90a():
    key = FusedStageKey(fused_stage_tactic(G.qkvg_rows, G.hidden_size, 40), *SHAPES[:3], G.hidden_size, G.head_dim,
                        132, "sm_90a")
    assert key.qkvg == WgmmaTactic(48, 64, 40, 10, tokens_on_m=True)
    assert fused_stage_tactic(G.qkvg_rows, G.hidden_size, 49) == WgmmaTactic(48, 64, 56, 8, tokens_on_m=True)
    assert FUSED_STAGES[-1][0] == TOKENS_ON_M_MAX_M and PADDED_ROWS_STAGES[-1][0] == FUSED_MAX_M
    # Swap-AB from 65 tokens: 48-row CTAs up to 72 tokens, 56-row ones above; TP 16's 24-row CTAs take 32 rows at once.
    assert fused_stage_tactic(G.qkvg_rows, G.hidden_size, 65) == WgmmaTactic(48, 64, 72, PADDED_ROWS_STAGES[0][1])
    assert fused_stage_tactic(G.qkvg_rows, G.hidden_size, 72) == WgmmaTactic(48, 64, 72, PADDED_ROWS_STAGES[0][1])
    assert fused_stage_tactic(G.qkvg_rows, G.hidden_size, 73) == WgmmaTactic(56, 64, 80, PADDED_ROWS_STAGES[0][1])
    g16 = preset("kimi-k3", 16)
    assert fused_stage_tactic(g16.qkvg_rows, g16.hidden_size, 65).block_n == 32
    assert plan_stage(fused_stage_tactic(G.qkvg_rows, G.hidden_size, 128), *SHAPES).fab.in_cluster
    assert fused_stage_tactic(G.qkvg_rows, G.hidden_size, FUSED_MAX_M + 1) is None
    assert compile_gemm(key) is not None
    split = FusedStageKey(fused_stage_tactic(G.qkvg_rows, G.hidden_size, 128), *SHAPES[:3], G.hidden_size,
                          G.head_dim, 132, "sm_90a")
    assert compile_gemm(split) is not None  # F_A/beta split in clusters, through the kernel cache


def test_tp4_fuses_with_tokens_on_m_up_to_128_tokens():
    # 96-row CTAs: above 64 tokens two consumer warpgroups of 64 tokens each; no swap-AB form.
    assert fused_stage_tactic(G4.qkvg_rows, G4.hidden_size, 72) == WgmmaTactic(
        96, 64, 72, WIDE_TOKENS_ON_M_STAGES[0][1], tokens_on_m=True)
    assert fused_stage_tactic(G4.qkvg_rows, G4.hidden_size, WIDE_TOKENS_ON_M_MAX_M).consumer_warpgroups == 2
    assert fused_stage_tactic(G4.qkvg_rows, G4.hidden_size, WIDE_TOKENS_ON_M_MAX_M + 1) is None
    assert CuteDslProvider().why_not_fused(_calls(128, g=G4)) is None
    assert CuteDslProvider().why_not_fused(_calls(129, g=G4)) == (
        "fused stage: QKVG's 96-row CTAs take tokens on M, up to 128 tokens (no swap-AB form for 64 rows or more)")


def test_tp4_runs_f_b_as_a_tail_on_qkvg_ctas():
    plan = plan_stage(_tp4(128), *SHAPES4)
    assert plan.side == 4 and plan.fb_tail and not plan.fb_resident  # 128 QKVG CTAs of 96 rows
    assert (plan.fab.block_n, plan.fab.block_t, plan.fab.consumer_warpgroups) == (40, 128, 2)
    # F_B's 3072 rows: 24 on each of the 128 QKVG CTAs, both K-tiles in one ring; they wait for the 4 side CTAs.
    assert (plan.fb.block_n, plan.fb.block_t, plan.fb.stages, plan.fb_passes) == (24, 128, 2, 1)
    assert plan.waiters(G4.local_width) == 128
    assert plan.fb_smem_bytes() == 2 * plan.fb.slot_bytes()
    assert plan.fb_barriers() == 2 * 2


def test_tp4_keeps_f_b_passes_on_the_side_chain_ctas_up_to_64_tokens():
    plan = plan_stage(_tp4(64), *SHAPES4)
    # One consumer warpgroup: F_B's 768 rows per side-chain CTA in 3 passes of 256 rows, one after another in one ring.
    assert not plan.fb_tail and (plan.fb.block_n, plan.fb.stages, plan.fb_passes) == (256, 2, 3)
    assert plan.waiters(G4.local_width) == plan.side == 4 and plan.fb_barriers() == 3 * 2 * 2


def test_tp8_keeps_f_b_on_the_side_chain_ctas():
    plan = plan_stage(_tactic(48), *SHAPES)
    assert not plan.fb_tail and plan.waiters(G.local_width) == plan.side == 4


@pytest.mark.parametrize(("g", "m"), [(G4, 24), (G4, 128), (preset("kimi-k3", 16), 24), (preset("kimi-k3", 16), 128)],
                         ids=["tp4-24", "tp4-128", "tp16-24", "tp16-128"])
def test_tp4_and_tp16_stages_compile_for_sm90a(g, m):
    shapes = (g.qkvg_rows, g.fab_rows, g.local_width, g.hidden_size, g.head_dim)
    tactic = fused_stage_tactic(g.qkvg_rows, g.hidden_size, m)
    assert validate_stage(tactic, *shapes) is None
    if g.tp_size == 16 and m <= 64:  # 128 QKVG CTAs of 24 rows; F_A/beta's 144 rows in 4 blocks of 40, the last partial
        assert plan_stage(tactic, *shapes).fab.block_n == 40
    if g.tp_size == 16 and m > 64:  # 96 swap-AB CTAs of 32 rows; F_A/beta split in clusters on 12 of the 36 SMs left
        plan = plan_stage(tactic, *shapes)
        assert tactic.block_n == 32 and plan.fab.in_cluster and plan.side == 12
    assert compile_stage(WgmmaStage(tactic, *shapes), "sm_90a") is not None


def _calls(m, capability=(9, 0), w_row_stride=None, fb_x_row_stride=None, g=G):
    """The three GEMM calls of Kimi-K3's stage in geometry ``g`` (TP 8) at ``m`` tokens on a GPU of ``capability``;
    contiguous weights and F_B reading F_A/beta's output unless the strides are given."""
    w_row_stride, fb_x_row_stride = w_row_stride or g.hidden_size, fb_x_row_stride or g.fab_rows
    shapes = {"qkvg": (g.qkvg_rows, g.hidden_size, g.hidden_size, w_row_stride),
              "fab": (g.fab_rows, g.hidden_size, g.hidden_size, w_row_stride),
              "fb": (g.local_width, g.head_dim, fb_x_row_stride, g.head_dim)}
    return {role: GemmCall(role, m, n, k, torch.bfloat16, "cuda", capability, xs, ws)
            for role, (n, k, xs, ws) in shapes.items()}


@pytest.mark.parametrize("m", [1, 17, 64, 65, 96, 128, 136, 224])
def test_the_cute_provider_fuses_tp8_hopper_stages_up_to_224_tokens(m):
    assert CuteDslProvider().why_not_fused(_calls(m)) is None


@pytest.mark.parametrize(("calls", "reason"), [
    (_calls(225), "fused stage: M=225 above its token tile"),
    (_calls(16, capability=(10, 0)), "fused stage: compute capability (10, 0) not in SM (9,)"),
    (_calls(16, w_row_stride=G.packed_rows + 8), "fused stage: x and the weights must have contiguous rows"),
    (_calls(16, fb_x_row_stride=G.head_dim), "fused stage: F_B reads F_A from another buffer"),
], ids=["m-225", "blackwell", "strided-weights", "f_a-elsewhere"])
def test_the_cute_provider_says_why_it_does_not_fuse(calls, reason):
    assert CuteDslProvider().why_not_fused(calls).startswith(reason)


needs_hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs an SM 9.x GPU"
)


def _operands(m, seed, g=G):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(torch.bfloat16)

    k = g.hidden_size
    x = randn(m, k)
    w_qkvg, w_fab = randn(g.qkvg_rows, k, scale=k**-0.5), randn(g.fab_rows, k, scale=k**-0.5)
    w_fb = randn(g.local_width, g.head_dim, scale=g.head_dim**-0.5)
    outs = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
            for n in (g.qkvg_rows, g.fab_rows, g.local_width)]
    return x, w_qkvg, w_fab, w_fb, outs


def _stage(tactic, m):
    """The compiled stage of ``tactic`` at ``m`` tokens, in TP 4's geometry for :func:`_tp4`, else TP 8's; and
    that geometry."""
    g, shapes = (G4, SHAPES4) if tactic is _tp4 else (G, SHAPES)
    return compile_stage(WgmmaStage(tactic(m), *shapes), "sm_90a"), g


def _run(kernel, x, w_qkvg, w_fab, w_fb, outs, chain):
    qkvg, fab, g1 = outs
    kernel(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1, chain)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("m", "tactic"), [(m, _tactic) for m in (17, 24, 40, 64, 100, 128)]
                         + [(m, _swap_ab) for m in (65, 72, 100, 128, 136, 200, 256)]
                         + [(m, _wide) for m in (65, 72, 100, 128)]
                         + [(m, _fused) for m in (136, 224)]
                         + [(m, _cluster) for m in (65, 97, 128)]
                         + [(m, _tp4) for m in (17, 64, 65, 100, 128)])
def test_matches_fp32_and_leaves_its_counters_zero(m, tactic):
    kernel, g = _stage(tactic, m)
    chain = torch.zeros(STAGE_COUNTERS, device="cuda", dtype=torch.int32)
    x, w_qkvg, w_fab, w_fb, outs = _operands(m, seed=m, g=g)
    _run(kernel, x, w_qkvg, w_fab, w_fb, outs, chain)
    torch.cuda.synchronize()
    qkvg, fab, g1 = outs
    for name, out, ref in (("qkvg", qkvg, x.float() @ w_qkvg.float().t()), ("fab", fab, x.float() @ w_fab.float().t()),
                           ("g1", g1, fab[:, : g.head_dim].float() @ w_fb.float().t())):
        assert not out.isnan().any(), name
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"{name}: relative error {err}"
    assert chain.tolist() == [0] * STAGE_COUNTERS
    again = [torch.full_like(o, float("nan")) for o in outs]
    _run(kernel, x, w_qkvg, w_fab, w_fb, again, chain)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(again, outs))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize(("m", "tactic"), [(24, _tactic), (64, _tactic), (128, _tactic), (96, _swap_ab), (128, _wide),
                                           (100, _cluster),
                                           (256, _swap_ab), (224, _fused), (40, _tp4), (120, _tp4)])
def test_graph_replay_with_new_inputs_equals_eager_bitwise(m, tactic):
    kernel, g = _stage(tactic, m)
    chain = torch.zeros(STAGE_COUNTERS, device="cuda", dtype=torch.int32)
    x, w_qkvg, w_fab, w_fb, outs = _operands(m, seed=1, g=g)
    _run(kernel, x, w_qkvg, w_fab, w_fb, outs, chain)  # outside the capture first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(3):  # several launches on one stream reuse the counters
            _run(kernel, x, w_qkvg, w_fab, w_fb, outs, chain)
    x.copy_(_operands(m, seed=2, g=g)[0])
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager = [torch.full_like(o, float("nan")) for o in outs]
    _run(kernel, x, w_qkvg, w_fab, w_fb, eager, chain)
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(outs, eager))
    assert chain.tolist() == [0] * STAGE_COUNTERS
