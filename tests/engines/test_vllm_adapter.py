"""The vLLM adapter against the real vllm==0.33 package (CPU).

Plugin loading and the deferred injection, the layer vLLM builds (also on emulated H200 / B200 / B300, SM 9.0 /
10.0 / 10.3, where vLLM swaps in its Kimi-K3 low-latency linear method, at TP 8 and 4 with a seeded checkpoint
loaded by vLLM's loaders), what its forward hands vLLM's ``_forward``, the plan resolved at load, the host's fork
decision and projection parity.

Runs in the nox session `vllm` (its own environment: vLLM pins torch). Layers are built by vLLM's own code from
small Kimi-K3-shaped configs on a one-rank gloo group, as vLLM's CPU tests do; another rank's identity and a GPU's
compute capability are emulated through the test-only seams listed in adapters/SEAMS.md.
"""

import contextlib
import json
import logging
import os
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402

from engine_helpers import CountingShare, free_port  # noqa: E402
from parity.checkpoint import (  # noqa: E402
    CHECKPOINTS, K3_RANK, PARITY_CASES, PARITY_MS, PREFIX, TINY, artifacts_dir, core_weights, load_checkpoint,
    loaded_checksums, make_checkpoint, parity_input, rank_shards,
)

from kda_backend import KDAProjection, plugins, register_plugin  # noqa: E402
from kda_backend.geometry import preset  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 256, 8, 32
K3_ARCHS = ["K3DSparkModel", "KimiK3ForConditionalGeneration", "KimiK3MTPModel", "KimiLinearForCausalLM"]
# Emulated GPUs: vLLM's Kimi-K3 low-latency GEMM tables exist for exactly these capabilities (and SM 10.7).
GPUS = {"h200-sm90": (9, 0), "b200-sm100": (10, 0), "b300-sm103": (10, 3)}
K3 = preset("kimi-k3")


def _vllm_config(folder, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM) -> VllmConfig:
    """A VllmConfig for a small Kimi-K3-shaped model (one KDA layer, one MLA layer) written to ``folder``."""
    config = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "hidden_size": hidden,
        "num_attention_heads": 4, "num_hidden_layers": 2, "vocab_size": 1024, "intermediate_size": 512,
        "rms_norm_eps": 1e-5, "torch_dtype": "bfloat16", "q_lora_rank": None, "kv_lora_rank": 64,
        "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
        "linear_attn_config": {
            "head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "kda_layers": [1], "full_attn_layers": [2],
        },
    }
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return VllmConfig(
        device_config=DeviceConfig(device="cpu"),
        model_config=ModelConfig(model=str(folder), skip_tokenizer_init=True, dtype="bfloat16"),
    )


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """A VllmConfig for a tiny Kimi-K3 config, with vLLM's distributed state initialised on one CPU rank."""
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    vc = _vllm_config(tmp_path_factory.mktemp("tiny-k3"))
    with set_current_vllm_config(vc):
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
        )
        initialize_model_parallel(1)
        yield vc


@pytest.fixture(scope="module")
def injected(vllm_env):
    """vLLM's own plugin loader runs our entry point; resolving the model's Kimi-K3 architecture injects."""
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.plugins import load_general_plugins

    from kda_vllm.layer import KdaBackendKimiK3DeltaAttention

    load_general_plugins()
    assert op_registry_oot.get("KimiK3DeltaAttention") is None, "injected before vLLM resolved a Kimi-K3 model"
    get_model_architecture(vllm_env.model_config)
    assert op_registry_oot.get("KimiK3DeltaAttention") is KdaBackendKimiK3DeltaAttention
    return KdaBackendKimiK3DeltaAttention


@pytest.fixture(scope="module")
def k3_rank_env(tmp_path_factory, vllm_env):
    """Kimi-K3's per-rank shapes at TP 8 (12 heads of 128, hidden 7168) as a one-rank model."""
    return _vllm_config(tmp_path_factory.mktemp("k3-rank"), K3_RANK.hidden_size, K3_RANK.num_heads, K3_RANK.head_dim)


@pytest.fixture(scope="module")
def k3_env(tmp_path_factory, vllm_env):
    """The whole Kimi-K3 KDA geometry (96 heads of 128, hidden 7168) and its seeded checkpoint (0.9 GB)."""
    folder = tmp_path_factory.mktemp("k3")
    make_checkpoint(folder / "k3.safetensors", K3)
    return _vllm_config(folder, K3.hidden_size, K3.num_heads, K3.head_dim), load_checkpoint(folder / "k3.safetensors")


@pytest.fixture
def vllm_host():
    """The host plugin, as a layer registers it when its weights are loaded (the manager is fresh per test)."""
    from kda_vllm.injection import register_host

    register_host()


def _post_load(layer, vllm_config):
    """vLLM's post-load pass over a model holding ``layer``: every quant method's, then the attention layers'."""
    from vllm.model_executor.model_loader.utils import process_weights_after_loading

    process_weights_after_loading(torch.nn.ModuleDict({"attn": layer}), vllm_config.model_config, torch.device("cpu"))


_layer_count = iter(range(10_000))


