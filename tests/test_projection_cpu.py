"""The projection stage through the public API on the CPU (torch provider), and provider dispatch."""

import logging
from types import SimpleNamespace

import pytest
import torch
from numerics import assert_close, poisoned, projection_outputs

from kda_backend import GemmProvider, KDAProjection, Plan, ProjectionWeights, Step, dispatch, hookimpl, register_plugin
from kda_backend.geometry import KDAGeometry, preset
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.providers.base import GemmCall
from kda_backend.reference import KDALayerWeights, reference_projection

TINY = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16, tp_size=1)


def _weights(geometry, seed=0, packed=False):
    gen = torch.Generator().manual_seed(seed)
    w = KDALayerWeights.random(geometry, gen)
    if packed:
        return ProjectionWeights.from_packed(torch.cat([w.w_qkvg, w.w_fab]), w.w_fb, geometry)
    return ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, geometry)


def _check_against_reference(proj, x):
    g = proj.geometry
    qkvg, g1, beta = proj(x)
    ref = reference_projection(x, proj.weights.w_qkvg, proj.weights.w_fab, proj.weights.w_fb, g)
    for name, out, expect in zip(("qkvg", "g1", "beta"), (qkvg, g1, beta), ref):
        assert out.dtype == x.dtype
        assert_close(out, expect, name)
    return qkvg, g1, beta


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
@pytest.mark.parametrize("m", [1, 2, 7, 16, 33])
def test_cpu_projection_matches_reference(m, packed):
    proj = KDAProjection(_weights(TINY, packed=packed))
    x = torch.randn(m, TINY.hidden_size).bfloat16()
    _check_against_reference(proj, x)


@pytest.mark.parametrize("tp", [8, 16], ids=lambda t: f"tp{t}")
def test_cpu_projection_k3_geometry(tp):
    g = preset("kimi-k3", tp)
    proj = KDAProjection(_weights(g, seed=tp, packed=True))
    _check_against_reference(proj, torch.randn(3, g.hidden_size).bfloat16())


def test_packed_path_is_one_mm_over_packed_weight():
    """Sequential torch over packed weights is bit-identical to the engines' own single GEMM."""
    w = _weights(TINY, packed=True)
    proj = KDAProjection(w)
    x = torch.randn(5, TINY.hidden_size).bfloat16()
    qkvg, g1, beta = proj(x)
    whole = x @ w.packed.t()
    g = TINY
    assert torch.equal(qkvg, whole[:, : g.qkvg_rows])
    assert torch.equal(beta, whole[:, g.qkvg_rows + g.head_dim : g.qkvg_rows + g.fab_rows_used])
    assert torch.equal(g1, whole[:, g.qkvg_rows : g.qkvg_rows + g.head_dim] @ w.w_fb.t())


def test_weight_views_share_storage():
    w = _weights(TINY, packed=True)
    assert w.w_qkvg.data_ptr() == w.packed.data_ptr()
    assert w.w_fab.data_ptr() == w.packed[TINY.qkvg_rows :].data_ptr()


def test_m_zero_returns_empty():
    proj = KDAProjection(_weights(TINY))
    qkvg, g1, beta = proj(torch.empty(0, TINY.hidden_size, dtype=torch.bfloat16))
    assert qkvg.shape == (0, TINY.qkvg_rows) and g1.shape == (0, TINY.local_width) and beta.shape == (0, 4)


@pytest.mark.parametrize(
    "x,match",
    [
        (torch.randn(2, 63).bfloat16(), r"x: shape \(2, 63\) != expected \[M, 64\]"),
        (torch.randn(2, 2, 64).bfloat16(), r"x: shape \(2, 2, 64\)"),
        (torch.randn(2, 64), r"x: dtype torch.float32 != weight dtype torch.bfloat16"),
        (torch.randn(64, 2).bfloat16().t(), r"x: stride \(1, 2\) must be unit along hidden"),
        ("not a tensor", r"^x: str; accepted: a torch.Tensor$"),
    ],
    ids=["hidden", "rank", "dtype", "stride", "type"],
)
def test_bad_input_named(x, match):
    proj = KDAProjection(_weights(TINY))
    with pytest.raises(TypeError if isinstance(x, str) else ValueError, match=match):
        proj(x)


@pytest.mark.parametrize(
    "which,match",
    [
        ("qkvg_shape", r"w_qkvg: shape \(10, 64\) != expected \(256, 64\)"),
        ("fab_dtype", r"w_fab: dtype torch.float32 != expected torch.bfloat16"),
        ("fb_stride", r"w_fb: stride"),
    ],
)
def test_bad_weights_named(which, match):
    g = TINY
    w = _weights(g)
    args = {"w_qkvg": w.w_qkvg, "w_fab": w.w_fab, "w_fb": w.w_fb}
    if which == "qkvg_shape":
        args["w_qkvg"] = w.w_qkvg[:10]
    elif which == "fab_dtype":
        args["w_fab"] = w.w_fab.float()
    else:
        args["w_fb"] = torch.randn(g.head_dim, g.local_width).bfloat16().t()
    with pytest.raises(ValueError, match=match):
        ProjectionWeights.from_split(geometry=g, **args)


class _Picky(GemmProvider):
    name, priority = "picky", 10

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def why_not(self, call):
        return None if call.role == "qkvg" else "serves qkvg only"

    def run(self, role, x, w, out):
        self.calls.append(role)
        if self.fail:
            raise RuntimeError("launch failed")
        torch.mm(x, w.t(), out=out)


class _Plugin:
    def __init__(self, provider):
        self.provider = provider

    @hookimpl
    def kda_gemm_providers(self):
        return [self.provider]


