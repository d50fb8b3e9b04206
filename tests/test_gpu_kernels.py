"""The CuTe DSL kernel alone on the GPU: every role and TP size, strided f_a input, bad input errors, the provider's
launchers (inside CUDA graphs too), the trailing side chain, N not a multiple of 16 (a partial last row block)."""

import dataclasses

import pytest
import torch
from numerics import SENTINEL, assert_close, guarded

from kda_backend.geometry import preset
from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import SideChainKey, compiled_gemms, kernel_key
from kda_backend.kernels.occupancy import SmBudget, spare_slot_tactics
from kda_backend.kernels.side_chain_gemm import why_not_one_launch
from kda_backend.kernels.skinny_gemm import Tactic, block_t_for, default_tactic, output_tiles
from kda_backend.kernels.tactics import tactic_bucket
from kda_backend.plan import Plan
from kda_backend.providers.base import GemmCall
from kda_backend.providers.cute_provider import CuteDslProvider, launch, trailing_calls


class TunedProvider(CuteDslProvider):
    """The CuTe provider whose every call, plain runs too, carries a plan's tactic, as the projection's calls do."""

    def __init__(self, tactics):
        super().__init__()
        self.plan = Plan(tactics=tactics)

    def tactic(self, call):
        tuned = self.plan.tactic_for(call.role, call.n, call.k, call.m)
        return super().tactic(dataclasses.replace(call, tuned=tuned))


pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("row_multiple", [16, 8], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16], ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("m", [1, 7, 16, 24, 64], ids=lambda m: f"M{m}")
def test_fb_reads_strided_f_a_in_place(tp, m, row_multiple):
    """F_B reads f_a inside F_A/beta's output, whose row stride is F_A/beta's rows as vLLM (16) or SGLang (8) pads
    them (SGLang: 152 at TP4, 136 at TP16)."""
    g = dataclasses.replace(preset("kimi-k3", tp), row_multiple=row_multiple)
    fab = torch.randn(m, g.fab_rows, device="cuda", dtype=torch.bfloat16)
    f_a = fab[:, : g.head_dim]
    w = torch.randn(*g.fb_shape, device="cuda", dtype=torch.bfloat16) * g.head_dim**-0.5
    out = torch.full((m, g.local_width), float("nan"), device="cuda", dtype=torch.bfloat16)
    CuteDslProvider().run("fb", f_a, w, out)
    ref = f_a.float() @ w.float().t()
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


def test_misaligned_pointer_rejected_before_launch():
    """By ``run``'s own check, and in a launcher's call by the TVM-FFI function's check of the pointer."""
    x = torch.randn(2, 7168 + 8, device="cuda", dtype=torch.bfloat16)[:, 1:7169]
    w = torch.randn(144, 7168, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(2, 144, device="cuda", dtype=torch.bfloat16)
    provider = CuteDslProvider()
    with pytest.raises(ValueError, match="x data pointer is not 16-byte aligned"):
        provider.run("fab", x, w, out)
    call = _gemm_call("fab", 2, 144, 7168, 7168 + 8)
    provider.prepare(call)
    with pytest.raises(ValueError, match="Misaligned Tensor data"):
        provider.launcher(call)(x, w, out)


def _gemm_call(role: str, m: int, n: int, k: int, x_row_stride: int) -> GemmCall:
    return GemmCall(role, m, n, k, torch.bfloat16, "cuda", torch.cuda.get_device_capability(), x_row_stride, k)


@pytest.mark.parametrize("tactic", [Tactic(16, 128, 16, 3, split_k=14), Tactic(16, 256, 16, 4)], ids=lambda t: t.key())
@pytest.mark.parametrize("m", [1, 16, 40], ids=lambda m: f"M{m}")
def test_launcher_equals_run_bitwise_and_keeps_one_workspace_per_stream(tactic, m):
    """A launcher computes what ``run`` does, bit for bit; its split-K workspace and counters are made once per
    stream (never per call); a graph captured on a side stream first seen inside the capture replays equal to
    eager, and leaves the counters at zero."""
    g = preset("kimi-k3", 8)
    tactic = dataclasses.replace(tactic, block_t=block_t_for(m))
    provider = _provider_with_fab(tactic)
    call = _gemm_call("fab", m, g.fab_rows, g.hidden_size, g.hidden_size)
    provider.prepare(call)
    run_gemm = provider.launcher(call)
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    expected = torch.full((m, g.fab_rows), float("nan"), device="cuda", dtype=torch.bfloat16)
    provider.run("fab", x, w, expected)
    out = torch.full_like(expected, float("nan"))
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(3):
        run_gemm(x, w, out)
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations, "a launch allocated memory"
    assert torch.equal(out, expected)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    captured = torch.full_like(expected, float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.graph(graph, stream=side):
        run_gemm(x, w, captured)
    for _ in range(2):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, expected)
    assert not arrival_counters.for_stream(side, 1).any()


@pytest.mark.parametrize("tactic", [Tactic(48, 256, 16, 6), Tactic(48, 128, 16, 12, x_via_l1=False),
                                    Tactic(48, 256, 32, 4), Tactic(48, 256, 64, 3),
                                    Tactic(16, 256, 16, 4, x_via_l1=False, x_tma=True),
                                    Tactic(48, 256, 32, 4, x_via_l1=False, x_tma=True),
                                    Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True),
                                    Tactic(48, 256, 64, 3, x_via_l1=False, x_bulk=True)],
                         ids=lambda t: t.key())
