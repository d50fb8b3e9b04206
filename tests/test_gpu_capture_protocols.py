"""On the GPU: the two engines' CUDA-graph capture protocols, emulated with the core alone (the engines cannot be
installed on the GPU machine), over several Kimi-K3 TP8 layers sharing one aux stream.

- vLLM (FULL CUDA graphs): the model runs on a non-default stream; eager warm-up outside capture (no fork), then
  each batch size captured largest first on that same stream into one shared memory pool. The host allows the
  fork exactly while the current stream is capturing.
- SGLang: capture mode is switched on for the whole capture, so its two eager warm-ups per batch size already
  fork; each batch size (largest first) is captured on a dedicated capture stream, later graphs reusing the
  first graph's pool.

Replays with changed inputs must equal eager bit for bit, and the two protocols' graphs must equal each other.
"""

import pytest
import torch
from numerics import assert_close, packed_kimi_k3_layers

from kda_backend import KDAProjection, Plan, Step, plugins
from kda_backend.hookspecs import hookimpl
from kda_backend.reference import reference_projection

pytestmark = pytest.mark.gpu
BATCH_SIZES = (1, 2, 4, 8, 12, 16)
LAYERS = 3


class _Host:
    """An engine's answers to the host hooks; counts the forks it allows (each overlapped call asks once)."""

    def __init__(self, vllm_like: bool) -> None:
        self.vllm_like = vllm_like
        self.capture_mode = False  # SGLang's model_capture_mode flag
        self.stream = torch.cuda.Stream()
        self.forks = 0

    @hookimpl
    def kda_host_fork_allowed(self, device):
        allowed = torch.cuda.is_current_stream_capturing() if self.vllm_like else self.capture_mode
        self.forks += allowed
        return allowed

    @hookimpl
    def kda_host_aux_stream(self, device):
        return self.stream


@pytest.fixture(scope="module")
def layers():
    return packed_kimi_k3_layers(LAYERS, seed=200)


def _model(projs):
    def run(x):
        outs = []
        for p in projs:
            qkvg, g1, beta = p(x)
            outs.append((qkvg, g1, beta))
            x = (x.float() * 0.5 + qkvg[:, :1].float()).to(x.dtype)  # the next layer depends on this one
        return outs

    return run


def _capture_vllm(model, inputs, host):
    main = torch.cuda.Stream()  # vLLM's model runner never runs on the default stream
    main.wait_stream(torch.cuda.current_stream())
    graphs, outputs, pool = {}, {}, torch.cuda.graph_pool_handle()
    with torch.cuda.stream(main):
        for bs in sorted(inputs, reverse=True):
            model(inputs[bs])  # profiling / warm-up run: not capturing, so no fork
        forks_before = host.forks
        for bs in sorted(inputs, reverse=True):
            graphs[bs] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[bs], pool=pool, stream=main):
                outputs[bs] = model(inputs[bs])
    torch.cuda.current_stream().wait_stream(main)
    assert forks_before == 0 and host.forks == LAYERS * len(inputs), "vLLM FULL capture must fork every layer"
    return graphs, outputs


def _capture_sglang(model, inputs, host, eager):
    capture_stream = torch.cuda.Stream()
    capture_stream.wait_stream(torch.cuda.current_stream())
    graphs, outputs, pool = {}, {}, None
    host.capture_mode = True
    try:
        with torch.cuda.stream(capture_stream):
            for bs in sorted(inputs, reverse=True):
                for _ in range(2):  # SGLang's two warm-ups, in capture mode: they fork eagerly
                    warm = model(inputs[bs])
                    capture_stream.synchronize()
                    _assert_all_equal(warm, eager[bs], f"SGLang eager warm-up bs={bs}")
                graphs[bs] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[bs], pool=pool, stream=capture_stream):
                    outputs[bs] = model(inputs[bs])
                pool = graphs[bs].pool()
    finally:
        host.capture_mode = False
    torch.cuda.current_stream().wait_stream(capture_stream)
    assert host.forks == 3 * LAYERS * len(inputs), "SGLang warm-ups and captures must fork every layer"
    return graphs, outputs


def _assert_all_equal(got, expected, what):
    for layer, (a_out, b_out) in enumerate(zip(got, expected)):
        for name, a, b in zip(("qkvg", "g1", "beta"), a_out, b_out):
            assert not a.isnan().any(), f"{what}: layer {layer} {name} has NaN"
            assert torch.equal(a, b), f"{what}: layer {layer} {name} differs"


def _protocol_graphs(layers, protocol):
    host = _Host(vllm_like=protocol == "vllm")
    plugins.register_plugin(host, f"{protocol}-like-host")
    projs = [KDAProjection(w, Plan.uniform(max(BATCH_SIZES), Step(overlap=True))) for w in layers]
    for p in projs:
        p.prepare(BATCH_SIZES)
    model = _model(projs)
    hidden = layers[0].geometry.hidden_size
    inputs = {bs: torch.randn(bs, hidden, device="cuda", dtype=torch.bfloat16) for bs in BATCH_SIZES}
    try:
        if protocol == "vllm":
            graphs, outputs = _capture_vllm(model, inputs, host)
        else:
            eager = {bs: model(x) for bs, x in inputs.items()}
            graphs, outputs = _capture_sglang(model, inputs, host, eager)
    finally:
        plugins.unregister_plugin(f"{protocol}-like-host")  # replays' eager comparisons run as standalone
    return model, inputs, graphs, outputs


def test_both_protocols_replay_equal_to_eager_and_to_each_other(layers):
    captured = {protocol: _protocol_graphs(layers, protocol) for protocol in ("vllm", "sglang")}
    gen = torch.Generator(device="cuda").manual_seed(7)
    for trial in range(2):
        for bs in BATCH_SIZES:
            x_new = torch.randn(bs, layers[0].geometry.hidden_size, device="cuda", generator=gen).bfloat16()
            replayed = {}
            for protocol, (model, inputs, graphs, outputs) in captured.items():
                for out in outputs[bs]:
                    for t in out:
                        t.fill_(float("nan"))  # the replay must write every output
                inputs[bs].copy_(x_new)
                graphs[bs].replay()
                torch.cuda.synchronize()
                replayed[protocol] = [tuple(t.clone() for t in out) for out in outputs[bs]]
                eager = model(x_new)  # outside capture: the host says no fork, the same kernels run in sequence
                _assert_all_equal(replayed[protocol], eager, f"{protocol} replay trial {trial} bs={bs}")
            _assert_all_equal(replayed["vllm"], replayed["sglang"], f"vLLM vs SGLang graphs trial {trial} bs={bs}")
            first = layers[0]
            ref = reference_projection(x_new, first.w_qkvg, first.w_fab, first.w_fb, first.geometry)
            for name, got, expect in zip(("qkvg", "g1", "beta"), replayed["vllm"][0], ref):
                assert_close(got, expect, f"bs={bs} {name}")