def _construct(vllm_config, dtype=torch.bfloat16, aux_stream=None):
    """vLLM's model code path: construct vLLM's KimiK3DeltaAttention class (ours, once injected)."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_config), set_default_torch_dtype(dtype):
        return KimiK3DeltaAttention(
            vllm_config.model_config.hf_config, vllm_config, prefix=f"model.layers.{next(_layer_count)}.self_attn",
            aux_stream=aux_stream,
        )


def _build_layer(vllm_config, dtype=torch.bfloat16, seed=0, aux_stream=None):
    """A layer with random weights, through vLLM's post-load pass."""
    layer = _construct(vllm_config, dtype, aux_stream)
    gen = torch.Generator().manual_seed(seed)
    for p in (layer.in_proj_qkvgfab.weight, layer.f_b_proj.weight, layer.o_proj.weight):
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    _post_load(layer, vllm_config)
    return layer


def _init_overlap_limit():
    """The overlap limit ``low_latency_gemm._enable_kda_projection_overlap`` gives a layer at model init where vLLM's
    low-latency GEMMs serve it (it needs Kimi-K3's shapes on a GPU, so the tests set it); vLLM's warm-up
    (``autotune_kda_qkvg``) then raises it to ``KDA_PROJECTION_OVERLAP_MAX_TOKENS``."""
    from vllm.models.kimi_k3.nvidia import low_latency_gemm

    return max(low_latency_gemm.KDA_QKVG_CONFIGS)


def _vllm_projection(layer, x):
    """vLLM's own sequential projection on the same weights (its non-overlap branch)."""
    projected = layer.in_proj_qkvgfab(x)[0]
    lps, d, h = layer.local_projection_size, layer.head_dim, layer.local_num_heads
    mixed, g_proj, f_a, beta = projected.split([3 * lps, lps, d, h, layer.in_proj_padding], dim=-1)[:4]
    g1 = layer.f_b_proj(f_a)[0]
    return torch.cat([mixed, g_proj], dim=-1), g1, beta


def _assert_equal(ours, theirs, what):
    for name, a, b in zip(("qkvg", "g1", "beta"), ours, theirs):
        assert a.shape == b.shape and not a.isnan().any(), f"{what}: {name}"
        assert torch.equal(a, b), f"{what}: {name} differs"


class _Recorder:
    """Stands in for vLLM's ``_forward`` (which needs attention metadata and state): keeps the tensors it is given
    and writes a constant into ``core_attn_out``, as the real one writes its output there."""

    def __init__(self) -> None:
        self.calls: list[dict[str, torch.Tensor]] = []

    def __call__(self, **kwargs) -> None:
        self.calls.append(kwargs)
        kwargs["core_attn_out"].fill_(0.5)


def _layouts(call: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """What ``_forward``'s kernels see of each tensor besides its values: shape, dtype, the strides of the dims
    longer than one, the offset into its storage, and which tensors share one storage (numbered in order)."""
    storages: dict[int, int] = {}
    return {
        name: (
            tuple(t.shape), t.dtype, tuple(s for s, n in zip(t.stride(), t.shape) if n > 1), t.storage_offset(),
            storages.setdefault(t.untyped_storage().data_ptr(), len(storages)),
        )
        for name, t in call.items()
    }


class _TensorParallelRank:
    """vLLM's tensor-parallel group as rank ``rank`` of ``size`` sees it. Layer shapes and every weight loader's
    shard offsets come from this group's ``rank_in_group`` and ``world_size``; the projection stage itself does
    no communication, so one process can stand in for each rank in turn."""

    def __init__(self, group, rank: int, size: int) -> None:
        self._group, self.rank_in_group, self.world_size = group, rank, size

    def __getattr__(self, name):
        return getattr(self._group, name)


@contextlib.contextmanager
def _as_rank(tp: int, rank: int, monkeypatch):
    from vllm.distributed import parallel_state

    with monkeypatch.context() as patch:
        patch.setattr(parallel_state, "_TP", _TensorParallelRank(parallel_state._TP, rank, tp))
        yield


def _emulate_gpu(capability: tuple[int, int], monkeypatch) -> None:
    """Every capability query vLLM makes (``is_device_capability``, ``..._family``, ``has_device_capability``) goes
    through the platform class's ``get_device_capability``; on the CPU it answers ``None``."""
    from vllm.platforms import current_platform
    from vllm.platforms.interface import DeviceCapability

    answer = DeviceCapability(*capability)
    monkeypatch.setattr(type(current_platform), "get_device_capability", classmethod(lambda cls, device_id=0: answer))


VLLM_SHARD_IDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "g_proj": 3, "f_a_proj": 4, "b_proj": 5}


def _load_weights(layer, tensors) -> None:
    """The projection weights from the unsharded checkpoint through vLLM's loaders (stacked shard ids; f_a,
    shard 4, replicated)."""
    packed = layer.in_proj_qkvgfab.weight
    for name, shard_id in VLLM_SHARD_IDS.items():
        packed.weight_loader(packed, tensors[f"{PREFIX}.{name}.weight"], shard_id)
    layer.f_b_proj.weight.weight_loader(layer.f_b_proj.weight, tensors[f"{PREFIX}.f_b_proj.weight"])


