"""On the GPU: vLLM's breakable CUDA-graph capture, emulated with the core alone (vLLM cannot be installed on the
GPU machine), over several Kimi-K3 TP8 layers sharing one aux stream.

vLLM 0.33 captures Kimi-K3's mixed (prefill) batches as breakable graphs (``vllm/compilation/breakable_cudagraph.py``):
on the model runner's non-default stream, one capture context records graph segments from one shared pool; every
``@eager_break_during_capture`` op (the KDA layer's ``_forward``) ends the current segment, runs eagerly on the
tensors it is given and starts a new segment; replay runs the segments' graphs and the eager ops in order, the eager
ops on the same tensors again. The adapter's host (``kda_vllm.injection.VllmHost``) allows the projection's fork
while the stream is capturing, so each layer's projection forks inside a segment and joins before it returns,
before the layer's eager break. Replays with changed inputs must equal eager bit for bit.
"""

import pytest
import torch
from numerics import assert_close, packed_kimi_k3_layers

from kda_backend import build_projection, hookimpl, plugins
from kda_backend.reference import reference_projection

pytestmark = pytest.mark.gpu
BATCH_SIZES = (1, 2, 8, 16, 64)
LAYERS = 3


class _VllmLikeHost:
    """Answers as ``VllmHost`` does: a fork while the current stream is capturing (a FULL graph or a breakable
    graph's segment), never outside. Counts the forks it allows."""

    def __init__(self) -> None:
        self.stream = torch.cuda.Stream()
        self.allowed = 0

    @hookimpl
    def kda_host_fork_allowed(self, device):
        capturing = torch.cuda.is_current_stream_capturing()
        self.allowed += capturing
        return capturing

    @hookimpl
    def kda_host_aux_stream(self, device):
        return self.stream


class _BreakableCapture:
    """vLLM's ``BreakableCUDAGraphCapture``: graph segments captured on the current stream into one pool; an eager
    break ends the segment, runs its function, keeps it for replay and begins the next segment."""

    def __init__(self, pool) -> None:
        self.pool = pool
        self.segments: list = []
        self.graphs = self.eager_breaks = 0
        self._graph: torch.cuda.CUDAGraph | None = None

    def __enter__(self) -> "_BreakableCapture":
        self._begin()
        return self

    def __exit__(self, *exc) -> None:
        self._end()

    def _begin(self) -> None:
        self._graph = torch.cuda.CUDAGraph()
        self._graph.capture_begin(pool=self.pool)

    def _end(self) -> None:
        self._graph.capture_end()
        self.segments.append(self._graph.replay)
        self.graphs += 1

    def eager(self, fn) -> None:
        self._end()
        fn()
        self.segments.append(fn)
        self.eager_breaks += 1
        self._begin()

    def replay(self) -> None:
        for segment in self.segments:
            segment()


def _kda_core(qkvg, g1, beta, out):
    """Stands for the layer's ``_forward``: reads all three projection outputs, writes the caller's buffer."""
    d = out.shape[1]
    out.copy_((qkvg[:, :d].float() * torch.sigmoid(g1[:, :d].float()) + beta[:, :1].float()).to(out.dtype))


def _model(projections, head_dim):
    """Each layer: the projection (inside a segment), ``core_attn_out`` allocated there as vLLM's forward does, the
    eager break, and the next layer's input computed from the break's output (in the next segment)."""

    def run(x, capture=None):
        outs = []
        for projection in projections:
            qkvg, g1, beta = projection(x)
            core = torch.empty(x.shape[0], head_dim, dtype=x.dtype, device=x.device)

            def kda_core(qkvg=qkvg, g1=g1, beta=beta, core=core):
                _kda_core(qkvg, g1, beta, core)

            if capture is None:
                kda_core()
            else:
                capture.eager(kda_core)
            outs.append((qkvg, g1, beta, core))
            x = (x.float() * 0.5 + core[:, :1].float()).to(x.dtype)
        return outs

    return run


@pytest.fixture(scope="module")
def layers():
    return packed_kimi_k3_layers(LAYERS, seed=300)


def _assert_all_equal(got, expected, what):
    for layer, (a_out, b_out) in enumerate(zip(got, expected)):
        for name, a, b in zip(("qkvg", "g1", "beta", "core"), a_out, b_out):
            assert not a.isnan().any(), f"{what}: layer {layer} {name} has NaN"
            assert torch.equal(a, b), f"{what}: layer {layer} {name} differs"


def test_breakable_capture_forks_inside_segments_and_replays_equal_to_eager(layers, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")
    host = _VllmLikeHost()
    plugins.register_plugin(host, "vllm-like-host")
    # As the adapter does at load: plan resolved, kernels compiled for vLLM's capture sizes.
    projections = [build_projection(w, batch_sizes=BATCH_SIZES) for w in layers]
    g = layers[0].geometry
    model = _model(projections, g.head_dim)
    inputs = {bs: torch.randn(bs, g.hidden_size, device="cuda", dtype=torch.bfloat16) for bs in BATCH_SIZES}
    stream = torch.cuda.Stream()  # vLLM's model runner never runs on the default stream
    stream.wait_stream(torch.cuda.current_stream())
    pool = torch.cuda.graph_pool_handle()  # vLLM's global graph pool, shared by every capture
    captures, outputs = {}, {}
    with torch.cuda.stream(stream):
        for bs in sorted(inputs, reverse=True):
            model(inputs[bs])  # warm-up / profiling runs: eager, so no fork
        assert host.allowed == 0
        for bs in sorted(inputs, reverse=True):
            stream.synchronize()
            with _BreakableCapture(pool) as capture:
                outputs[bs] = model(inputs[bs], capture)
            captures[bs] = capture
    torch.cuda.synchronize()
    assert host.allowed == LAYERS * len(BATCH_SIZES), "every layer's projection must fork inside its segment"
    assert all(c.graphs == LAYERS + 1 and c.eager_breaks == LAYERS for c in captures.values())

    gen = torch.Generator(device="cuda").manual_seed(7)
    for trial in range(2):
        for bs in BATCH_SIZES:
            x_new = torch.randn(bs, g.hidden_size, device="cuda", generator=gen).bfloat16()
            with torch.cuda.stream(stream):
                for out in outputs[bs]:
                    for t in out:
                        t.fill_(float("nan"))  # the replay must write every output
                inputs[bs].copy_(x_new)
                captures[bs].replay()
            torch.cuda.synchronize()
            replayed = [tuple(t.clone() for t in out) for out in outputs[bs]]
            eager = model(x_new)  # outside capture: no fork, the same kernels one after another
            _assert_all_equal(replayed, eager, f"breakable replay trial {trial} bs={bs}")
            first = layers[0]
            ref = reference_projection(x_new, first.w_qkvg, first.w_fab, first.w_fb, g)
            for name, got, expect in zip(("qkvg", "g1", "beta"), replayed[0], ref):
                assert_close(got, expect, f"bs={bs} {name}")
    assert host.allowed == LAYERS * len(BATCH_SIZES), "replays and eager runs must not fork"
