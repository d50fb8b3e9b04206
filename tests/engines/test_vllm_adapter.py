"""The vLLM adapter against the real vllm==0.33 package (CPU): plugin loading, injection, projection parity.

Runs in the nox session `vllm` (its own environment: vLLM pins torch). The layer is built by vLLM's own code
from a tiny Kimi-K3-shaped config on a one-rank gloo group, as vLLM's CPU tests do.
"""

import json
import subprocess
import sys

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.config import DeviceConfig, ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402

from engine_helpers import free_port  # noqa: E402
from parity.checkpoint import (  # noqa: E402
    CHECKPOINTS, K3_RANK, PARITY_CASES, PARITY_MS, PREFIX, TINY, artifacts_dir, load_checkpoint, loaded_checksums,
    make_checkpoint, parity_input,
)

from kda_backend import plugins  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 256, 8, 32


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
    """vLLM's own plugin loader runs our entry point."""
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    from vllm.model_executor.custom_op import op_registry_oot

    from kda_vllm.layer import KdaBackendKimiK3DeltaAttention

    assert op_registry_oot.get("KimiK3DeltaAttention") is KdaBackendKimiK3DeltaAttention
    return KdaBackendKimiK3DeltaAttention


@pytest.fixture(autouse=True)
def host_registered(fresh_plugins):
    """The core's plugin manager is rebuilt for every test; re-run the entry point as a new process would."""
    import kda_vllm

    kda_vllm.register()


_layer_count = iter(range(10_000))


def _build_layer(vllm_env, dtype=torch.bfloat16, seed=0):
    """vLLM's model code path: construct vLLM's KimiK3DeltaAttention class, fill weights with random values."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention
    from vllm.utils.torch_utils import set_default_torch_dtype

    with set_current_vllm_config(vllm_env), set_default_torch_dtype(dtype):
        layer = KimiK3DeltaAttention(
            vllm_env.model_config.hf_config, vllm_env, prefix=f"model.layers.{next(_layer_count)}.self_attn"
        )
    gen = torch.Generator().manual_seed(seed)
    for p in (layer.in_proj_qkvgfab.weight, layer.f_b_proj.weight, layer.o_proj.weight):
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    return layer


def test_adapter_import_is_light():
    code = "import sys, kda_vllm; heavy = [m for m in ('torch', 'vllm', 'kda_backend') if m in sys.modules]; print(heavy)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_vllm_builds_our_subclass(injected, vllm_env):
    layer = _build_layer(vllm_env)
    assert type(layer) is injected
    assert "vllm-host" in plugins.plugin_names()


def test_register_twice_is_harmless(injected, vllm_env):
    import kda_vllm

    kda_vllm.register()
    kda_vllm.register()
    assert type(_build_layer(vllm_env)) is injected


@pytest.mark.parametrize(
    "env,expect_injected",
    [({"VLLM_PLUGINS": ""}, False), ({"KDA_BACKEND_DISABLE": "1"}, False), ({"VLLM_PLUGINS": "kda_backend"}, True)],
    ids=["vllm-allowlist-empty", "kda-disabled", "vllm-allowlist-ours"],
)
def test_plugin_switches(env, expect_injected):
    code = (
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.model_executor.custom_op import op_registry_oot\n"
        "print(type(op_registry_oot.get('KimiK3DeltaAttention')).__name__,"
        " getattr(op_registry_oot.get('KimiK3DeltaAttention'), '__name__', None))\n"
    )
    import os

    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    injected = "KdaBackendKimiK3DeltaAttention" in proc.stdout
    assert injected == expect_injected, proc.stdout + proc.stderr[-2000:]


def _vllm_projection(layer, x):
    """vLLM's own sequential projection on the same weights (its non-overlap branch)."""
    projected = layer.in_proj_qkvgfab(x)[0]
    lps, d, h = layer.local_projection_size, layer.head_dim, layer.local_num_heads
    mixed, g_proj, f_a, beta = projected.split([3 * lps, lps, d, h, layer.in_proj_padding], dim=-1)[:4]
    g1 = layer.f_b_proj(f_a)[0]
    return torch.cat([mixed, g_proj], dim=-1), g1, beta


@pytest.mark.parametrize("m", range(1, 17))
def test_projection_bitwise_equal_to_vllm(injected, vllm_env, m):
    layer = _build_layer(vllm_env, seed=m)
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(100 + m)).bfloat16()
    ours = layer.kda_projection()(x)
    theirs = _vllm_projection(layer, x)
    for name, a, b in zip(("qkvg", "g1", "beta"), ours, theirs):
        assert a.shape == b.shape and not a.isnan().any(), name
        assert torch.equal(a, b), f"{name} differs at M={m}"


def test_weight_views_share_vllm_storage(injected, vllm_env):
    layer = _build_layer(vllm_env)
    w = layer.kda_projection().weights
    assert w.packed.data_ptr() == layer.in_proj_qkvgfab.weight.data_ptr()
    assert w.w_qkvg.data_ptr() == layer.in_proj_qkvgfab.weight.data_ptr()
    assert w.w_fb.data_ptr() == layer.f_b_proj.weight.data_ptr()
    assert w.geometry.packed_rows == layer.in_proj_qkvgfab.weight.shape[0]