def _load_rank(vllm_config, tensors, tp, rank, monkeypatch):
    """vLLM's layer for rank ``rank`` of ``tp``, loaded from the unsharded checkpoint and post-processed."""
    with _as_rank(tp, rank, monkeypatch):
        layer = _construct(vllm_config)
        _load_weights(layer, tensors)
        _post_load(layer, vllm_config)
    assert layer.tp_size == tp and layer.local_num_heads == layer.num_heads // tp
    return layer


# --- plugin loading, deferral, failures ---------------------------------------------------------------------------


def test_adapter_import_is_light():
    code = "import sys, kda_vllm; print([m for m in ('torch', 'vllm', 'kda_backend') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


_PLUGIN_PROBE = """
import json, sys
import vllm.engine.arg_utils  # imported wherever vLLM's front end loads general plugins
before = set(sys.modules)
from vllm.plugins import load_general_plugins
load_general_plugins()
added = sorted(set(sys.modules) - before)
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.models.registry import ModelRegistry
wrapped = sorted(a for a, e in ModelRegistry.models.items() if type(e).__name__ == "InjectOnLoad")
ModelRegistry.models["KimiLinearForCausalLM"].load_model_cls()  # what vLLM runs when it resolves the model
layer = op_registry_oot.get("KimiK3DeltaAttention")
core = "kda_backend.projection" in sys.modules
print(json.dumps({"added": added, "wrapped": wrapped, "injected": getattr(layer, "__name__", None), "core": core}))
"""


@pytest.mark.parametrize(
    "env,expect_wrapped,expect_injected",
    [
        ({"VLLM_PLUGINS": ""}, False, False),
        ({"KDA_BACKEND_DISABLE": "1"}, True, False),
        ({"VLLM_PLUGINS": "kda_backend"}, True, True),
    ],
    ids=["vllm-allowlist-empty", "kda-disabled", "vllm-allowlist-ours"],
)
def test_plugin_defers_injection_to_kimi_k3_resolution(env, expect_wrapped, expect_injected):
    """``load_general_plugins()`` imports neither vLLM's Kimi-K3 code nor the core (torch kernels, CuTe DSL): it
    wraps the Kimi-K3 registry entries, and loading one of those classes injects (unless switched off, which leaves
    the core unimported)."""
    proc = subprocess.run([sys.executable, "-c", _PLUGIN_PROBE], capture_output=True, text=True,
                          env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    heavy = [m for m in result["added"] if m.startswith(("vllm.models.kimi_k3", "kda_backend", "cutlass", "torch"))]
    assert heavy == [], heavy
    assert result["wrapped"] == (K3_ARCHS if expect_wrapped else [])
    assert (result["injected"] == "KdaBackendKimiK3DeltaAttention") == expect_injected, proc.stderr[-2000:]
    assert result["core"] == expect_injected


def test_register_twice_is_harmless(injected, vllm_env):
    import kda_vllm
    from vllm.model_executor.models.registry import ModelRegistry

    from kda_vllm.deferral import InjectOnLoad

    kda_vllm.register()
    kda_vllm.register()
    assert all(not isinstance(ModelRegistry.models[a].original, InjectOnLoad) for a in K3_ARCHS)
    assert type(_build_layer(vllm_env)) is injected


def test_register_failure_logs_one_error_and_leaves_vllm_untouched(injected, monkeypatch, kda_log):
    import logging

    import kda_vllm
    from vllm.model_executor.models.registry import ModelRegistry

    from kda_vllm import deferral

    unwrapped = {a: getattr(e, "original", e) for a, e in ModelRegistry.models.items()}
    monkeypatch.setattr(ModelRegistry, "models", dict(unwrapped))
    made = []

    def fails_on_the_second(entry):
        made.append(entry)
        if len(made) == 2:
            raise RuntimeError("boom")
        return deferral.InjectOnLoad(entry)

    monkeypatch.setattr(deferral, "InjectOnLoad", fails_on_the_second)
    kda_vllm.register()  # must not raise: vLLM does not catch plugin exceptions
    assert ModelRegistry.models == unwrapped, "a failed register() changed vLLM's registry"
    errors = kda_log.messages(logging.ERROR)
    assert len(errors) == 1 and "register" in errors[0], errors


def test_injection_failure_logs_one_error_and_vllm_builds_its_own_layer(injected, monkeypatch, kda_log):
    import logging

    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.models.registry import ModelRegistry

    from kda_vllm import injection

    def broken_install():
        raise RuntimeError("boom")

    monkeypatch.setattr(injection, "install", broken_install)
    before = dict(op_registry_oot)
    model_cls = ModelRegistry.models["KimiLinearForCausalLM"].load_model_cls()
    assert model_cls.__name__ == "KimiLinearForCausalLM"
    assert dict(op_registry_oot) == before
    errors = kda_log.messages(logging.ERROR)
    assert len(errors) == 1 and "injecting" in errors[0], errors


# --- the layer vLLM builds ------------------------------------------------------------------------------------------


def test_vllm_builds_our_subclass_and_it_serves(injected, vllm_env):
    layer = _build_layer(vllm_env)
    assert type(layer) is injected
    assert "vllm-host" in plugins.plugin_names()
    assert isinstance(layer.kda_projection, KDAProjection) and layer.kda_vllm_path_reason is None


@pytest.mark.parametrize("m", range(1, 17))
def test_projection_bitwise_equal_to_vllm(injected, vllm_env, m):
    layer = _build_layer(vllm_env, seed=m)
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(100 + m)).bfloat16()
    _assert_equal(layer.kda_projection(x), _vllm_projection(layer, x), f"M={m}")


