"""On the GPU: SGLang's breakable CUDA graphs, emulated with the core alone (SGLang cannot be installed on the GPU
machine), over several Kimi-K3 KDA layers built as the SGLang adapter builds them.

SGLang's breakable capture (model_executor/runner_backend_utils/breakable_cuda_graph) records a forward as a
sequence of CUDA graphs, its segments, in one memory pool, separated by eager breaks: a break ends the current
segment, runs eagerly (once at capture, again after that segment at every replay) and starts the next. SGLang's own
projection overlap forks there (its gate is capture mode or a breakable graph), and so does the adapter's host
(``SglangHost.kda_host_fork_allowed``): the projection joins its fork before it returns, so the fork never crosses
a segment boundary. Each emulated layer is one segment holding the projection, forked onto the model's aux stream,
followed by an eager break standing for the attention core, which reads the projection's outputs.

Replays with changed inputs must equal the eager forward (no graph, no fork) bit for bit, in both of SGLang's
``defer_f_b`` modes (``compute_fb=False``: F_B left to SGLang's fused decode) and with SGLang's [f_a | b] padding
at TP8 (144 rows) and TP16 (136 rows).
"""

import dataclasses

import pytest
import torch
from numerics import assert_close

from kda_backend import ProjectionWeights, build_projection, hookimpl, overlap, register_plugin, unregister_plugin
from kda_backend.geometry import preset
from kda_backend.reference import KDALayerWeights, reference_projection

pytestmark = pytest.mark.gpu
BATCH_SIZES = (1, 2, 4, 8, 16)
LAYERS = 3
# SGLang pads the merged [f_a | b] weight to a multiple of 8 rows (the adapter's geometry does the same).
SGLANG_FAB_ROW_MULTIPLE = 8


class _SglangLikeHost:
    """Answers as the adapter's ``SglangHost``: a fork is allowed in SGLang's capture mode or inside a breakable
    graph (SGLang's ``get_is_capture_mode()``)."""

    def __init__(self) -> None:
        self.capture_mode = False
        self.in_breakable_graph = False

    @hookimpl
    def kda_host_fork_allowed(self, device):
        return self.capture_mode or self.in_breakable_graph


class _BreakableGraph:
    """One batch size's captured forward: segments (CUDA graphs sharing ``pool``) and the eager breaks between."""

    def __init__(self, pool, stream: torch.cuda.Stream) -> None:
        self.pool, self.stream = pool, stream
        self.segments: list[torch.cuda.CUDAGraph] = []
        self.breaks = []
        self._open: torch.cuda.CUDAGraph | None = None

    def capture(self, forward, *args):
        """Capture ``forward(*args, breaker=self)`` on the capture stream; returns its (static) outputs."""
        torch.cuda.synchronize()
        with torch.cuda.stream(self.stream):
            self._begin()
            try:
                return forward(*args, breaker=self)
            finally:
                self._end()

    def eager_break(self, fn, *args):
        """As SGLang's ``eager_on_graph``: end the segment, run ``fn`` eagerly (its output, allocated outside any
        graph, becomes the static input of the next segment), record it for replay, start the next segment."""
        self._end()
        out = fn(*args)
        self.breaks.append(lambda: out.copy_(fn(*args)))
        self._begin()
        return out

    def replay(self) -> None:
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < len(self.breaks):
                self.breaks[i]()

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self.pool)

    def _end(self) -> None:
        self._open.capture_end()
        self.segments.append(self._open)
        self._open = None


def _attention_core(x, qkvg, fab, head_dim):
    """The eager break: reads the projection's outputs (a stand-in for the KDA core) and makes the next input."""
    return (x.float() * 0.5 + qkvg[:, :1].float() + fab[:, :1].float() + fab[:, head_dim : head_dim + 1].float()
            ).to(x.dtype)


def _model(projections, compute_fb):
    """``run(x, breaker=None)``: the layers in order, each projection in its own segment, an eager break after it,
    then the model's tail (a stand-in for the final norm) in the last segment. Returns per layer
    ``(qkvg, fab, g1)`` (``g1`` only with ``compute_fb``) and the tail's output."""

    def run(x, breaker=None):
        outs = []
        for p in projections:
            g = p.geometry
            fab = x.new_empty(x.shape[0], g.fab_rows)
            qkvg, g1, _ = p(x, fab_out=fab, compute_fb=compute_fb)
            outs.append((qkvg, fab) if g1 is None else (qkvg, fab, g1))
            x = (_attention_core(x, qkvg, fab, g.head_dim) if breaker is None
                 else breaker.eager_break(_attention_core, x, qkvg, fab, g.head_dim))
        return outs, (x.float() * 2).to(x.dtype)

    return run