def test_dispatch_walks_priorities_and_logs_rejections_once(kda_log):
    picky = _Picky()
    register_plugin(_Plugin(picky), "picky")
    proj = KDAProjection(_weights(TINY))
    for _ in range(3):
        _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert proj.provider("qkvg", 4) is picky and proj.provider("fab", 4).name == "torch"
    assert picky.calls == ["qkvg"] * 3
    rejections = [m for m in kda_log.messages(logging.DEBUG) if "picky" in m and "skipped" in m]
    assert len(rejections) == 2 and all("serves qkvg only" in m for m in rejections)


def test_failing_automatic_provider_falls_back_with_one_warning(kda_log):
    picky = _Picky(fail=True)
    register_plugin(_Plugin(picky), "picky")
    proj = KDAProjection(_weights(TINY))
    for _ in range(2):
        _check_against_reference(proj, torch.randn(3, TINY.hidden_size).bfloat16())
    assert picky.calls == ["qkvg"]
    assert dispatch.broken_reason("picky") == "qkvg: RuntimeError: launch failed"
    warnings = [m for m in kda_log.messages() if "disabled" in m]
    assert len(warnings) == 1 and "picky" in warnings[0]


def test_forced_provider_fails_loudly(monkeypatch):
    register_plugin(_Plugin(_Picky(fail=True)), "picky")
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "qkvg=picky")
    proj = KDAProjection(_weights(TINY))
    with pytest.raises(RuntimeError, match="launch failed"):
        proj(torch.randn(3, TINY.hidden_size).bfloat16())


def test_pinned_provider_wins_over_the_plans_with_one_warning(monkeypatch, kda_log):
    picky = _Picky()
    register_plugin(_Plugin(picky), "picky")
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "qkvg=torch")
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(qkvg="picky", fab="torch", fb="torch")))
    for _ in range(2):
        _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert proj.provider("qkvg", 4).name == "torch" and picky.calls == []
    assert [m for m in kda_log.messages() if "pins" in m] == [
        "KDA_BACKEND_PROVIDER pins qkvg to 'torch'; the plan's 'picky' does not serve it"]


def test_forced_provider_that_rejects_names_reason(monkeypatch):
    register_plugin(_Plugin(_Picky()), "picky")
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "picky")
    with pytest.raises(ValueError, match="forced provider 'picky' cannot serve fab M=2: serves qkvg only"):
        KDAProjection(_weights(TINY))(torch.randn(2, TINY.hidden_size).bfloat16())


def test_forced_unknown_provider_names_registered(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "nope")
    with pytest.raises(ValueError, match=r"PROVIDER='nope': provider 'nope' is not registered; .*providers: "
                       r"cute, flashinfer, torch"):
        KDAProjection(_weights(TINY))(torch.randn(2, TINY.hidden_size).bfloat16())


def test_forced_bad_role(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "qkv=torch")
    with pytest.raises(ValueError, match=r"unknown role 'qkv'"):
        dispatch.forced_providers()


def test_plan_forced_provider_and_overlap_step_runs_sequentially_on_cpu():
    """A plan asking for overlap still runs (sequentially) where the host forbids forking."""
    picky = _Picky()
    register_plugin(_Plugin(picky), "picky")
    plan = Plan.uniform(8, Step(overlap=True, qkvg="picky", fab="torch", fb="torch"))
    proj = KDAProjection(_weights(TINY, packed=True), plan)
    _check_against_reference(proj, torch.randn(8, TINY.hidden_size).bfloat16())
    assert picky.calls == ["qkvg"]


def test_gemm_call_fields_for_fb_are_strided():
    proj = KDAProjection(_weights(TINY))
    call = proj.gemm_call("fb", 3)
    assert call == GemmCall(
        role="fb", m=3, n=TINY.local_width, k=TINY.head_dim, dtype=torch.bfloat16, device_type="cpu",
        capability=None, x_row_stride=TINY.fab_rows, w_row_stride=TINY.head_dim,
    )


def test_preallocated_outputs_are_written():
    """The caller's NaN-poisoned buffers come back as the outputs, every row and column the stage produces written
    with the fp32 reference's values (f_a too, the part of ``fab_out`` F_B reads)."""
    proj = KDAProjection(_weights(TINY, packed=True))
    g = TINY
    x = torch.randn(3, g.hidden_size).bfloat16()
    bufs = projection_outputs(3, g)
    qkvg, g1, beta = proj(x, *bufs)
    assert qkvg.data_ptr() == bufs[0].data_ptr() and g1.data_ptr() == bufs[2].data_ptr()
    assert beta.data_ptr() == bufs[1][:, g.head_dim :].data_ptr()
    w = proj.weights
    ref_qkvg, ref_g1, ref_beta = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, g)
    for name, out, expect in (("qkvg_out", bufs[0], ref_qkvg), ("g1_out", bufs[2], ref_g1),
                              ("fab_out beta", beta, ref_beta),
                              ("fab_out f_a", bufs[1][:, : g.head_dim], x.float() @ w.w_fab[: g.head_dim].float().t())):
        assert_close(out, expect, name)


@pytest.mark.parametrize(
    "which,buf,match",
    [
        (0, torch.empty(3, 5, dtype=torch.bfloat16), r"qkvg_out: shape \(3, 5\) != expected \(3, 256\)"),
        (1, torch.empty(3, 32, dtype=torch.float32), r"fab_out: torch.float32 on cpu"),
        (2, torch.empty(64, 3, dtype=torch.bfloat16).t(), r"g1_out: must be contiguous"),
        (2, torch.empty(3 * 64 + 1, dtype=torch.bfloat16)[1:].view(3, 64), r"g1_out: data pointer 0x[0-9a-f]+ is not "
         r"16-byte aligned; accepted: a buffer from torch's allocator or a view starting at a 16-byte boundary"),
    ],
)
def test_bad_output_buffers_named(which, buf, match):
    proj = KDAProjection(_weights(TINY))
    args = [None, None, None]
    args[which] = buf
    with pytest.raises(ValueError, match=match):
        proj(torch.randn(3, TINY.hidden_size).bfloat16(), *args)


