"""On the GPU: CuTe DSL kernels vs the fp32 reference, determinism, and overlapped CUDA-graph replay."""

import dataclasses

import pytest
import torch
from numerics import assert_close, projection_outputs

from kda_backend import KDAProjection, Plan, ProjectionWeights, Step
from kda_backend.geometry import preset
from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import StageKey, compiled_gemms
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.kernels.wgmma_gemm import WgmmaTactic, default_wgmma_tactic
from kda_backend.reference import KDALayerWeights, reference_projection

pytestmark = pytest.mark.gpu
MS = list(range(1, 17)) + [24, 32, 40, 64]  # above 32 tokens QKVG's default is the wgmma kernel on Hopper


def _weights(tp, packed, seed=0):
    g = preset("kimi-k3", tp)
    w = KDALayerWeights.random(g, torch.Generator().manual_seed(seed), device="cuda")
    if packed:
        return ProjectionWeights.from_packed(torch.cat([w.w_qkvg, w.w_fab]), w.w_fb, g)
    return ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, g)


def _assert_close_to_reference(outs, x, w):
    ref = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, w.geometry)
    for name, out, expect in zip(("qkvg", "g1", "beta"), outs, ref):
        assert_close(out, expect, name)


@pytest.mark.parametrize("overlap", [False, True], ids=["sequential", "overlap"])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16], ids=lambda t: f"tp{t}")
def test_cute_projection_matches_reference(tp, packed, overlap, monkeypatch):
    """Eager: an overlapped step runs its side chain trailing QKVG on one stream."""
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "cute")
    w = _weights(tp, packed, seed=tp)
    proj = KDAProjection(w, Plan.uniform(64, Step(overlap=overlap)))
    g = w.geometry
    for m in MS:
        x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
        outs = proj(x, *projection_outputs(m, g, "cuda"))
        assert all(proj.provider(r, m).name == "cute" for r in ("qkvg", "fab", "fb"))
        if overlap:  # trailing QKVG on one stream, unless QKVG and F_A/beta both split K (see why_not_trailing)
            both_split = all(proj.provider(r, m).tactic(proj.gemm_call(r, m)).split_k > 1 for r in ("qkvg", "fab"))
            assert (proj.stage(m).trailing is None) == both_split
            assert not arrival_counters.chain_for_stream(torch.cuda.current_stream()).any()
        _assert_close_to_reference(outs, x, w)
        again = proj(x, *projection_outputs(m, g, "cuda"))
        for a, b in zip(outs, again):
            assert torch.equal(a, b), f"M={m}: two runs differ"


@pytest.mark.parametrize("m", [1, 5, 16], ids=lambda m: f"M{m}")
def test_row_strided_x_through_forced_cute_equals_contiguous_x(m, monkeypatch):
    """The kernels take rows of exactly hidden elements: every other row of a wider buffer (a row stride the
    kernels were not compiled for) is served through the CuTe provider, bitwise equal to the same rows contiguous,
    never refused mid-stage."""
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "cute")
    w = _weights(8, packed=False)
    g = w.geometry
    proj = KDAProjection(w, Plan.uniform(16, Step(overlap=True)))
    base = torch.randn(2 * m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    strided, contiguous = base[::2], base[::2].contiguous()
    assert strided.stride(0) == 2 * g.hidden_size
    outs = proj(strided, *projection_outputs(m, g, "cuda"))
    _assert_close_to_reference(outs, contiguous, w)
    for a, b in zip(outs, proj(contiguous, *projection_outputs(m, g, "cuda"))):
        assert torch.equal(a, b)
    assert all(proj.provider(r, m).name == "cute" for r in ("qkvg", "fab", "fb"))


def test_automatic_selection_prefers_cute_on_hopper_and_blackwell():
    w = _weights(8, packed=True)
    proj = KDAProjection(w)
    expected = "cute" if torch.cuda.get_device_capability()[0] in (9, 10) else "torch"
    assert proj.provider("qkvg", 4).name == expected


def _layers(n, packed, tp=8):
    return [_weights(tp, packed, seed=100 + i) for i in range(n)]


@pytest.mark.parametrize("m", [1, 4, 12, 16, 24, 32])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_graph_replay_equals_eager_bitwise(m, packed):
    """Several overlapped layers sharing one aux stream, captured; replays with new inputs equal eager (where each
    layer's stage is one launch up to 16 tokens, then QKVG with its side chain trailing)."""
    _check_replay_equals_eager(m, packed, Step(overlap=True))


# Tactics the autotuner chose on an H200 (benchmarks/RESULTS.md): one token's QKVG loads
# activations by bulk copies; 16 tokens' QKVG runs 48-row CTAs beside 126 split-K F_A/beta CTAs.
TUNED_TP8 = {
    ("qkvg", 6144, 7168, 1): Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True),
    ("fab", 144, 7168, 1): Tactic(16, 128, 16, 3, split_k=14),
    ("fb", 1536, 128, 1): Tactic(16, 128, 16, 2, x_via_l1=False),
    ("qkvg", 6144, 7168, 16): Tactic(48, 256, 16, 4, x_via_l1=False),
    ("fab", 144, 7168, 16): Tactic(16, 128, 16, 2, split_k=14),
    ("fb", 1536, 128, 16): Tactic(16, 128, 16, 4),
}