def _assert_all_equal(got, expected, what):
    for layer, (a_out, b_out) in enumerate(zip(got[0], expected[0], strict=True)):
        for name, a, b in zip(("qkvg", "fab", "g1")[: len(a_out)], a_out, b_out, strict=True):
            assert not a.isnan().any(), f"{what}: layer {layer} {name} has NaN"
            assert torch.equal(a, b), f"{what}: layer {layer} {name} differs"
    assert torch.equal(got[1], expected[1]), f"{what}: the tail's output differs"


@pytest.fixture
def forks(monkeypatch):
    """Every fork the projections make: whether the current stream was being captured at the time."""
    seen = []
    real = overlap.OverlapScheduler.run

    def counting(self, main, side, aux_stream):
        seen.append(torch.cuda.is_current_stream_capturing())
        return real(self, main, side, aux_stream)

    monkeypatch.setattr(overlap.OverlapScheduler, "run", counting)
    return seen


@pytest.mark.parametrize("compute_fb", [True, False], ids=["f_b", "defer_f_b"])
@pytest.mark.parametrize("tp", [8, 16], ids=["tp8", "tp16"])
def test_breakable_capture_replays_equal_to_eager(tp, compute_fb, forks, monkeypatch):
    g = dataclasses.replace(preset("kimi-k3", tp), row_multiple=SGLANG_FAB_ROW_MULTIPLE)
    assert g.fab_rows == {8: 144, 16: 136}[tp]
    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")  # fork at every M (no tuned plan on a fresh machine)
    host = _SglangLikeHost()
    register_plugin(host, "sglang-like-host")
    try:
        alt = torch.cuda.Stream()  # the model's bfa_alt_stream, shared by every layer
        layers = [KDALayerWeights.random(g, torch.Generator().manual_seed(300 + i), device="cuda")
                  for i in range(LAYERS)]
        projections = [
            build_projection(ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, g), aux_stream=alt,
                             batch_sizes=BATCH_SIZES)
            for w in layers
        ]
        model = _model(projections, compute_fb)
        inputs = {bs: torch.randn(bs, g.hidden_size, device="cuda").bfloat16() for bs in BATCH_SIZES}
        eager = {bs: model(x) for bs, x in inputs.items()}
        assert forks == [], "eager serving must not fork"

        capture_stream, pool, graphs, outputs = torch.cuda.Stream(), torch.cuda.graph_pool_handle(), {}, {}
        capture_stream.wait_stream(torch.cuda.current_stream())
        host.in_breakable_graph = True
        try:
            for bs in sorted(inputs, reverse=True):
                with torch.cuda.stream(capture_stream):
                    warm = model(inputs[bs])  # eager inside the breakable context: forks, joined at once
                capture_stream.synchronize()
                _assert_all_equal(warm, eager[bs], f"warm-up bs={bs}")
                graphs[bs] = _BreakableGraph(pool, capture_stream)
                outputs[bs] = graphs[bs].capture(model, inputs[bs])
        finally:
            host.in_breakable_graph = False
        torch.cuda.current_stream().wait_stream(capture_stream)
        # Per batch size: each layer's warm-up forks eagerly, then each captured layer forks inside its segment.
        assert forks == ([False] * LAYERS + [True] * LAYERS) * len(BATCH_SIZES)
        for bs, graph in graphs.items():
            assert (len(graph.segments), len(graph.breaks)) == (LAYERS + 1, LAYERS), bs

        gen = torch.Generator(device="cuda").manual_seed(11)
        for trial in range(2):
            for bs in BATCH_SIZES:
                x_new = torch.randn(bs, g.hidden_size, device="cuda", generator=gen).bfloat16()
                static_outs, static_tail = outputs[bs]
                for out in static_outs:
                    for t in out:
                        t.fill_(float("nan"))  # the replay must write every output
                static_tail.fill_(float("nan"))
                inputs[bs].copy_(x_new)
                host.in_breakable_graph = True  # SGLang replays inside the breakable context too
                try:
                    graphs[bs].replay()
                finally:
                    host.in_breakable_graph = False
                torch.cuda.synchronize()
                _assert_all_equal(outputs[bs], model(x_new), f"replay trial {trial} bs={bs}")
                first = layers[0]
                ref = reference_projection(x_new, first.w_qkvg, first.w_fab, first.w_fb, g)
                assert_close(static_outs[0][0], ref[0], f"qkvg bs={bs}")
                # f_a, beta and the zero rows SGLang pads [f_a | b] to: what its fused decode reads.
                assert_close(static_outs[0][1], x_new.float() @ first.w_fab.float().t(), f"fab bs={bs}")
                if compute_fb:
                    assert_close(static_outs[0][2], ref[1], f"g1 bs={bs}")
        assert len(forks) == 2 * LAYERS * len(BATCH_SIZES), "replays and eager serving never fork"
    finally:
        unregister_plugin("sglang-like-host")