class _NoCompile(_Picky):
    def why_not(self, call):
        return None

    def prepare(self, call):
        raise RuntimeError("ptxas died")


def test_provider_that_fails_to_compile_falls_back_with_one_warning(kda_log):
    register_plugin(_Plugin(_NoCompile()), "nocompile")
    proj = KDAProjection(_weights(TINY))
    _check_against_reference(proj, torch.randn(2, TINY.hidden_size).bfloat16())
    assert proj.provider("qkvg", 2).name == "torch"
    assert dispatch.broken_reason("picky") == "prepare failed: RuntimeError: ptxas died"
    assert len([m for m in kda_log.messages() if "disabled" in m]) == 1


def test_forced_provider_that_fails_to_compile_raises(monkeypatch):
    register_plugin(_Plugin(_NoCompile()), "nocompile")
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "picky")
    with pytest.raises(RuntimeError, match="ptxas died"):
        KDAProjection(_weights(TINY))(torch.randn(2, TINY.hidden_size).bfloat16())


class _Trailer(GemmProvider):
    """Serves every GEMM and the overlapped side chain behind its own QKVG launch (torch on the CPU), recording
    what it ran."""

    name, priority = "trailer", 60

    def __init__(self, fail=False):
        self.fail, self.calls = fail, []

    def why_not(self, call):
        return None

    def run(self, role, x, w, out):
        self.calls.append(role)
        torch.mm(x, w.t(), out=out)

    def why_not_trailing(self, calls):
        return None

    def trailing_launcher(self, calls):
        def trail(x, w_fab, fab, w_fb, g1):
            self.calls.append("trailing")
            if self.fail:
                raise RuntimeError("trail broke")
            torch.mm(x, w_fab.t(), out=fab)
            torch.mm(fab[:, : w_fb.shape[1]], w_fb.t(), out=g1)

        return trail


def test_overlapped_step_without_fork_trails_the_side_chain_behind_qkvg():
    """Where the host allows no fork (here: the CPU), an overlapped step's side chain trails QKVG's launch on the
    same stream when one provider serves all three GEMMs and can trail; otherwise it runs after QKVG."""
    trailer = _Trailer()
    register_plugin(_Plugin(trailer), "trailer")
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True)))
    proj.prepare([4])
    _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert trailer.calls == ["qkvg", "trailing"] and proj.stage(4).trailing is trailer
    mixed = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True, fab="torch", fb="torch")))
    _check_against_reference(mixed, torch.randn(4, TINY.hidden_size).bfloat16())
    assert mixed.stage(4).trailing is None and trailer.calls[2:] == ["qkvg"]


def test_failing_trailing_side_chain_falls_back_with_one_warning(kda_log):
    """A trailing side chain that fails marks its provider broken (one warning): the failing layer and every other
    then run their GEMMs without it and never ask it again."""
    provider = _Trailer(fail=True)
    register_plugin(_Plugin(provider), provider.name)
    for seed in (0, 1):  # the failing layer, then another
        proj = KDAProjection(_weights(TINY, seed=seed), Plan.uniform(8, Step(overlap=True)))
        _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert dispatch.broken_reason(provider.name) == "trailing side chain: RuntimeError: trail broke"
    assert provider.calls == ["qkvg", "trailing"]
    assert len([m for m in kda_log.messages() if "disabled" in m]) == 1


class _NoTrailing(_Trailer):
    name = "notrail"

    def trailing_launcher(self, calls):
        raise RuntimeError("trail does not build")


def test_trailing_side_chain_that_does_not_build_leaves_the_provider_serving_its_gemms(kda_log):
    """A trailing form that cannot be built costs only that form (one warning): the provider still serves the
    step's GEMMs, the side chain after QKVG."""
    provider = _NoTrailing()
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True)))
    _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert proj.stage(4).trailing is None and dispatch.broken_reason(provider.name) is None
    assert provider.calls == ["qkvg", "fab", "fb"]
    assert kda_log.messages() == ["provider 'notrail': the side chain trailing QKVG at M=4 not built (RuntimeError: "
                                  "trail does not build); without a fork the step runs its GEMMs one after another"]


def _whole_stage_on_cpu(x, w_qkvg, qkvg, w_fab, fab, w_fb, g1):
    """What a provider's one-launch or fused stage computes, with torch: qkvg, F_A/beta, then F_B from f_a."""
    torch.mm(x, w_qkvg.t(), out=qkvg)
    torch.mm(x, w_fab.t(), out=fab)
    torch.mm(fab[:, : w_fb.shape[1]], w_fb.t(), out=g1)


class _WholeStage(_Trailer):
    """A trailing provider that also launches the whole stage at once (torch on the CPU)."""

    name = "whole"

    def stage_launcher(self, calls):
        def whole(*operands):
            self.calls.append("whole")
            if self.fail:
                raise RuntimeError("stage broke")
            _whole_stage_on_cpu(*operands)

        return whole


def test_eager_call_launches_the_whole_stage_and_a_capture_trails_the_side_chain(monkeypatch):
    """Without a fork, an eager call runs the provider's one-launch stage; inside a capture (no fork either: a
    piecewise graph) the same step launches QKVG and trails its side chain, the form its tuned time is for."""
    provider = _WholeStage()
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True)))
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    _check_against_reference(proj, x)
    assert provider.calls == ["whole"] and proj.stage(4).whole is not None
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    _check_against_reference(proj, x)
    assert provider.calls == ["whole", "qkvg", "trailing"]
    provider.calls.clear()
    proj(x, compute_fb=False)  # no F_B: neither form, the GEMMs one after another
    assert provider.calls == ["qkvg", "fab"]