@pytest.mark.parametrize("m", [1, 9, 16, 40, 64], ids=lambda m: f"M{m}")
def test_qkvg_tactics_match_reference(tactic, m):
    """Tactics the autotuner may pick for QKVG: 48-row CTAs (one per SM for Kimi-K3 TP8) give each of two warps
    half of every token tile; TMA activation loads arrive zero-filled past M; bulk copies load the real rows only
    (64-token tiles: two rows per lane). A tactic serves any M (token tiles beyond its block_t spread over the
    grid)."""
    g = preset("kimi-k3", 8)
    provider = TunedProvider({("qkvg", g.qkvg_rows, g.hidden_size, block_t_for(m)): tactic})
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g.qkvg_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    out = torch.full((m, g.qkvg_rows), float("nan"), device="cuda", dtype=torch.bfloat16)
    provider.run("qkvg", x, w, out)
    ref = x.float() @ w.float().t()
    assert not out.isnan().any()
    assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.parametrize("path", ["x_tma", "x_bulk"])
@pytest.mark.parametrize("m", [1, 16, 40], ids=lambda m: f"M{m}")
def test_async_proxy_activations_in_the_side_chain(m, path):
    """TMA and bulk activation loads where the side chain needs them: split-K F_A/beta and F_B reading f_a inside
    the wider F_A/beta output (a 288-byte row stride)."""
    g = preset("kimi-k3", 8)
    bucket = block_t_for(m)
    provider = TunedProvider({
        ("fab", g.fab_rows, g.hidden_size, bucket):
            Tactic(16, 128, bucket, 2, x_via_l1=False, split_k=14, **{path: True}),
        ("fb", g.local_width, g.head_dim, bucket): Tactic(16, 128, bucket, 3, x_via_l1=False, **{path: True}),
    })
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    w_fab = torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    w_fb = torch.randn(*g.fb_shape, device="cuda", dtype=torch.bfloat16) * g.head_dim**-0.5
    fab = torch.full((m, g.fab_rows), float("nan"), device="cuda", dtype=torch.bfloat16)
    g1 = torch.full((m, g.local_width), float("nan"), device="cuda", dtype=torch.bfloat16)
    provider.run("fab", x, w_fab, fab)
    provider.run("fb", fab[:, : g.head_dim], w_fb, g1)
    for out, ref in ((fab, x.float() @ w_fab.float().t()), (g1, fab[:, : g.head_dim].float() @ w_fb.float().t())):
        assert not out.isnan().any()
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2


def _fab_provider(split_k: int, m: int, stages: int = 3) -> CuteDslProvider:
    return _provider_with_fab(Tactic(16, 128, block_t_for(m), stages, split_k=split_k))


def _provider_with_fab(tactic: Tactic) -> CuteDslProvider:
    g = preset("kimi-k3", 8)
    provider = TunedProvider({("fab", g.fab_rows, g.hidden_size, tactic.block_t): tactic})
    return provider