def test_forward_hands_vllm_the_same_tensors(injected, vllm_env, monkeypatch):
    """Our forward and vLLM's own forward, with vLLM's core and o_proj stubbed to record their inputs."""
    from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

    layer = _build_layer(vllm_env, seed=3)
    calls = []

    def record(**kw):
        calls.append({k: v.clone() for k, v in kw.items() if k != "core_attn_out"})
        kw["core_attn_out"].fill_(0.5)

    monkeypatch.setattr(layer, "_forward", record)
    x = torch.randn(5, HIDDEN).bfloat16()
    ours = layer.forward(x, torch.arange(5))
    theirs = KimiK3DeltaAttention.forward(layer, x, torch.arange(5))
    assert torch.equal(ours, theirs)
    assert calls[0].keys() == calls[1].keys() == {"mixed_qkv", "g1", "g2", "beta"}
    for key in calls[0]:
        assert calls[0][key].shape == calls[1][key].shape and torch.equal(calls[0][key], calls[1][key]), key


def test_non_bf16_weights_keep_vllm_path(injected, vllm_env, kda_log):
    layer = _build_layer(vllm_env, dtype=torch.float32)
    assert layer.kda_projection() is None
    assert any("not bfloat16" in m for m in kda_log.messages())


def test_fork_decision_from_vllm_state(injected, monkeypatch):
    from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture

    from kda_vllm.injection import VllmHost

    host, dev = VllmHost(), torch.device("cuda", 0)
    assert host.kda_host_fork_allowed(dev) is False  # eager, warm-up, profiling: not capturing
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert host.kda_host_fork_allowed(dev) is True  # a FULL capture
    monkeypatch.setattr(BreakableCUDAGraphCapture._tls, "active", object(), raising=False)
    assert host.kda_host_fork_allowed(dev) is False  # a breakable (piecewise) capture


def test_cache_dir_under_vllm_cache_root(injected, monkeypatch, tmp_path):
    import vllm.envs

    monkeypatch.delenv("KDA_BACKEND_CACHE_DIR", raising=False)
    monkeypatch.setenv("VLLM_CACHE_ROOT", str(tmp_path))
    assert str(vllm.envs.VLLM_CACHE_ROOT) == str(tmp_path)
    assert plugins.hooks.cache_dir() == tmp_path / "kda_backend"


def test_plan_shared_from_rank0_on_one_rank(injected):
    plan = {"plan": {"steps": {}}, "tactics": []}
    assert plugins.hooks.share_plan(plan) == plan


VLLM_SHARD_IDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "g_proj": 3, "f_a_proj": 4, "b_proj": 5}


class _TensorParallelRank:
    """vLLM's tensor-parallel group as rank ``rank`` of ``size`` sees it. Layer shapes and every weight loader's
    shard offsets come from this group's ``rank_in_group`` and ``world_size``; the projection stage itself does
    no communication, so one process can stand in for each rank in turn."""

    def __init__(self, group, rank: int, size: int) -> None:
        self._group, self.rank_in_group, self.world_size = group, rank, size

    def __getattr__(self, name):
        return getattr(self._group, name)


def _load_rank(vllm_config, tensors, tp, rank, monkeypatch):
    """vLLM's layer for rank ``rank`` of ``tp``, its weights loaded from the unsharded checkpoint by vLLM's
    loaders (stacked shard ids; f_a, shard 4, replicated)."""
    from vllm.distributed import parallel_state

    with monkeypatch.context() as patch:
        patch.setattr(parallel_state, "_TP", _TensorParallelRank(parallel_state._TP, rank, tp))
        layer = _build_layer(vllm_config)
        packed = layer.in_proj_qkvgfab.weight
        for name, shard_id in VLLM_SHARD_IDS.items():
            packed.weight_loader(packed, tensors[f"{PREFIX}.{name}.weight"], shard_id)
        layer.f_b_proj.weight.weight_loader(layer.f_b_proj.weight, tensors[f"{PREFIX}.f_b_proj.weight"])
    assert layer.tp_size == tp and layer.local_num_heads == layer.num_heads // tp
    return layer


def test_parity_artifact_through_vllm_loaders(injected, vllm_env, tmp_path, monkeypatch):
    """Load each synthetic checkpoint through vLLM's weight loaders as every rank of every TP size, and write the
    adapter's projections for the cross-engine comparison (tests/engines/test_cross_engine_parity.py)."""
    configs = {"tiny": vllm_env, "k3-rank": _vllm_config(tmp_path, K3_RANK.hidden_size, K3_RANK.num_heads,
                                                          K3_RANK.head_dim)}
    assert (HIDDEN, HEADS, HEAD_DIM) == (TINY.hidden_size, TINY.num_heads, TINY.head_dim)
    results = {}
    for name, geometry in CHECKPOINTS.items():
        make_checkpoint(tmp_path / f"{name}.safetensors", geometry)
        tensors = load_checkpoint(tmp_path / f"{name}.safetensors")
        for case in [c for c in PARITY_CASES if c[0] == name]:
            layer = _load_rank(configs[name], tensors, case[1], case[2], monkeypatch)
            projection = layer.kda_projection()
            outputs = {}
            for m in PARITY_MS:
                x = parity_input(m, geometry.hidden_size)
                ours = projection(x)
                theirs = _vllm_projection(layer, x)
                assert all(torch.equal(a, b) for a, b in zip(ours, theirs)), (case, m)
                outputs[m] = [t.clone() for t in ours]
            results[case] = {"outputs": outputs, "checksums": loaded_checksums(projection.weights)}
            del layer, projection
    folder = artifacts_dir()
    folder.mkdir(exist_ok=True)
    torch.save({"engine": "vllm", "results": results}, folder / "vllm.pt")