class _Fuser(_Trailer):
    """A provider that fuses the whole stage into one launch (torch on the CPU), or refuses with ``refuse``."""

    name = "fuser"

    def __init__(self, fail=False, refuse=None):
        super().__init__(fail)
        self.refuse = refuse

    def why_not_fused(self, calls):
        return self.refuse

    def fused_launcher(self, calls):
        self.calls.append(f"built at M={calls['qkvg'].m}")

        def fused(*operands):
            self.calls.append("fused")
            if self.fail:
                raise RuntimeError("fused broke")
            _whole_stage_on_cpu(*operands)

        return fused


def test_a_fused_step_runs_its_one_launch_eager_captured_and_without_f_b(monkeypatch):
    """A fused step launches the provider's fused stage on every path: eager, inside a capture, and without F_B
    (its output then goes to a scratch buffer, so F_A/beta comes from the same launch)."""
    provider = _Fuser()
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True, fused=True, qkvg="fuser", fab="fuser",
                                                                fb="fuser")))
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    _check_against_reference(proj, x)
    assert provider.calls == ["built at M=4", "fused"] and proj.stage(4).mode == "fused"
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    _check_against_reference(proj, x)
    (fab,) = poisoned((4, TINY.fab_rows))
    qkvg, g1, beta = proj(x, fab_out=fab, compute_fb=False)
    ref = reference_projection(x, proj.weights.w_qkvg, proj.weights.w_fab, proj.weights.w_fb, TINY)
    assert g1 is None and provider.calls[1:] == ["fused"] * 3
    assert_close(qkvg, ref[0], "qkvg")
    assert_close(beta, ref[2], "beta")


@pytest.mark.parametrize("step", [Step(overlap=True, fused=True, qkvg="fuser", fab="fuser", fb="fuser"),
                                  Step(overlap=True, fused=True, qkvg="fuser", fab="torch", fb="fuser")],
                         ids=["refused", "two-providers"])
def test_a_fused_step_that_cannot_fuse_runs_overlapped_with_one_warning(kda_log, step):
    provider = _Fuser(refuse="not on this device")
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, step))
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    for _ in range(2):
        _check_against_reference(proj, x)
    reason = "not on this device" if step.fab == "fuser" else "it must name one provider for all three GEMMs"
    warned = [m for m in kda_log.messages() if "fused projection stage at M=4 not taken" in m]
    assert len(warned) == 1 and reason in warned[0] and "the step runs overlapped" in warned[0]
    assert proj.stage(4).mode == "overlap" and "fused" not in provider.calls


def test_kda_backend_provider_pinning_another_provider_keeps_a_fused_step_unfused(monkeypatch, kda_log):
    provider = _Fuser()
    register_plugin(_Plugin(provider), provider.name)
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "fab=torch")
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True, fused=True, qkvg="fuser", fab="fuser",
                                                                fb="fuser")))
    _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert proj.stage(4).mode == "overlap" and "fused" not in provider.calls
    assert any("KDA_BACKEND_PROVIDER pins another provider than 'fuser'" in m for m in kda_log.messages())


def test_a_failing_fused_launch_drops_its_provider_and_the_step_runs_overlapped(kda_log):
    """A fused launch that raises marks its provider broken (one warning); the step then runs overlapped, here with
    the GEMMs the plan names, one after another on the CPU."""
    provider = _Fuser(fail=True)
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True, fused=True, qkvg="fuser", fab="fuser",
                                                                fb="fuser")))
    _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert dispatch.broken_reason(provider.name) == "fused stage: RuntimeError: fused broke"
    assert proj.stage(4).mode == "overlap" and provider.calls == ["built at M=4", "fused", "qkvg", "fab", "fb"]
    assert any("fused projection stage at M=4 not taken (provider 'fuser' is broken" in m for m in kda_log.messages())


class _NeverForks:
    """A host that never allows the fork outside its own capture (SGLang outside its capture mode)."""

    @hookimpl
    def kda_host_fork_allowed(self, device):
        return False


@pytest.mark.parametrize("for_tuning", [False, True], ids=["serving", "tuning"])
def test_a_tuning_candidate_forks_while_capturing_whatever_the_host_says(monkeypatch, for_tuning):
    """The autotuner times its candidates inside its own graphs in the forked form the engines' decode graphs run:
    a ``for_tuning`` projection forks exactly while a capture is open, even where the host (here one that never
    forks) would not, and builds no form for calls without a fork, so eager calls run its GEMMs one after another.
    A serving projection keeps asking the host, and trails its side chain where the host says no."""
    from kda_backend.overlap import OverlapScheduler

    provider = _WholeStage()
    register_plugin(_Plugin(provider), provider.name)
    register_plugin(_NeverForks(), "never-forks")
    aux = object()
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True)), aux_stream=aux, for_tuning=for_tuning)
    x = torch.randn(4, TINY.hidden_size).bfloat16()
    _check_against_reference(proj, x)  # eager, no capture open
    assert provider.calls == (["qkvg", "fab", "fb"] if for_tuning else ["whole"])
    assert (proj.stage(4).trailing is None) == for_tuning and (proj.stage(4).whole is None) == for_tuning

    forks = []

    def fork(self, main, side, aux_stream):
        forks.append(aux_stream)
        main()
        side()

    monkeypatch.setattr(OverlapScheduler, "run", fork)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: object())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: True))
    monkeypatch.setattr(torch.Tensor, "device", property(lambda t: torch.device("cuda", 0)))
    provider.calls.clear()
    proj.stage(4).run(x, proj.weights, *(torch.empty(4, c).bfloat16() for c in (TINY.qkvg_rows, TINY.fab_rows,
                                                                                   TINY.local_width)))
    assert forks == ([aux] if for_tuning else [])
    assert provider.calls == (["qkvg", "fab", "fb"] if for_tuning else ["qkvg", "trailing"])