def test_weight_views_share_vllm_storage(injected, vllm_env):
    layer = _build_layer(vllm_env)
    w = layer.kda_projection.weights
    assert w.packed.data_ptr() == layer.in_proj_qkvgfab.weight.data_ptr()
    assert w.w_qkvg.data_ptr() == layer.in_proj_qkvgfab.weight.data_ptr()
    assert w.w_fb.data_ptr() == layer.f_b_proj.weight.data_ptr()
    assert w.geometry.packed_rows == layer.in_proj_qkvgfab.weight.shape[0]


def test_forward_equals_vllm_forward(injected, vllm_env, monkeypatch):
    """Our forward (through kda-backend's projection) and vLLM's own forward, with vLLM's core stubbed: the same
    outputs and ``_forward`` inputs."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    from kda_backend import KDAProjection

    layer = _build_layer(vllm_env, seed=3)
    recorder = _Recorder()
    monkeypatch.setattr(layer, "_forward", recorder)
    served, project = [], KDAProjection.__call__
    monkeypatch.setattr(KDAProjection, "__call__",
                        lambda self, x, *out: served.append(len(x)) or project(self, x, *out))
    x = torch.randn(5, HIDDEN).bfloat16()
    ours = layer.forward(x, torch.arange(5))
    theirs = KimiK3DeltaAttention.forward(layer, x, torch.arange(5))
    assert served == [5] and torch.equal(ours, theirs)
    first, second = recorder.calls
    assert first.keys() == second.keys() == {"mixed_qkv", "g1", "g2", "beta", "core_attn_out"}
    for key in first:
        assert torch.equal(first[key], second[key]), key


def test_forward_before_load_runs_vllm_path_and_says_why(injected, vllm_env, kda_log, monkeypatch):
    layer = _construct(vllm_env)
    monkeypatch.setattr(layer, "_forward", _Recorder())
    out = layer.forward(torch.randn(2, HIDDEN).bfloat16(), torch.arange(2))
    assert out.shape == (2, HIDDEN) and layer.kda_projection is None
    assert any("never processed" in m for m in kda_log.messages())


def test_non_bf16_weights_keep_vllm_path(injected, vllm_env, kda_log):
    layer = _build_layer(vllm_env, dtype=torch.float32)
    assert layer.kda_projection is None
    assert "not bfloat16" in layer.kda_vllm_path_reason
    assert any("not bfloat16" in m for m in kda_log.messages())


def test_quantized_or_repacking_methods_keep_vllm_path(injected, vllm_env):
    """Recognised by class: a subclass of vLLM's unquantized method serves unless it changes the weights after
    loading (their layout is then not known); any other method is a quantized one."""
    from vllm.model_executor.layers.linear import LinearMethodBase, UnquantizedLinearMethod

    class Repacking(UnquantizedLinearMethod):
        def process_weights_after_loading(self, layer):
            layer.weight.data = layer.weight.data.t().contiguous().t()

    class Quantized(LinearMethodBase):
        def create_weights(self, *args, **kwargs):
            raise NotImplementedError

        def apply(self, layer, x, bias=None):
            raise NotImplementedError

    for method, reason in ((Repacking, "changes its weights after loading"), (Quantized, "is quantized (Quantized)")):
        layer = _construct(vllm_env)
        layer.in_proj_qkvgfab.quant_method = method()
        _post_load(layer, vllm_env)
        assert layer.kda_projection is None and reason in layer.kda_vllm_path_reason, layer.kda_vllm_path_reason


def test_offloaded_weights_keep_vllm_path(injected, vllm_env):
    """vLLM's offloaders move parameters between buffers after loading; views taken at load would go stale."""
    from vllm.config.offload import OffloadConfig, UVAOffloadConfig
    from vllm.model_executor.offloader.base import create_offloader, set_offloader

    set_offloader(create_offloader(OffloadConfig(uva=UVAOffloadConfig(cpu_offload_gb=1))))
    try:
        layer = _build_layer(vllm_env)
    finally:
        set_offloader(None)
    assert layer.kda_projection is None and "UVAOffloader" in layer.kda_vllm_path_reason


def test_projection_that_cannot_build_keeps_vllm_path_with_one_error(injected, vllm_env, kda_log, monkeypatch):
    """Where building fails after the plan was shared (a kernel that does not compile, memory), the model still
    loads: vLLM's path serves every layer, one error says why, the layer's reason points at it."""
    from kda_vllm.layer import BUILD_FAILED

    from kda_backend import serving

    monkeypatch.setattr(serving, "KDAProjection", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("oom")))
    layers = [_build_layer(vllm_env, seed=seed) for seed in range(2)]
    assert all(layer.kda_projection is None and layer.kda_vllm_path_reason == BUILD_FAILED for layer in layers)
    assert sum("could not build the KDA projection" in m and "RuntimeError: oom" in m
               for m in kda_log.messages(logging.ERROR)) == 1
    x = torch.randn(3, HIDDEN, dtype=torch.bfloat16)
    with monkeypatch.context() as patch:
        recorder = _Recorder()
        patch.setattr(layers[0], "_forward", recorder)
        layers[0].forward(x, torch.arange(3))
    vllm_qkv = _vllm_projection(layers[0], x)[0][:, : 3 * layers[0].local_projection_size]
    assert torch.equal(recorder.calls[-1]["mixed_qkv"], vllm_qkv)