def _check_fab_reference_and_bits(provider: CuteDslProvider, m: int) -> None:
    """F_A/beta through ``provider``: right sums from poisoned outputs, the same bits in three runs, arrival
    counters left at zero."""
    g = preset("kimi-k3", 8)
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    outs = []
    for _ in range(3):
        out = torch.full((m, g.fab_rows), float("nan"), device="cuda", dtype=torch.bfloat16)
        provider.run("fab", x, w, out)
        outs.append(out)
    ref = x.float() @ w.float().t()
    assert not outs[0].isnan().any()
    assert ((outs[0].float() - ref).norm() / ref.norm()).item() <= 1e-2
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    counters = arrival_counters.for_stream(torch.cuda.current_stream(), 1)
    assert not counters.any(), "the last CTA of every tile must reset its arrival counter"


@pytest.mark.parametrize("stages", [2, 3])
@pytest.mark.parametrize("split_k", [1, 2, 7, 14])
@pytest.mark.parametrize("m", [1, 5, 16, 40])
def test_split_k_matches_reference_and_is_deterministic(split_k, m, stages):
    """The in-kernel split-K reduction: right sums, the same bits every run, arrival counters left at zero."""
    _check_fab_reference_and_bits(_fab_provider(split_k, m, stages), m)


@pytest.mark.parametrize("m", [1, 5, 16])
def test_spare_slot_f_a_beta_tactics_match_reference_and_are_deterministic(m):
    """Every F_A/beta tactic the autotuner may try in the slots QKVG's tuned tactic leaves free on this device (on
    H200: 12 CTAs of 48 rows, split-K 4, activations by L2, L1 or TMA)."""
    g = preset("kimi-k3", 8)
    qkvg = Tactic(16, 256, block_t_for(m), 4)
    main_ctas = output_tiles(qkvg, g.qkvg_rows, m)
    tactics = spare_slot_tactics(g.fab_rows, g.hidden_size, m, g.hidden_size, qkvg, main_ctas,
                                 SmBudget.of(torch.device("cuda")))
    if not tactics:
        pytest.skip("QKVG leaves no slot free for F_A/beta on this device")
    for tactic in tactics:
        _check_fab_reference_and_bits(_provider_with_fab(tactic), m)