def test_failing_whole_stage_falls_back_with_one_warning(kda_log):
    """A one-launch stage that raises marks its provider broken (one warning); the call is computed again without
    it."""
    provider = _WholeStage(fail=True)
    register_plugin(_Plugin(provider), provider.name)
    proj = KDAProjection(_weights(TINY), Plan.uniform(8, Step(overlap=True)))
    _check_against_reference(proj, torch.randn(4, TINY.hidden_size).bfloat16())
    assert dispatch.broken_reason(provider.name) == "one-launch stage: RuntimeError: stage broke"
    assert provider.calls == ["whole"]
    assert len([m for m in kda_log.messages() if "disabled" in m]) == 1


@pytest.mark.parametrize("step", [Step(overlap=False), Step(overlap=True)], ids=["sequential", "overlap"])
@pytest.mark.parametrize("packed", [True, False], ids=["packed", "split"])
def test_without_fb_no_fb_gemm_runs_and_the_rest_is_unchanged(step, packed):
    """``compute_fb=False`` (the host applies F_B itself): F_B never runs, qkvg and F_A/beta equal the full call's
    bit for bit, and the trailing side chain (which includes F_B) is not used."""
    trailer = _Trailer()
    register_plugin(_Plugin(trailer), trailer.name)
    proj = KDAProjection(_weights(TINY, packed=packed), Plan.uniform(8, step))
    x = torch.randn(5, TINY.hidden_size).bfloat16()
    (full_fab,) = poisoned((5, TINY.fab_rows))
    qkvg, g1, beta = proj(x, fab_out=full_fab)
    trailer.calls.clear()
    (fab,) = poisoned((5, TINY.fab_rows))
    qkvg2, g1_2, beta2 = proj(x, fab_out=fab, compute_fb=False)
    assert g1_2 is None and "fb" not in trailer.calls and "trailing" not in trailer.calls
    assert torch.equal(qkvg, qkvg2) and torch.equal(fab, full_fab) and torch.equal(beta, beta2)
    assert beta2.data_ptr() == fab[:, TINY.head_dim :].data_ptr()
    with pytest.raises(ValueError, match="g1_out: given with compute_fb=False"):
        proj(x, g1_out=torch.empty(5, TINY.local_width, dtype=torch.bfloat16), compute_fb=False)


def test_build_projection_names_bad_batch_sizes():
    from kda_backend import build_projection

    with pytest.raises(ValueError, match=r"batch_sizes: \[1, 'two'\]; accepted: positive integers"):
        build_projection(_weights(TINY), batch_sizes=[1, "two"])
    with pytest.raises(ValueError, match=r"batch_sizes: \[0, 4\]"):
        build_projection(_weights(TINY), batch_sizes=[0, 4])
    assert build_projection(_weights(TINY), batch_sizes=[4, 1]).plan.source == "cpu"


def _failing_build(monkeypatch):
    """Building a projection fails after the plan was resolved, as a kernel that does not compile would."""
    from kda_backend import serving

    built = []

    def fail(*args, **kwargs):
        built.append(args)
        raise RuntimeError("ptxas died")

    monkeypatch.setattr(serving, "KDAProjection", fail)
    return built


def test_serve_layer_that_cannot_build_leaves_the_engines_path_with_one_error(monkeypatch, kda_log):
    from kda_backend import serve_layer

    built = _failing_build(monkeypatch)
    layers = [torch.nn.Module() for _ in range(3)]
    assert [serve_layer(layer, _weights(TINY), batch_sizes=[1, 4]) for layer in layers] == [None] * 3
    assert len(built) == 1  # later layers of the same geometry do not try again
    assert all(not list(layer.buffers()) for layer in layers)
    assert kda_log.messages(logging.ERROR) == [
        "kda-backend could not build the KDA projection (tp_size=1) on cpu: RuntimeError: ptxas died; the engine's "
        "own projection serves this process's layers"]


@pytest.mark.parametrize("forced", [("KDA_BACKEND_PROVIDER", "torch"), ("KDA_BACKEND_PLAN", "sequential")],
                         ids=["provider-pinned", "plan-forced"])
def test_serve_layer_that_cannot_build_what_the_user_forced_raises(forced, monkeypatch):
    from kda_backend import serve_layer

    _failing_build(monkeypatch)
    monkeypatch.setenv(*forced)
    with pytest.raises(RuntimeError, match="ptxas died"):
        serve_layer(torch.nn.Module(), _weights(TINY))


def test_serve_layer_keeps_the_projections_state_as_non_persistent_buffers(monkeypatch):
    """The state an engine must restore after releasing its weights' memory rides on the layer as a buffer:
    ``named_buffers()`` (what vLLM's sleep and SGLang's memory saver save and restore) sees it once however many
    layers hold it, ``state_dict()`` (checkpoints) never."""
    from kda_backend import serve_layer

    counters = torch.zeros(4, 8, dtype=torch.int32)
    monkeypatch.setattr(KDAProjection, "state_buffers", lambda self: {"kda_arrival_counters": counters})
    model = torch.nn.ModuleDict({str(i): torch.nn.Linear(2, 2) for i in range(2)})
    projections = [serve_layer(layer, _weights(TINY)) for layer in model.values()]
    assert all(isinstance(p, KDAProjection) for p in projections)
    assert [(name, t is counters) for name, t in model.named_buffers()] == [("0.kda_arrival_counters", True)]
    assert not any("kda_arrival_counters" in key for key in model.state_dict())


def test_serves_only_the_plans_own_steps():
    """An engine keeps its own path where the plan has no step of its own: none tuned at or above M, or sequential
    cuBLAS (tuned there, or borrowed from the next larger tuned M), the baseline the engine's path matches."""
    from kda_backend.plan import SEQUENTIAL_TORCH

    plan = Plan(steps={4: Step(overlap=True), 8: SEQUENTIAL_TORCH, 16: Step(overlap=False)}, source="autotune")
    proj = KDAProjection(_weights(TINY), plan)
    assert [m for m in range(1, 20) if proj.serves(m)] == [1, 2, 3, 4, 9, 10, 11, 12, 13, 14, 15, 16]