def test_projection_state_is_a_buffer_vllm_saves_across_sleep(injected, vllm_env, monkeypatch):
    """vLLM's sleep level 2 drops the weights' memory (the projection's state was allocated there at load) and
    restores the model's ``named_buffers()`` on wake-up: the projection's state (its arrival counters) is one of
    them, once for all layers, and no checkpoint (``state_dict``) sees it."""
    from kda_backend import KDAProjection

    counters = torch.zeros(4, 8, dtype=torch.int32)
    monkeypatch.setattr(KDAProjection, "state_buffers", lambda self: {"kda_arrival_counters": counters})
    model = torch.nn.ModuleDict({str(seed): _build_layer(vllm_env, seed=seed) for seed in range(2)})
    assert [name for name, t in model.named_buffers() if t is counters] == ["0.kda_arrival_counters"]
    assert not any("kda_arrival_counters" in key for key in model.state_dict())


def test_vllm_overlap_branch_is_dead_where_we_serve_and_untouched_where_vllm_serves(injected, vllm_env, monkeypatch):
    """The model hands every KDA layer its aux stream and events. Where kda-backend serves, the projection forks onto
    that stream itself: vLLM's overlap branch never runs (no second fork) and vLLM's warm-up tunes nothing for it.
    Where vLLM's path serves, its stream, events and overlap limit stay as vLLM set them."""
    from vllm.models.kimi_k3.nvidia import low_latency_gemm

    aux = object()  # stands for the model's torch.cuda.Stream, which a CPU cannot create
    served = _construct(vllm_env, torch.bfloat16, aux)
    served._projection_overlap_max_tokens = _init_overlap_limit()
    _post_load(served, vllm_env)
    assert served.kda_projection is not None and served.kda_projection.aux_stream is aux
    assert served.kda_projection.serves(low_latency_gemm.KDA_PROJECTION_OVERLAP_MAX_TOKENS)
    assert served._projection_overlap_max_tokens == 0
    low_latency_gemm.autotune_kda_qkvg(torch.nn.ModuleDict({"attn": served}))  # vLLM's warm-up step
    assert served._projection_overlap_max_tokens == 0
    with monkeypatch.context() as patch:
        patch.setattr(served, "_projection_overlap_max_tokens", 16)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        patch.setattr(low_latency_gemm, "run_kda_projection_overlap", _never("vLLM's overlap branch"))
        patch.setattr(served, "_forward", _Recorder())
        x = torch.randn(4, HIDDEN, dtype=torch.bfloat16)
        assert served.forward(x, torch.arange(4)).shape == (4, HIDDEN)
    plain = _construct(vllm_env, torch.float32, aux)
    plain._projection_overlap_max_tokens = _init_overlap_limit()
    _post_load(plain, vllm_env)
    assert plain.kda_projection is None and plain._projection_aux_stream is aux
    assert plain._projection_events is not None and plain._projection_overlap_max_tokens == _init_overlap_limit()
    low_latency_gemm.autotune_kda_qkvg(torch.nn.ModuleDict({"attn": plain}))
    assert plain._projection_overlap_max_tokens == low_latency_gemm.KDA_PROJECTION_OVERLAP_MAX_TOKENS


def _never(what):
    def fail(*args, **kwargs):
        raise AssertionError(f"{what} ran")

    return fail


def test_graph_token_counts_include_vllms_speculative_rounding(injected, vllm_env, monkeypatch):
    """The projection is prepared (and, with KDA_BACKEND_AUTOTUNE=1, tuned) for vLLM's capture sizes and, under
    speculative decoding, for the multiples of 1 + the draft tokens vLLM rounds its FULL decode graphs to after the
    model is loaded; the layer hands exactly these to planning."""
    from types import SimpleNamespace

    from kda_vllm import layer as vllm_layer

    compilation = SimpleNamespace(cudagraph_capture_sizes=[1, 2, 4, 8, 16, 24, 32], max_cudagraph_capture_size=32)
    spec = SimpleNamespace(num_speculative_tokens=2)
    rounded = vllm_layer.graph_token_counts(SimpleNamespace(compilation_config=compilation, speculative_config=spec))
    assert rounded == [1, 2, 3, 4, 6, 8, 9, 16, 18, 24, 32]
    plain = vllm_layer.graph_token_counts(SimpleNamespace(compilation_config=compilation, speculative_config=None))
    assert plain == [1, 2, 4, 8, 16, 24, 32]
    handed = []
    serve = vllm_layer.serve_layer
    monkeypatch.setattr(vllm_layer, "serve_layer", lambda layer, weights, **kwargs: handed.append(
        kwargs["batch_sizes"]) or serve(layer, weights, **kwargs))
    layer = _build_layer(vllm_env)
    assert layer.kda_projection is not None
    assert handed == [vllm_layer.graph_token_counts(vllm_env)]
    assert handed[0] == sorted(vllm_env.compilation_config.cudagraph_capture_sizes or ())