@pytest.mark.parametrize("m", [1, 2, 16])
def test_graph_replay_equals_eager_bitwise_with_tuned_tactics(m):
    """The same with those tactics: one token from the single-token bucket (activations by bulk copies), two and
    16 from the 16-token bucket."""
    g = preset("kimi-k3", 8)
    assert {(role, n, k) for role, n, k, _ in TUNED_TP8} == {
        ("qkvg", g.qkvg_rows, g.hidden_size), ("fab", g.fab_rows, g.hidden_size), ("fb", g.local_width, g.head_dim)}
    _check_replay_equals_eager(m, True, Step(overlap=True), TUNED_TP8)


# wgmma QKVG tactics as the autotuner keeps them on H200: without PDL at 64 tokens, with it at 128.
WGMMA_TP8 = {
    ("qkvg", 6144, 7168, 64): WgmmaTactic(64, 64, 64, 12, pdl=False),
    ("qkvg", 6144, 7168, 128): WgmmaTactic(64, 64, 128, 9),
}
# Tokens on the MMA's M side: 128 CTAs of 48 rows, a ring leaving the side chain room at 64 tokens, PDL at 128.
TOKENS_ON_M_TP8 = {
    ("qkvg", 6144, 7168, 32): WgmmaTactic(48, 64, 32, 8, tokens_on_m=True),
    ("qkvg", 6144, 7168, 64): WgmmaTactic(48, 64, 64, 8, tokens_on_m=True),
    ("qkvg", 6144, 7168, 128): WgmmaTactic(48, 64, 128, 7, tokens_on_m=True),
}
CUTE_QKVG_TORCH_SIDE_CHAIN = Step(overlap=True, qkvg="cute", fab="torch", fb="torch")


@pytest.mark.parametrize("m,step", [(40, Step(overlap=True)), (64, Step(overlap=True)),
                                    (100, CUTE_QKVG_TORCH_SIDE_CHAIN)], ids=["M40", "M64", "M100-torch-side-chain"])
def test_graph_replay_equals_eager_bitwise_with_wgmma_qkvg(m, step):
    """The wgmma QKVG kernel (token tile 40, 64 and 100 from the 64- and 128-token buckets), beside the CuTe side
    chain (trailing it on one stream in eager) or cuBLAS's."""
    assert isinstance(Plan(tactics=WGMMA_TP8).tactic_for("qkvg", 6144, 7168, m), WgmmaTactic)
    _check_replay_equals_eager(m, True, step, WGMMA_TP8)


@pytest.mark.parametrize("m,step", [(17, Step(overlap=True)), (40, Step(overlap=True)),
                                    (100, CUTE_QKVG_TORCH_SIDE_CHAIN)], ids=["M17", "M40", "M100-torch-side-chain"])
def test_graph_replay_equals_eager_bitwise_with_tokens_on_m_qkvg(m, step):
    """The wgmma kernel with the tokens on the MMA's M side (token tiles of 24, 40 and 104 tokens), beside the
    CuTe side chain or cuBLAS's."""
    assert Plan(tactics=TOKENS_ON_M_TP8).tactic_for("qkvg", 6144, 7168, m).tokens_on_m
    _check_replay_equals_eager(m, True, step, TOKENS_ON_M_TP8)