def test_state_buffers_are_empty_off_cuda():
    assert KDAProjection(_weights(TINY)).state_buffers() == {}


class _Packer(_Picky):
    """Serves QKVG (on the CPU) and records the calls it builds launchers for."""

    name = "packer"

    def launcher(self, call):
        self.calls.append((call.n, call.tuned))
        return super().launcher(call)


@pytest.mark.parametrize("tuned", [True, False], ids=["packed-tactic", "no-packed-tactic"])
def test_a_sequential_step_runs_one_gemm_over_packed_weights_where_the_plan_tuned_it(tuned):
    """Over packed weights a sequential step whose QKVG provider is not torch runs the packed form (one GEMM over
    [QKVG; FAB] by that provider, F_B after) only where the plan tuned QKVG's tactic at the packed rows; output
    buffers (SGLang's F_A/beta one) take the step's separate GEMMs, which the autotuner also checks."""
    packer = _Packer()
    register_plugin(_Plugin(packer), packer.name)
    g = TINY
    tactic = WgmmaTactic(48, 64, 16, 9)
    tactics = {("qkvg", g.packed_rows, g.hidden_size, 16): tactic} if tuned else {}
    proj = KDAProjection(_weights(g, packed=True), Plan(steps={8: Step(False, "packer", "torch", "torch")},
                                                        tactics=tactics))
    x = torch.randn(4, g.hidden_size).bfloat16()
    _check_against_reference(proj, x)
    packed = proj._stage_pair(4)[1]
    assert (packed is not None) == tuned
    assert packer.calls == ([(g.qkvg_rows, None), (g.packed_rows, tactic), "qkvg"] if tuned
                            else [(g.qkvg_rows, None), "qkvg"])
    packer.calls.clear()
    (fab,) = poisoned((4, g.fab_rows))
    qkvg, g1, beta = proj(x, fab_out=fab)
    ref = reference_projection(x, proj.weights.w_qkvg, proj.weights.w_fab, proj.weights.w_fb, g)
    assert packer.calls == ["qkvg"]
    for name, out, expect in zip(("qkvg", "g1", "beta"), (qkvg, g1, beta), ref):
        assert_close(out, expect, name)


class _StridedFb(GemmProvider):
    """Serves F_B on the CPU with launchers bound to one activation row stride, as compiled kernels are: records the
    strides it builds launchers for, and each launch checks f_a's stride against its launcher's. ``packed_ok=False``:
    it refuses f_a inside the packed GEMM's output."""

    name, priority = "strided-fb", 10

    def __init__(self, packed_ok):
        self.packed_ok, self.strides = packed_ok, []

    def why_not(self, call):
        if call.role != "fb":
            return "serves fb only"
        return None if self.packed_ok or call.x_row_stride == TINY.fab_rows else "f_a row stride"

    def run(self, role, x, w, out):
        torch.mm(x, w.t(), out=out)

    def launcher(self, call):
        self.strides.append(call.x_row_stride)

        def launch(x, w, out):
            assert x.stride(0) == call.x_row_stride, (x.stride(), call.x_row_stride)
            self.run(call.role, x, w, out)

        return launch


@pytest.mark.parametrize("packed_ok", [True, False], ids=["fb-takes-packed-stride", "fb-refuses-it"])
def test_the_packed_form_binds_f_b_to_f_a_inside_the_packed_output(packed_ok):
    """In the packed form F_B reads f_a inside the [M, packed_rows] output: its launcher is built for that row
    stride, and where F_B's provider refuses it the step runs its GEMMs one after another, with the same outputs."""
    fb = _StridedFb(packed_ok)
    register_plugin(_Plugin(fb), fb.name)
    g = TINY
    proj = KDAProjection(_weights(g, packed=True), Plan(steps={8: Step(False, "torch", "torch", fb.name)}))
    _check_against_reference(proj, torch.randn(4, g.hidden_size).bfloat16())
    assert (proj._stage_pair(4)[1] is not None) == packed_ok
    assert fb.strides == ([g.fab_rows, g.packed_rows] if packed_ok else [g.fab_rows])


class _Doubling(GemmProvider):
    """Serves every GEMM on the CPU and gets it wrong: twice the product."""

    name, priority = "doubling", 70

    def why_not(self, call):
        return None

    def run(self, role, x, w, out):
        torch.mm(x, w.t(), out=out)
        out.mul_(2)


@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_autotuner_never_times_or_keeps_a_step_that_computes_wrongly(monkeypatch, packed):
    """Before a step is timed, the stage as wired runs once into NaN-poisoned buffers and once allocating its
    outputs, against the fp32 reference: every step that uses a provider that computes wrongly is reported and
    dropped, however fast, and the plan keeps the right ones."""
    from kda_backend import autotune

    register_plugin(_Plugin(_Doubling()), "doubling")
    timed = []

    def time_step(weights, step, m, tactics):
        timed.append(step)
        return 1e-6 if "doubling" in (step.qkvg, step.fab) else 2e-6

    monkeypatch.setattr(autotune, "time_step", time_step)
    lines = []
    plan, _ = autotune.tune_plan([_weights(TINY, packed=packed)], [2, 5], progress=lines.append)
    assert timed and not any("doubling" in (s.qkvg, s.fab, s.fb) for s in timed)
    assert all("doubling" not in (plan.step(m).qkvg, plan.step(m).fab) for m in (2, 5))
    assert any(line.startswith("M=2 seq:doubling/doubling dropped: qkvg: relative error") for line in lines)