def test_batch_invariant_mode_keeps_vllm_path(injected, vllm_env, monkeypatch):
    """With ``VLLM_BATCH_INVARIANT=1`` vLLM promises results independent of the batch size (its linears become
    batch-invariant, its low-latency kernels are off); kda-backend's kernels pick tactics per M, so vLLM's path
    serves."""
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")
    layer = _build_layer(vllm_env)
    assert layer.kda_projection is None and "VLLM_BATCH_INVARIANT" in layer.kda_vllm_path_reason


def _plan_case(case):
    """A plan without a step of its own at some of M = 4, 8, 16, and the M it serves there."""
    from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step

    if case == "no-plan":
        return Plan(source="default (no tuned plan)", fallback=SEQUENTIAL_TORCH), []
    if case == "plan-to-8":
        return Plan.uniform(8, Step(overlap=False), source="autotune"), [4, 8]
    # The autotuner kept sequential cuBLAS (the baseline) at M = 8: the engine's path is that or faster there.
    steps = {4: Step(overlap=False), 8: SEQUENTIAL_TORCH, 16: Step(overlap=False)}
    return Plan(steps=steps, source="autotune", fallback=SEQUENTIAL_TORCH), [4, 16]


PLAN_CASES = ["no-plan", "plan-to-8", "sequential-cublas-at-8"]


@pytest.mark.parametrize("case", PLAN_CASES)
def test_batch_sizes_the_plan_has_no_step_for_run_vllms_own_path(injected, vllm_env, case, monkeypatch):
    """Where the plan has no step of its own for M (no tuned plan, M above its largest tuned one, or sequential
    cuBLAS there) the layer's forward is vLLM's own, its overlap limit left as vLLM set it (its warm-up then raises
    it to the limit its forward runs with); where the plan has one, the projection serves."""
    from vllm.models.kimi_k3.nvidia import low_latency_gemm

    from kda_backend import serving

    plan, expected = _plan_case(case)
    monkeypatch.setattr(serving, "resolve_plan", lambda *args, **kwargs: plan)
    layer = _construct(vllm_env)
    layer._projection_overlap_max_tokens = _init_overlap_limit()
    gen = torch.Generator().manual_seed(3)
    for p in (layer.in_proj_qkvgfab.weight, layer.f_b_proj.weight, layer.o_proj.weight):
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    _post_load(layer, vllm_env)
    assert isinstance(layer.kda_projection, KDAProjection)
    assert layer._projection_overlap_max_tokens == _init_overlap_limit()
    low_latency_gemm.autotune_kda_qkvg(torch.nn.ModuleDict({"attn": layer}))  # vLLM's warm-up step
    assert layer._projection_overlap_max_tokens == low_latency_gemm.KDA_PROJECTION_OVERLAP_MAX_TOKENS
    served = []
    projection_call = KDAProjection.__call__
    monkeypatch.setattr(KDAProjection, "__call__", lambda self, x, *a, **k: served.append(len(x)) or
                        projection_call(self, x, *a, **k))
    recorder = _Recorder()
    monkeypatch.setattr(layer, "_forward", recorder)
    for m in (4, 8, 16):
        x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
        layer.forward(x, torch.arange(m))
        vllm_qkv = _vllm_projection(layer, x)[0][:, : 3 * layer.local_projection_size]
        assert torch.equal(recorder.calls[-1]["mixed_qkv"], vllm_qkv), f"M={m}"
    assert served == expected


# --- what the forward hands vLLM's _forward --------------------------------------------------------------------------


def _new_output_mm(a, b, *args, **kwargs):
    """Stand-in for vLLM's CUDA-only skinny GEMMs (``shape_dynamic_skinny_gemm(a, b, ...)``,
    ``kda_skinny_gemm.run_n(a, b)``): each allocates a new contiguous ``[M, N]`` output and returns it."""
    out = torch.empty((a.shape[0], b.shape[0]), dtype=a.dtype)
    torch.mm(a, b.t(), out=out)
    return out