def test_split_k_on_concurrent_streams_keeps_results_apart():
    """Two streams running the split-K kernel at once (each has its own counters) give their eager results."""
    g = preset("kimi-k3", 8)
    provider = _fab_provider(14, 4)
    w = torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    xs = [torch.randn(4, g.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    expected = []
    for x in xs:
        out = torch.full((4, g.fab_rows), float("nan"), device="cuda", dtype=torch.bfloat16)
        provider.run("fab", x, w, out)
        assert_close(out, x.float() @ w.float().t(), "fab")
        expected.append(out)
    streams = [torch.cuda.Stream() for _ in xs]
    outs = [[torch.full((4, g.fab_rows), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(50)]
            for _ in xs]
    torch.cuda.synchronize()
    for i in range(50):
        for s, (stream, x) in enumerate(zip(streams, xs)):
            with torch.cuda.stream(stream):
                provider.run("fab", x, w, outs[s][i])
    torch.cuda.synchronize()
    for s in range(2):
        assert all(torch.equal(out, expected[s]) for out in outs[s])


def test_kernel_loaded_from_disk_equals_freshly_compiled(tmp_path, monkeypatch):
    """The exported object file (what the next process loads, never compiling) computes exactly what the compiled
    kernel does."""
    from kda_backend.kernels import compile_cache
    from kda_backend.kernels.skinny_gemm import default_tactic

    g = preset("kimi-k3", 8)
    n, k = g.qkvg_rows, g.hidden_size
    key = compile_cache.kernel_key(default_tactic(n, k, 16), n, k, k, k, torch.device("cuda"))
    x = torch.randn(16, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    outs = []
    for _ in range(2):  # first: compiled and exported; second: a fresh cache, as in a new process, loads it
        cache = compile_cache.CompiledGemms()
        out = torch.full((16, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        cache.get(key, tmp_path)(x, w, out, None, None, None, None)
        outs.append(out)
        assert len(list((tmp_path / compile_cache.CODE_VERSION).glob("*.o"))) == 1
        monkeypatch.setattr(compile_cache, "compile_gemm", lambda key: pytest.fail("compiled again, not loaded"))
    assert not outs[0].isnan().any()
    assert torch.equal(outs[0], outs[1])
    ref = x.float() @ w.float().t()
    assert ((outs[1].float() - ref).norm() / ref.norm()).item() <= 1e-2


@pytest.mark.parametrize("fab_tactic", [Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14),
                                        Tactic(16, 128, 16, 2, x_via_l1=False, x_tma=True, split_k=7),
                                        Tactic(48, 128, 16, 4, x_via_l1=False, split_k=4),
                                        Tactic(48, 128, 16, 4, x_via_l1=False, x_tma=True, split_k=4),
                                        Tactic(48, 128, 16, 4, x_via_l1=False, x_bulk=True, split_k=4),
                                        Tactic(16, 256, 16, 4, x_via_l1=False)], ids=lambda t: t.key())
@pytest.mark.parametrize("m", [1, 16, 40], ids=lambda m: f"M{m}")
def test_trailing_side_chain_equals_the_plain_kernels_bitwise(fab_tactic, m, kda_log, monkeypatch):
    """F_A/beta and F_B trailing QKVG on one stream (the provider's trailing side chain with these tactics: one
    launch for the 16-row cp.async ones, which passes its first-use check, two for the others) compute exactly what
    the plain kernels do (what the forked side chain runs), and leave the chain counters at zero; one launcher
    serves both trailing runs."""
    fab_tactic = dataclasses.replace(fab_tactic, block_t=block_t_for(m))
    fb_tactic = Tactic(16, 128, block_t_for(m), 2, x_via_l1=False)
    one_launch = fab_tactic.block_n == 16 and not fab_tactic.x_tma
    assert (why_not_one_launch(fab_tactic, fb_tactic) is None) == one_launch
    one_launch_kernels = _record_one_launch_kernels(monkeypatch)
    _check_trailing_side_chain(m, fab_tactic, fb_tactic)
    assert not any("computed wrongly" in message for message in kda_log.messages())
    assert bool(one_launch_kernels) == one_launch


@pytest.mark.parametrize("fab_tactic", [Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14),
                                        Tactic(16, 256, 16, 4, x_via_l1=False)], ids=lambda t: t.key())
@pytest.mark.parametrize("m", [17, 40, 64], ids=lambda m: f"M{m}")
def test_side_chain_in_one_launch_over_several_token_tiles(fab_tactic, m, kda_log, monkeypatch):
    """The one-launch side chain with 16-token tiles over up to four of them, F_A/beta's tiles (with and without
    split-K) and F_B's each drawn by ticket: the plain kernels' bits, counters left at zero."""
    fb_tactic = Tactic(16, 128, 16, 3, x_via_l1=False)
    assert why_not_one_launch(fab_tactic, fb_tactic) is None
    one_launch_kernels = _record_one_launch_kernels(monkeypatch)
    _check_trailing_side_chain(m, fab_tactic, fb_tactic)
    assert not any("computed wrongly" in message for message in kda_log.messages()) and one_launch_kernels


def _record_one_launch_kernels(monkeypatch) -> list:
    """The keys of the one-launch side chains the provider fetches from now on (what its trailing launcher runs
    where its first-use check passes)."""
    fetched, real_get = [], compiled_gemms.get

    def get(key, folder=None):
        if isinstance(key, SideChainKey):
            fetched.append(key)
        return real_get(key, folder)

    monkeypatch.setattr(compiled_gemms, "get", get)
    return fetched


def test_one_launch_side_chain_that_computes_wrongly_runs_as_two_launches(monkeypatch, kda_log):
    """The one-launch side chain is checked on first use: one whose kernel writes nothing fails the check, one
    warning says so, and the side chain runs as two launches, with the plain kernels' bits."""
    real_get = compiled_gemms.get

    def get(key, folder=None):
        kernel = real_get(key, folder)
        return (lambda *operands: None) if isinstance(key, SideChainKey) else kernel

    monkeypatch.setattr(compiled_gemms, "get", get)
    fab_tactic, fb_tactic = Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14), Tactic(16, 128, 16, 2, x_via_l1=False)
    _check_trailing_side_chain(4, fab_tactic, fb_tactic)
    warnings = [message for message in kda_log.messages() if "computed wrongly" in message]
    assert len(warnings) == 1 and "NaN in its output" in warnings[0] and "runs as two launches" in warnings[0]


def _check_trailing_side_chain(m: int, fab_tactic: Tactic, fb_tactic: Tactic) -> None:
    """Three runs of QKVG and the side chain from NaN-poisoned outputs, the first with the plain kernels, then
    twice trailing (the provider's launcher with these tactics): fp32-close, bitwise equal, counters zero after."""
    g = preset("kimi-k3", 8)
    provider = TunedProvider({("fab", g.fab_rows, g.hidden_size, tactic_bucket(m)): fab_tactic,
                              ("fb", g.local_width, g.head_dim, tactic_bucket(m)): fb_tactic})
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    w_qkvg = torch.randn(g.qkvg_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    w_fab = torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5
    w_fb = torch.randn(*g.fb_shape, device="cuda", dtype=torch.bfloat16) * g.head_dim**-0.5
    runs = []
    for trailing in (False, True, True):
        qkvg, fab, g1 = (torch.full((m, c), float("nan"), device="cuda", dtype=torch.bfloat16)
                         for c in (g.qkvg_rows, g.fab_rows, g.local_width))
        launch(Tactic(16, 256, block_t_for(m), 4), x, w_qkvg, qkvg)
        if trailing:
            provider.trailing_launcher(trailing_calls(x, w_fab, fab, w_fb))(x, w_fab, fab, w_fb, g1)
        else:
            launch(fab_tactic, x, w_fab, fab)
            launch(fb_tactic, fab[:, : g.head_dim], w_fb, g1)
        runs.append((qkvg, fab, g1))
    torch.cuda.synchronize()
    fab = runs[0][1]
    f_a = fab[:, : g.head_dim]
    for out, ref in ((fab, x.float() @ w_fab.float().t()), (runs[0][2], f_a.float() @ w_fb.float().t())):
        assert not out.isnan().any()
        assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2
    assert all(torch.equal(a, b) for run in runs[1:] for a, b in zip(runs[0], run))
    assert not arrival_counters.chain_for_stream(torch.cuda.current_stream()).any()
    assert not arrival_counters.for_stream(torch.cuda.current_stream(), 1).any()
    assert len(provider._trailing) == 1


def _launch_with_guarded_workspace(tactic: Tactic, x: torch.Tensor, w: torch.Tensor, out: torch.Tensor):
    """``out = x @ w.T`` as :func:`~kda_backend.providers.cute_provider.launch` runs it, with a split-K workspace
    ``[split_k, M, N]`` that is NaN-poisoned and followed by guard memory; returns that guard (``None`` without
    split-K)."""
    (m, k), n = x.shape, w.shape[0]
    kernel = compiled_gemms.get(kernel_key(tactic, n, k, x.stride(0), w.stride(0), x.device))
    if tactic.split_k == 1:
        kernel(x, w, out, None, None, None, None)
        return None
    work, guard = guarded(tactic.split_k, m * n, torch.float32)
    counters = arrival_counters.for_stream(torch.cuda.current_stream(), output_tiles(tactic, n, m))
    kernel(x, w, out, work.view(tactic.split_k, m, n), counters, None, None)
    return guard


# (N, K, tactic or None for the default) with N % 16 == 8: the last 16-row tile lies half outside the weight.
PARTIAL_ROW_BLOCK_GEMMS = [
    (136, 7168, None),  # SGLang's F_A/beta at TP16: 16-row CTAs, split-K 14
    (136, 7168, Tactic(16, 128, 16, 2, x_via_l1=False, split_k=7)),
    (136, 7168, Tactic(48, 128, 16, 4, x_via_l1=False, split_k=4)),  # rows 48 + 48 + 40
    (136, 7168, Tactic(48, 128, 16, 4, x_via_l1=False, x_tma=True, split_k=4)),
    (136, 7168, Tactic(48, 128, 16, 4, x_via_l1=False, x_bulk=True, split_k=4)),
    (136, 7168, Tactic(16, 256, 16, 4)),  # no split, activations through L1
    (136, 7168, Tactic(48, 256, 16, 3, x_via_l1=False, x_tma=True)),
    (152, 7168, None),  # SGLang's F_A/beta at TP4
    (152, 7168, Tactic(32, 256, 16, 4)),  # rows 4 x 32 + 24
    (8, 128, None),  # one CTA, half of its rows
    (8, 1024, None),  # split-K over half a tile
    (24, 1024, None),
    (24, 1024, Tactic(32, 128, 16, 2)),  # one CTA, 24 of its 32 rows
]


@pytest.mark.parametrize("m", [1, 5, 16, 17, 40, 64], ids=lambda m: f"M{m}")
@pytest.mark.parametrize("n, k, tactic", PARTIAL_ROW_BLOCK_GEMMS,
                         ids=[f"N{n}-K{k}-{t.key() if t else 'default'}" for n, k, t in PARTIAL_ROW_BLOCK_GEMMS])
def test_partial_row_block_matches_reference_and_stays_in_bounds(n, k, tactic, m):
    """N a multiple of 8 but not of 16, by every load path, with and without split-K: fp32-close outputs from NaN
    outputs and workspaces, the same bits twice, nothing stored past the output or published past the workspace,
    arrival counters left at zero. The weight is followed by NaN rows, which a load past it would read."""
    tactic = dataclasses.replace(tactic or default_tactic(n, k, m), block_t=block_t_for(m))
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w_rows = torch.randn(n + 16, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
    w_rows[n:] = float("nan")
    w = w_rows[:n]
    outs = []
    for _ in range(2):
        out, out_guard = guarded(m, n)
        work_guard = _launch_with_guarded_workspace(tactic, x, w, out)
        torch.cuda.synchronize()
        assert (out_guard == SENTINEL).all(), "stored past the output"
        assert work_guard is None or (work_guard == SENTINEL).all(), "published past the split-K workspace"
        outs.append(out)
    ref = x.float() @ w.float().t()
    assert not outs[0].isnan().any()
    assert ((outs[0].float() - ref).norm() / ref.norm()).item() <= 1e-2
    assert torch.equal(outs[0], outs[1])
    assert not arrival_counters.for_stream(torch.cuda.current_stream(), 1).any()


@pytest.mark.parametrize("tp", [4, 16], ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("m", [1, 16, 17, 64], ids=lambda m: f"M{m}")
def test_partial_row_block_in_the_trailing_side_chain(tp, m):
    """SGLang's F_A/beta (152 rows at TP4, 136 at TP16) through the provider alone and trailing QKVG (signaling
    split-K): fp32-close from poisoned outputs, nothing stored past any output, the trailing side chain bitwise
    equal to the plain kernels, counters at zero."""
    g = dataclasses.replace(preset("kimi-k3", tp), row_multiple=8)
    assert g.fab_rows % 16 == 8
    w = {
        "qkvg": torch.randn(g.qkvg_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5,
        "fab": torch.randn(g.fab_rows, g.hidden_size, device="cuda", dtype=torch.bfloat16) * g.hidden_size**-0.5,
        "fb": torch.randn(*g.fb_shape, device="cuda", dtype=torch.bfloat16) * g.head_dim**-0.5,
    }
    x = torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    provider = CuteDslProvider()
    runs = {}
    for mode in ("plain", "trailing"):
        (qkvg, qkvg_guard), (fab, fab_guard), (g1, g1_guard) = (
            guarded(m, c) for c in (g.qkvg_rows, g.fab_rows, g.local_width))
        provider.run("qkvg", x, w["qkvg"], qkvg)
        if mode == "trailing":
            provider.trailing_launcher(trailing_calls(x, w["fab"], fab, w["fb"]))(x, w["fab"], fab, w["fb"], g1)
        else:
            provider.run("fab", x, w["fab"], fab)
            provider.run("fb", fab[:, : g.head_dim], w["fb"], g1)
        torch.cuda.synchronize()
        refs = (x.float() @ w["qkvg"].float().t(), x.float() @ w["fab"].float().t(),
                fab[:, : g.head_dim].float() @ w["fb"].float().t())
        for name, out, guard, ref in zip(("qkvg", "fab", "g1"), (qkvg, fab, g1), (qkvg_guard, fab_guard, g1_guard),
                                         refs):
            assert (guard == SENTINEL).all(), f"{mode}: stored past {name}"
            assert not out.isnan().any(), f"{mode}: {name}"
            assert ((out.float() - ref).norm() / ref.norm()).item() <= 1e-2, f"{mode}: {name}"
        runs[mode] = (fab, g1)
    assert all(torch.equal(a, b) for a, b in zip(runs["plain"], runs["trailing"]))
    assert not arrival_counters.chain_for_stream(torch.cuda.current_stream()).any()
    assert not arrival_counters.for_stream(torch.cuda.current_stream(), 1).any()