@pytest.mark.parametrize("gain,kept", [(1.10, "cute"), (1.04, "torch")], ids=["clear-win", "narrow-win"])
def test_autotuner_keeps_sequential_cublas_unless_clearly_beaten(monkeypatch, gain, kept):
    """A step other than sequential cuBLAS (the engines' own eager path) is kept only where it is at least
    NATIVE_MARGIN faster; a narrower win falls within what one process's timing reads off another's."""
    from kda_backend import autotune
    from kda_backend.plan import SEQUENTIAL_TORCH

    monkeypatch.setattr(autotune, "step_candidates", lambda usable, fusing: [
        SEQUENTIAL_TORCH, Step(overlap=False, qkvg="cute", fab="torch", fb="torch")])
    monkeypatch.setattr(autotune, "step_error", lambda weights, step, m, tactics: None)
    monkeypatch.setattr(autotune, "time_step", lambda weights, step, m, tactics: (
        gain * 1e-6 if step == SEQUENTIAL_TORCH else 1e-6))
    lines = []
    plan, timings = autotune.tune_plan([_weights(TINY)], [96], progress=lines.append)
    assert plan.step(96).qkvg == kept and len(timings[96]) == 2
    assert lines[-1] == ("M=96: seq:cute/torch 1.00 us (sequential cuBLAS 1.10 us)" if kept == "cute" else
                         "M=96: seq:torch/torch 1.04 us (fastest seq:cute/torch 1.00 us, within 1.05x)")


class _DecodeSteps:
    """A decode-step timer answering fixed medians, microseconds per layer: ``{m: (plan, sequential cuBLAS)}``."""

    def __init__(self, medians, fail=None):
        self.medians, self.fail, self.timed = medians, fail, []

    def times(self, plans, m, rounds):
        if self.fail is not None:
            raise self.fail
        self.timed.append(m)
        ours, seq = self.medians[m]
        return {"plan": [ours + 5.0, ours, ours - 0.1][:rounds], "seq": [seq, seq + 5.0, seq - 0.1][:rounds]}


def test_autotuner_keeps_a_step_only_where_the_decode_step_gains(monkeypatch):
    """A step the projection stage chose is kept where the whole decode step under the plan is DECODE_STEP_MARGIN
    faster than under sequential cuBLAS (medians of the rounds), else sequential cuBLAS; sequential cuBLAS's own
    steps are not timed again."""
    from kda_backend import autotune
    from kda_backend.plan import SEQUENTIAL_TORCH

    fused = Step(overlap=True, fused=True, qkvg="cute", fab="cute", fb="cute")
    overlap = Step(overlap=True, qkvg="cute", fab="cute", fb="cute")
    plan = Plan(steps={1: fused, 64: overlap, 96: fused, 128: fused, 256: SEQUENTIAL_TORCH}, source="autotune")
    timer = _DecodeSteps({1: (65.0, 69.0), 64: (100.0, 100.4), 96: (216.95, 216.09), 128: (250.0, 251.25)})
    lines = []
    confirmed = autotune.confirm_in_decode_step(plan, timer, lines.append)
    assert timer.timed == [1, 64, 96, 128]
    assert [confirmed.step(m) for m in (1, 64, 96, 128, 256)] == [
        fused, SEQUENTIAL_TORCH, SEQUENTIAL_TORCH, fused, SEQUENTIAL_TORCH]
    assert confirmed.source == "autotune" and plan.step(64) == overlap, "the tuned plan itself is left as it was"
    assert lines == [
        "M=1 decode step: fused:cute/cute 65.00 us, sequential cuBLAS 69.00 us: kept",
        "M=64 decode step: ovl:cute/cute 100.00 us, sequential cuBLAS 100.40 us: sequential cuBLAS instead "
        "(within 1.005x)",
        "M=96 decode step: fused:cute/cute 216.95 us, sequential cuBLAS 216.09 us: sequential cuBLAS instead "
        "(within 1.005x)",
        "M=128 decode step: fused:cute/cute 250.00 us, sequential cuBLAS 251.25 us: kept",
    ]


@pytest.mark.parametrize("fail", [None, ModuleNotFoundError("No module named 'fla'")], ids=["runs", "fails"])
def test_autotune_confirms_its_plan_in_the_decode_step_or_warns(monkeypatch, kda_log, fail):
    """``autotune`` weighs the stage's choice in the decode step; where the decode step cannot run (fla-core
    missing), the stage's choice stands and one warning says so."""
    from kda_backend import autotune

    fused = Step(overlap=True, fused=True, qkvg="cute", fab="cute", fb="cute")
    tuned = Plan(steps={16: fused, 128: fused}, source="autotune")
    timer = _DecodeSteps({16: (80.0, 85.0), 128: (250.0, 249.0)}, fail)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(autotune, "make_weight_copies", lambda geometry, device: [])
    monkeypatch.setattr(autotune, "tune_tactics", lambda geometry, weights, buckets, progress: {})
    monkeypatch.setattr(autotune, "tune_plan", lambda weights, ms, progress, tactics: (tuned, {}))
    monkeypatch.setattr(autotune, "DecodeStepTimer", lambda geometry, device: timer)
    lines = []
    plan = autotune.autotune(TINY, torch.device("cpu"), [16, 128], progress=lines.append)
    autotune.autotune(TINY, torch.device("cpu"), [16, 128])
    if fail is None:
        assert (plan.step(16), plan.step(128).mode) == (fused, "sequential") and not kda_log.messages()
    else:
        assert plan is tuned
        assert lines[-1] == "decode step not timed: ModuleNotFoundError: No module named 'fla'"
        assert kda_log.messages() == [
            "autotune: the decode step did not run (ModuleNotFoundError: No module named 'fla'); the plan keeps the "
            "steps chosen by the projection stage's time alone"]