@contextlib.contextmanager
def _vllm_overlap_branch(layer, monkeypatch):
    """vLLM's own overlap branch of ``KimiK3DeltaAttention.forward`` on the CPU, as it runs on a GPU where
    ``enable_kimi_k3_low_latency_gemm`` switched it on, inside a breakable capture (one stream, as vLLM's
    ``maybe_execute_in_parallel`` runs there). Its CUDA-only GEMMs are replaced by stand-ins that allocate their
    outputs as the kernels do (``run_k`` reads f_a from the F_A/beta rows; ``dsv3_fused_a_gemm`` writes the given
    output). The threshold is 16, so M = 15, 16 take the same code too (vLLM's own threshold, 14, does not)."""
    from vllm import _custom_ops
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    from vllm.models.kimi_k3.nvidia import low_latency_gemm
    from vllm.models.kimi_k3.nvidia.ops.cute_dsl.kda_skinny_gemm import kda_skinny_gemm

    with monkeypatch.context() as patch:
        patch.setattr(layer, "_projection_aux_stream", object())  # only compared with None on this path
        patch.setattr(layer, "_projection_events", (None, None))  # unused where the branch runs on one stream
        patch.setattr(layer, "_projection_overlap_max_tokens", 16)
        patch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        patch.setattr(BreakableCUDAGraphCapture._tls, "active", object(), raising=False)
        patch.setattr(low_latency_gemm, "shape_dynamic_skinny_gemm", _new_output_mm)
        patch.setattr(kda_skinny_gemm, "run_n", _new_output_mm)
        patch.setattr(kda_skinny_gemm, "run_k", lambda fab, w: _new_output_mm(fab[:, : w.shape[1]], w))
        patch.setattr(_custom_ops, "dsv3_fused_a_gemm", lambda out, a, b_t, enable_pdl: out.copy_(a @ b_t))
        yield


@pytest.mark.parametrize("mode", ["sequential", "overlap"])
def test_forward_hands_vllm_forward_the_layout_vllm_does(injected, k3_rank_env, mode, monkeypatch):
    """At Kimi-K3's TP8 per-rank shapes, for M = 1..16: the tensors our forward hands ``_forward`` have the layout
    (shape, dtype, strides, storage offsets, shared storages) of those vLLM's own forward hands it, in its
    sequential branch (one packed GEMM: views with row stride 6288) where our step is the packed sequential one,
    and in its overlap branch (QKVG and F_A/beta in their own buffers) where ours runs the GEMMs apart (overlapped,
    forked or trailing: they allocate alike). On the CPU a forced plan picks the step; the layout is always one
    of vLLM's."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    monkeypatch.setenv("KDA_BACKEND_PLAN", mode)
    layer = _build_layer(k3_rank_env, seed=11)
    recorder = _Recorder()
    monkeypatch.setattr(layer, "_forward", recorder)
    for m in range(1, 17):
        x = torch.randn(m, K3_RANK.hidden_size, generator=torch.Generator().manual_seed(m)).bfloat16()
        positions = torch.arange(m)
        layer.forward(x, positions)
        KimiK3DeltaAttention.forward(layer, x, positions)
        with _vllm_overlap_branch(layer, monkeypatch):
            KimiK3DeltaAttention.forward(layer, x, positions)
        ours, sequential, overlapped = (_layouts(call) for call in recorder.calls[-3:])
        assert ours in (sequential, overlapped), f"M={m}: a layout vLLM never hands _forward: {ours}"
        assert ours == {"sequential": sequential, "overlap": overlapped}[mode], f"M={m}"
    assert sequential != overlapped  # the two branches do differ, so the comparison can tell them apart


# --- the plan, resolved at load --------------------------------------------------------------------------------------


def test_plan_is_shared_at_load_on_every_rank_and_never_in_forward(injected, vllm_env, monkeypatch, tmp_path):
    from kda_backend import planning

    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")  # on the CPU only a forced or stored plan is shared
    collective = CountingShare()
    register_plugin(collective, "counting-collective")
    tensors = make_checkpoint(tmp_path / "tiny.safetensors", TINY)
    layers = {}
    for rank in (0, 1):
        monkeypatch.setattr(planning, "_resolved", {})  # each rank is its own process
        layers[rank] = _load_rank(vllm_env, tensors, 2, rank, monkeypatch)
        assert collective.calls == rank + 1, "the plan must be shared while the weights are loaded"
    second = _load_rank(vllm_env, tensors, 2, 1, monkeypatch)  # rank 1's next layer: resolved once per process
    assert collective.calls == 2 and second.kda_projection.plan == layers[1].kda_projection.plan
    monkeypatch.setattr(layers[0], "_forward", _Recorder())
    for m in (1, 3, 8):  # rank 0 runs; rank 1 never does (e.g. it skips attention in this step)
        layers[0].forward(torch.randn(m, HIDDEN).bfloat16(), torch.arange(m))
    assert collective.calls == 2


# --- the host hooks ---------------------------------------------------------------------------------------------------


def test_fork_decision_from_vllm_state(injected, vllm_host, monkeypatch):
    """A fork joined before the projection returns is legal in a FULL capture and inside an open segment of a
    breakable one; never outside a capture (eager runs, warm-ups, profiling, a breakable capture's eager break)."""
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    dev = torch.device("cuda", 0)
    assert plugins.hooks.fork_allowed(dev) is False  # eager, warm-up, profiling: not capturing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    capturing = {"now": True}
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing["now"])
    assert plugins.hooks.fork_allowed(dev) is True  # a FULL capture
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", object(), raising=False)
    assert plugins.hooks.fork_allowed(dev) is True  # a segment of a breakable capture
    capturing["now"] = False
    assert plugins.hooks.fork_allowed(dev) is False  # its eager break (vLLM's _forward), or a replay of it