@pytest.mark.parametrize("tp", [4, 8], ids=lambda t: f"tp{t}")
def test_wgmma_qkvg_matches_reference_up_to_256_tokens(tp):
    """Above 64 tokens the wgmma kernel serves tactics a plan tuned (here its defaults, as tuned)."""
    w = _weights(tp, packed=False, seed=tp)
    g = w.geometry
    tactics = {("qkvg", g.qkvg_rows, g.hidden_size, b): default_wgmma_tactic(g.qkvg_rows, g.hidden_size, b)
               for b in (64, 128, 256)}
    proj = KDAProjection(w, dataclasses.replace(Plan.uniform(256, CUTE_QKVG_TORCH_SIDE_CHAIN), tactics=tactics))
    for m in (33, 72, 129, 200, 256):
        x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
        outs = proj(x, *projection_outputs(m, g, "cuda"))
        assert isinstance(proj.provider("qkvg", m).tactic(proj.gemm_call("qkvg", m)), WgmmaTactic)
        _assert_close_to_reference(outs, x, w)


FUSED_CUTE = Step(overlap=True, qkvg="cute", fab="cute", fb="cute", fused=True)


@pytest.mark.parametrize("m", [1, 17, 40, 64, 72, 96, 224])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_graph_replay_equals_eager_bitwise_with_the_fused_stage(m, packed):
    """The whole stage as one launch (QKVG's tiles and the side chain's on the SMs QKVG leaves; tokens on M up to 64,
    swap-AB above), the same launch eager and captured."""
    _check_replay_equals_eager(m, packed, FUSED_CUTE)


@pytest.mark.parametrize("m", [24, 72, 128])
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_graph_replay_equals_eager_bitwise_with_the_tp4_fused_stage(m, packed):
    """TP 4's fused stage: 96-row QKVG CTAs with tokens on M, in two consumer warpgroups above 64 tokens, F_B as a
    tail of 24 rows on each QKVG CTA; the same launch eager and captured."""
    _check_replay_equals_eager(m, packed, FUSED_CUTE, tp=4)


@pytest.mark.parametrize("m,step", [(16, Step(overlap=True)), (64, FUSED_CUTE)], ids=["overlap-M16", "fused-M64"])
def test_state_buffers_are_the_arrival_counters_at_rest_between_launches(m, step):
    """What an engine saves with its model's buffers before releasing its weights' memory (vLLM's sleep level 2,
    SGLang's memory saver) and writes back on resume: the arrival counters, zero between launches."""
    w = _weights(8, packed=True)
    proj = KDAProjection(w, Plan.uniform(m, step))
    proj.prepare([m])
    (counters,) = proj.state_buffers().values()
    assert counters is arrival_counters.arena(w.device)
    for _ in range(2):
        proj(torch.randn(m, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16))
        torch.cuda.synchronize()
        assert not counters.any()