def test_layer_runs_the_plan_it_is_given():
    """``KimiK3DeltaAttention.use_plan`` swaps the projection's plan over the layer's own weights."""
    from kda_backend.layer import KimiK3DeltaAttention

    layer = KimiK3DeltaAttention(TINY, KDALayerWeights.random(TINY, torch.Generator().manual_seed(3)))
    plan = Plan(steps={4: Step(overlap=False, qkvg="torch", fab="torch", fb="torch")}, source="autotune")
    x = torch.randn(4, 1, TINY.hidden_size, dtype=torch.bfloat16)
    before = layer(x, *layer.new_state(4))
    layer.use_plan(plan)
    assert layer.projection.plan is plan and layer.projection.weights.w_qkvg.data_ptr() == layer.in_proj.data_ptr()
    assert all(torch.equal(a, b) for a, b in zip(before, layer(x, *layer.new_state(4))))


def test_decode_step_timer_times_the_forked_form_whatever_the_host_answers(monkeypatch):
    """The decode-step check times overlapped steps forked inside its graphs, as decode graphs run them, also where
    the host engine allows no fork at the time (SGLang at load): its layers' projections are the autotuner's kind."""
    from kda_backend import decode_step

    timed = []
    monkeypatch.setattr(decode_step, "graph_time_per_layer", lambda run, layers: timed.append(run(0)) or 1e-6)
    timer = decode_step.DecodeStepTimer(TINY, torch.device("cpu"), copies=2)
    assert timer.seconds_per_layer(Plan.uniform(4, Step(overlap=True)), 4) == 1e-6
    assert len(timed) == 1 and all(layer.projection.for_tuning for layer in timer.layers)


@pytest.mark.parametrize(
    "native_us,fused_us,kept,line",
    [
        (2.0, 1.008, "fused", "M=16: fused:cute/cute 1.01 us (fused wins the tie with ovl:cute/cute 1.00 us) "
                              "(sequential cuBLAS 2.00 us)"),
        (2.0, 1.02, "overlap", "M=16: ovl:cute/cute 1.00 us (sequential cuBLAS 2.00 us)"),
        (1.04, 1.008, "sequential", "M=16: seq:torch/torch 1.04 us (fastest ovl:cute/cute 1.00 us, within 1.05x)"),
        (1.056, 1.008, "overlap", "M=16: ovl:cute/cute 1.00 us (sequential cuBLAS 1.06 us)"),
    ],
    ids=["tie", "no-tie", "tie-within-the-native-margin", "tie-that-would-lose-the-native-margin"],
)
def test_autotuner_keeps_a_fused_step_that_ties_with_the_fastest(monkeypatch, native_us, fused_us, kept, line):
    """A fused step within FUSED_TIE of the fastest step is kept (one launch with or without a fork); a slower one
    is not, a tie never lifts a step past sequential cuBLAS's margin, and one the fused step would lose there is
    not taken (the fastest step, which clears the margin, is kept)."""
    from kda_backend import autotune
    from kda_backend.plan import SEQUENTIAL_TORCH

    overlap = Step(overlap=True, qkvg="cute", fab="cute", fb="cute")
    fused = Step(overlap=True, fused=True, qkvg="cute", fab="cute", fb="cute")
    times = {SEQUENTIAL_TORCH: native_us, overlap: 1.0, fused: fused_us}
    monkeypatch.setattr(autotune, "step_candidates", lambda usable, fusing: list(times))
    monkeypatch.setattr(autotune, "step_error", lambda weights, step, m, tactics: None)
    monkeypatch.setattr(autotune, "time_step", lambda weights, step, m, tactics: times[step] * 1e-6)
    lines = []
    plan, _ = autotune.tune_plan([_weights(TINY)], [16], progress=lines.append)
    assert plan.step(16).mode == kept
    assert lines[-1] == line


def test_autotuner_tunes_one_gemm_over_packed_weights_where_they_are_packed(monkeypatch):
    """Above 64 tokens the autotuner also times the wgmma tactics for one GEMM over the packed [QKVG; FAB] weight
    (131 swap-AB CTAs of 48 rows at TP 8) and keeps the fastest as QKVG's tactic at the packed rows; split weights
    get none."""
    from kda_backend import autotune

    g = preset("kimi-k3", 8)
    timed = []

    def time_tactic(weights, role, tactic, m):
        timed.append((role, m))
        return 1e-6 if tactic.padded_rows else 2e-6

    monkeypatch.setattr(autotune, "verified", lambda weights, role, cands, ms, progress: cands)
    monkeypatch.setattr(autotune, "time_tactic", time_tactic)
    lines = []
    table = autotune._packed_tactic([SimpleNamespace(geometry=g, packed=object())], 128, lines.append)
    assert table == {("qkvg", g.packed_rows, g.hidden_size, 128): WgmmaTactic(48, 64, 128, 9)}
    assert {role for role, _ in timed} == {autotune.PACKED} and {m for _, m in timed} == {96, 128}
    assert lines == [lines[0]] and lines[0].startswith("tactic packed t128 wgmma: w48k64t128s9p M=96 1.00 us")
    assert autotune._packed_tactic([SimpleNamespace(geometry=g, packed=None)], 128, lines.append) == {}


def test_autotuner_checks_and_times_its_candidates_as_tuning_projections(monkeypatch):
    """Every projection the autotuner builds to check or time a step is a ``for_tuning`` one (forked by the capture
    alone, see above), so a host's answer outside its own captures never decides the form that is timed."""
    from kda_backend import autotune

    made, real = [], autotune.KDAProjection

    def projection(*args, **kwargs):
        made.append(kwargs.get("for_tuning", False))
        return real(*args, **kwargs)

    monkeypatch.setattr(autotune, "KDAProjection", projection)
    monkeypatch.setattr(autotune, "graph_time_per_layer", lambda layer, layers: (layer(0), 1e-6)[1])
    weights = [_weights(TINY, seed=seed) for seed in (0, 1)]
    assert autotune.step_error(weights, Step(overlap=True), 4, {}) is None
    assert autotune.time_step(weights, Step(overlap=True), 4, {}) == 1e-6
    assert made == [True] * 3