def test_cache_dir_under_vllm_cache_root(injected, vllm_host, monkeypatch, tmp_path):
    import vllm.envs

    monkeypatch.delenv("KDA_BACKEND_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert str(vllm.envs.VLLM_CACHE_ROOT) == str(tmp_path)
    assert plugins.hooks.cache_dir() == tmp_path / "kda_backend"


def test_plan_shared_from_rank0_on_one_rank(injected, vllm_host):
    plan = {"plan": {"steps": {}}, "tactics": []}
    assert plugins.hooks.share_plan(plan) == plan


# --- emulated GPUs: vLLM's low-latency linear method, TP 8 and 4 -----------------------------------------------------


@pytest.mark.parametrize("tp,rank", [(8, 7), (4, 2)], ids=["tp8-rank7", "tp4-rank2"])
@pytest.mark.parametrize("gpu", GPUS)
def test_emulated_gpu_layer_serves_and_equals_core(injected, k3_env, gpu, tp, rank, monkeypatch):
    """As ``KimiLinearForCausalLM.__init__`` does on an H200 / B200 / B300, ``enable_kimi_k3_low_latency_gemm``
    gives both projections vLLM's low-latency method (an ``UnquantizedLinearMethod`` subclass that keeps the
    weights as loaded); the seeded Kimi-K3 checkpoint is loaded by vLLM's loaders as one rank and post-processed
    by vLLM. The layer serves through ``KDAProjection`` over vLLM's own tensors, bit for bit equal to the core over
    the rank's shards (sliced independently of vLLM) and to vLLM's own projection, and its forward uses no
    projection of vLLM's."""
    from vllm.models.kimi_k3.nvidia.low_latency_gemm import (
        KimiK3LowLatencyLinearMethod, enable_kimi_k3_low_latency_gemm,
    )

    monkeypatch.delenv("KDA_BACKEND_PLAN", raising=False)
    vllm_config, tensors = k3_env
    _emulate_gpu(GPUS[gpu], monkeypatch)
    with _as_rank(tp, rank, monkeypatch):
        layer = _construct(vllm_config)
        enable_kimi_k3_low_latency_gemm(torch.nn.ModuleDict({"attn": layer}), torch.bfloat16)
        _load_weights(layer, tensors)
        _post_load(layer, vllm_config)
    for linear in (layer.in_proj_qkvgfab, layer.f_b_proj):
        assert type(linear.quant_method) is KimiK3LowLatencyLinearMethod, "vLLM's GPU branch was not taken"
    assert isinstance(layer.kda_projection, KDAProjection), layer.kda_vllm_path_reason
    weights = layer.kda_projection.weights
    assert weights.packed.data_ptr() == layer.in_proj_qkvgfab.weight.data_ptr()
    assert weights.w_fb.data_ptr() == layer.f_b_proj.weight.data_ptr()
    g = K3.with_tp(tp)
    core = KDAProjection(core_weights(rank_shards(tensors, K3, tp, rank), g, packed=True, row_multiple=16),
                         layer.kda_projection.plan)
    for m in (1, 2, 3, 8, 14, 16):
        x = parity_input(m, K3.hidden_size)
        ours = layer.kda_projection(x)
        _assert_equal(ours, core(x), f"{gpu} tp{tp} rank{rank} M={m}: vs core")
        _assert_equal(ours, _vllm_projection(layer, x), f"{gpu} tp{tp} rank{rank} M={m}: vs vLLM")
    recorder = _Recorder()
    monkeypatch.setattr(layer, "_forward", recorder)
    monkeypatch.setattr(layer.in_proj_qkvgfab.quant_method, "apply", _never("vLLM's in_proj_qkvgfab"))
    x = parity_input(4, K3.hidden_size)
    layer.forward(x, torch.arange(4))
    assert torch.equal(recorder.calls[0]["mixed_qkv"], core(x)[0][:, : 3 * g.local_width])


# --- cross-engine parity artifact -------------------------------------------------------------------------------------


def test_parity_artifact_through_vllm_loaders(injected, vllm_env, k3_rank_env, tmp_path, monkeypatch):
    """Load each synthetic checkpoint through vLLM's weight loaders as every rank of every TP size, and write the
    adapter's projections for the cross-engine comparison (tests/engines/test_cross_engine_parity.py)."""
    configs = {"tiny": vllm_env, "k3-rank": k3_rank_env}
    assert (HIDDEN, HEADS, HEAD_DIM) == (TINY.hidden_size, TINY.num_heads, TINY.head_dim)
    results = {}
    for name, geometry in CHECKPOINTS.items():
        make_checkpoint(tmp_path / f"{name}.safetensors", geometry)
        tensors = load_checkpoint(tmp_path / f"{name}.safetensors")
        for case in [c for c in PARITY_CASES if c[0] == name]:
            layer = _load_rank(configs[name], tensors, case[1], case[2], monkeypatch)
            projection = layer.kda_projection
            outputs = {}
            for m in PARITY_MS:
                x = parity_input(m, geometry.hidden_size)
                ours = projection(x)
                _assert_equal(ours, _vllm_projection(layer, x), f"{case} M={m}")
                outputs[m] = [t.clone() for t in ours]
            results[case] = {"outputs": outputs, "checksums": loaded_checksums(projection.weights)}
            del layer, projection
    folder = artifacts_dir()
    folder.mkdir(exist_ok=True)
    torch.save({"engine": "vllm", "results": results}, folder / "vllm.pt")