@pytest.mark.parametrize("tp", [4, 8, 16], ids=lambda t: f"tp{t}")
def test_the_fused_stage_serves_tp4_tp8_and_tp16(tp):
    """TP 4's 96-row QKVG CTAs (tokens on M up to 128 tokens), TP 8's 48-row and TP 16's 24-row ones with a partial
    F_A/beta block (tokens on M, then swap-AB 8 rows wider with F_A/beta split in clusters up to 128 tokens) fuse
    and match the reference."""
    w = _weights(tp, packed=True, seed=tp)
    proj = KDAProjection(w, Plan.uniform(128, FUSED_CUTE))
    for m in (1, 24, 64, 96, 128):
        x = torch.randn(m, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
        _assert_close_to_reference(proj(x, *projection_outputs(m, w.geometry, "cuda")), x, w)
        assert proj.stage(m).mode == "fused"


@pytest.mark.parametrize("tp", [8, 16], ids=lambda t: f"tp{t}")
def test_the_fused_stage_serves_tp8_and_tp16_above_128_tokens(tp):
    """Swap-AB QKVG 8 rows wider than tokens on M would take, F_A/beta split in clusters, in the ring each token tile
    takes, up to 224 tokens; matches the reference."""
    w = _weights(tp, packed=True, seed=tp)
    proj = KDAProjection(w, Plan.uniform(224, FUSED_CUTE))
    for m in (136, 160, 224):
        x = torch.randn(m, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
        _assert_close_to_reference(proj(x, *projection_outputs(m, w.geometry, "cuda")), x, w)
        assert proj.stage(m).mode == "fused"


@pytest.mark.parametrize("m", [48, 96])
def test_the_fused_stage_without_f_b_computes_the_same_bits(m):
    """Where the host applies F_B itself, the fused stage still runs (F_B into a scratch buffer): qkvg and beta are
    the bits of a call with F_B."""
    w = _weights(8, packed=True)
    proj = KDAProjection(w, Plan.uniform(96, FUSED_CUTE))
    x = torch.randn(m, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
    qkvg, g1, beta = proj(x, *projection_outputs(m, w.geometry, "cuda"))
    _assert_close_to_reference((qkvg, g1, beta), x, w)
    qkvg_out, fab, _ = projection_outputs(m, w.geometry, "cuda")
    qkvg_alone, g1, beta_alone = proj(x, qkvg_out=qkvg_out, fab_out=fab, compute_fb=False)
    assert g1 is None and proj.stage(m).mode == "fused"
    assert torch.equal(qkvg, qkvg_alone) and torch.equal(beta, beta_alone)


@pytest.mark.parametrize("fb", ["torch", "cute"])
@pytest.mark.parametrize("m", [72, 128])
def test_a_sequential_step_with_a_packed_tactic_runs_one_cute_gemm_over_packed_weights(m, fb):
    """Above 64 tokens a sequential step whose QKVG is CuTe runs one GEMM over [QKVG; FAB] (131 swap-AB CTAs of 48
    rows at TP 8) and F_B after it, by cuBLAS or by a tuned mma.sync tactic in 64-token tiles; graph replay equals
    eager, both match the reference."""
    g = preset("kimi-k3", 8)
    tactics = {("qkvg", rows, g.hidden_size, 128): WgmmaTactic(48, 64, 128, 9) for rows in (g.qkvg_rows,
                                                                                           g.packed_rows)}
    tactics[("fb", g.local_width, g.head_dim, 128)] = Tactic(16, 128, 64, 2, pdl=True)
    step = Step(False, "cute", "torch", fb)
    proj = KDAProjection(_weights(8, packed=True), dataclasses.replace(Plan.uniform(256, step), tactics=tactics))
    assert proj._stage_pair(m)[1] is not None and proj.provider("fb", m).name == fb
    _check_replay_equals_eager(m, True, step, tactics)


def _check_replay_equals_eager(m, packed, step, tactics=None, tp=8):
    weights = _layers(3, packed, tp)
    plan = dataclasses.replace(Plan.uniform(256, step), tactics=tactics or {})
    projs = [KDAProjection(w, plan) for w in weights]
    for p in projs:
        p.prepare([m])
        if step.fused:
            assert p.stage(m).mode == "fused"
        elif step.overlap and step.fab != "torch":  # eager cannot fork: the side chain trails QKVG on one stream
            assert p.stage(m).trailing is not None
            # An mma.sync QKVG over one token tile runs beside it in one launch (wgmma sums in another order).
            mma_sync = isinstance(p.provider("qkvg", m).tactic(p.gemm_call("qkvg", m)), Tactic)
            assert (p.stage(m).whole is not None) == (mma_sync and m <= 16)
    g = weights[0].geometry
    x_static = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)

    # A sequential step over packed weights runs its packed form only into buffers of its own (the engines' call).
    own_buffers = packed and not step.overlap and not step.fused

    def model(x):
        """Every layer's outputs, written into NaN-poisoned buffers (inside the graph, poisoned at each replay), or
        into the projection's own where the packed form serves."""
        outs = []
        for p in projs:
            qkvg, g1, beta = p(x) if own_buffers else p(x, *projection_outputs(m, g, "cuda"))
            outs.append((qkvg, g1, beta))
            x = (x.float() * 0.5 + qkvg[:, :1].float()).to(x.dtype)
        return outs

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        model(x_static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = model(x_static)
    for trial in range(3):
        x_new = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
        x_static.copy_(x_new)
        graph.replay()
        torch.cuda.synchronize()
        eager = model(x_new)
        for layer, (c, e) in enumerate(zip(captured, eager)):
            for name, a, b in zip(("qkvg", "g1", "beta"), c, e):
                assert torch.equal(a, b), f"trial {trial} layer {layer} {name} differs"
        _assert_close_to_reference(eager[0], x_new, weights[0])


def test_one_launch_stage_that_differs_from_its_launches_is_not_used(monkeypatch, kda_log):
    """The one-launch stage is checked on first use against the separate launches: one whose kernel writes nothing
    gives one warning, and eager calls launch QKVG and trail the side chain, with the reference's results."""
    real_get = compiled_gemms.get
    monkeypatch.setattr(compiled_gemms, "get", lambda key, folder=None: (lambda *operands: None) if isinstance(
        key, StageKey) else real_get(key, folder))
    w = _weights(8, packed=False, seed=5)
    proj = KDAProjection(w, Plan.uniform(16, Step(overlap=True)))
    proj.prepare([4])
    assert proj.stage(4).whole is None and proj.stage(4).trail is not None
    warnings = [m for m in kda_log.messages() if "in one launch" in m]
    assert len(warnings) == 1 and "qkvg differs from its separate launch" in warnings[0]
    x = torch.randn(4, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
    _assert_close_to_reference(proj(x), x, w)


def test_overlap_forks_only_inside_capture():
    w = _weights(8, packed=False)
    proj = KDAProjection(w, Plan.uniform(16, Step(overlap=True)))
    proj.prepare([4])
    calls = []
    scheduler = proj.stage(4).scheduler
    real = scheduler.run

    def spy(main, side, aux):
        calls.append(aux)
        real(main, side, aux)

    scheduler.run = spy
    x = torch.randn(4, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
    proj(x)
    assert calls == []
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        proj(x)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        proj(x)
    assert len(calls) == 1 and calls[0] != torch.cuda.current_stream()


def test_aux_stream_aliasing_the_capture_stream_does_not_fork(kda_log):
    """Pooled streams can alias: an aux stream that is the capture stream must not fork (one warning), and the
    captured graph still computes the eager results."""
    w = _weights(8, packed=False)
    shared = torch.cuda.Stream()
    proj = KDAProjection(w, Plan.uniform(16, Step(overlap=True)), aux_stream=shared)
    proj.prepare([4])
    x = torch.randn(4, w.geometry.hidden_size, device="cuda", dtype=torch.bfloat16)
    eager = proj(x)
    forks = []
    proj.stage(4).scheduler.run = lambda main, side, aux: forks.append(aux)
    shared.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=shared):
        captured = proj(x)
    graph.replay()
    torch.cuda.synchronize()
    assert forks == [] and sum("without a fork" in m for m in kda_log.messages()) == 1
    assert all(torch.equal(a, b) for a, b in zip(captured, eager))


def test_autotuner_times_the_stage_without_a_fork():
    """``autotune.time_trailing`` builds serving projections and times QKVG with the side chain trailing it inside
    a CUDA graph (tokens-on-M wgmma QKVG at M = 48); ``None`` where the provider builds no such form (QKVG and
    F_A/beta both split K: they would share the stream's arrival counters)."""
    from kda_backend import autotune

    g = preset("kimi-k3", 8)
    weights = autotune.make_weight_copies(g, torch.device("cuda"), copies=2)
    side_chain = {("fab", g.fab_rows, g.hidden_size, 64): Tactic(16, 128, 64, 2, split_k=8, x_via_l1=False),
                  ("fb", g.local_width, g.head_dim, 64): Tactic(16, 128, 64, 2, x_via_l1=False)}
    qkvg_key = ("qkvg", g.qkvg_rows, g.hidden_size, 64)
    wgmma = WgmmaTactic(48, 64, 64, 8, tokens_on_m=True).for_tokens(64)
    seconds = autotune.time_trailing(weights, 48, {qkvg_key: wgmma, **side_chain})
    assert seconds is not None and 0 < seconds < 1e-3
    split = Tactic(48, 256, 64, 2, split_k=2, x_via_l1=False)  # 128 tiles: within the arrival counters
    assert autotune.time_trailing(weights, 48, {qkvg_key: split, **side_chain}) is None
