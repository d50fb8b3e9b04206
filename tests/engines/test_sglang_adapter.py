"""The SGLang adapter against the real sglang==0.5.23 package (CPU): plugins, CLI, registry, layer parity.

Runs in the nox session `sglang` (its own environment: SGLang pins torch). The layer is built by SGLang's own
model code from a tiny Kimi-K3-shaped config on a one-rank gloo group (SGLang's `init_single_process_dist`).
"""

import os
import subprocess
import sys

import pytest
import torch

sglang = pytest.importorskip("sglang")

from engine_helpers import free_port  # noqa: E402
from parity.checkpoint import (  # noqa: E402
    CHECKPOINTS, PARITY_CASES, PARITY_MS, PREFIX, TINY, artifacts_dir, load_checkpoint, loaded_checksums,
    make_checkpoint, parity_input,
)

from kda_backend import plugins  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 256, 8, 32


@pytest.fixture(scope="module")
def loaded():
    """SGLang's own plugin loader runs our entry point and applies the hooks."""
    from sglang.srt.plugins import load_plugins
    from sglang.test.layer_ut_utils import init_single_process_dist

    init_single_process_dist(master_port=free_port())
    load_plugins()


@pytest.fixture(autouse=True)
def host_registered(fresh_plugins, loaded):
    """The core's plugin manager is rebuilt for every test; re-run the entry point as a new process would."""
    import kda_sglang

    kda_sglang.register()


_layer_count = iter(range(10_000))


def _build_layer(seed=0, dtype=torch.bfloat16, merge=True, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM):
    """SGLang's model code path: the (hooked) module attribute, constructed as the model does, weights random."""
    import sglang.srt.models.kimi_k3 as kimi_k3
    from sglang.srt.configs.kimi_linear import KimiLinearConfig

    config = KimiLinearConfig(
        hidden_size=hidden, num_attention_heads=4, rms_norm_eps=1e-5,
        linear_attn_config={
            "head_dim": head_dim, "num_heads": heads, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "kda_layers": [1], "full_attn_layers": [2],
        },
    )
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        layer = kimi_k3.KimiK3DeltaAttention(
            layer_idx=0, hidden_size=hidden, config=config, prefix=f"model.layers.{next(_layer_count)}.self_attn"
        )
    finally:
        torch.set_default_dtype(previous)
    gen = torch.Generator().manual_seed(seed)
    for p in (layer.fused_qkvg_proj.weight, layer.f_a_proj.weight, layer.b_proj.weight, layer.f_b_proj.weight):
        p.data.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
    if merge:
        layer._merge_bfa_weights()  # what SGLang's post_load_weights does
    return layer


@pytest.fixture
def kda_backend_selected():
    from sglang.srt.runtime_context import get_context

    with get_context().override_server_args(attention_backend="kda"):
        yield


def test_adapter_import_is_light():
    code = "import sys, kda_sglang; print([m for m in ('torch', 'sglang', 'kda_backend') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registered_everywhere_sglang_looks():
    import sglang.srt.models.kimi_k3 as kimi_k3
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    from kda_sglang.layer import KdaBackendKimiK3DeltaAttention

    assert ATTENTION_BACKEND_CHOICES.count("kda") == 1
    assert "kda" in ATTENTION_BACKENDS
    assert "kda" in AttentionBackendRegistry._handlers
    assert kimi_k3.KimiK3DeltaAttention is KdaBackendKimiK3DeltaAttention
    assert "sglang-host" in plugins.plugin_names()


def test_register_twice_is_harmless():
    import kda_sglang
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.plugins.hook_registry import HookRegistry

    kda_sglang.register()
    kda_sglang.register()
    assert ATTENTION_BACKEND_CHOICES.count("kda") == 1
    assert len(HookRegistry._hooks["sglang.srt.models.kimi_k3.KimiK3DeltaAttention"]) == 1


def test_sglang_cli_accepts_kda():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kda" in proc.stdout.split("--attention-backend", 1)[1].split("--", 1)[0]


def test_sglang_argument_parsing_takes_kda():
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "dummy", "--attention-backend", "kda"])
    assert args.attention_backend == "kda"


@pytest.mark.parametrize(
    "env,expect",
    [({"SGLANG_PLUGINS": "none-of-ours"}, False), ({"KDA_BACKEND_DISABLE": "1"}, False), ({}, True)],
    ids=["sglang-filter-excludes", "kda-disabled", "default"],
)
def test_plugin_switches(env, expect):
    code = (
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import sglang.srt.models.kimi_k3 as m\n"
        "from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS\n"
        "print(m.KimiK3DeltaAttention.__name__, 'kda' in ATTENTION_BACKENDS)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    injected = "KdaBackendKimiK3DeltaAttention True" in proc.stdout
    plain = "KimiK3DeltaAttention False" in proc.stdout
    assert (injected, plain) == (expect, not expect), proc.stdout + proc.stderr[-2000:]


def test_sglang_builds_our_subclass():
    from kda_sglang.layer import KdaBackendKimiK3DeltaAttention

    assert type(_build_layer()) is KdaBackendKimiK3DeltaAttention


@pytest.mark.parametrize("defer_f_b", [False, True], ids=["f_b", "defer_f_b"])
@pytest.mark.parametrize("m", range(1, 17))
def test_projection_bitwise_equal_to_sglang(kda_backend_selected, m, defer_f_b):
    import sglang.srt.models.kimi_k3 as kimi_k3

    layer = _build_layer(seed=m)
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(100 + m)).bfloat16()
    ours = layer.forward_qkvbfg_fused(x, defer_f_b=defer_f_b)
    assert layer._kda_projection is not None
    theirs = kimi_k3.KimiK3DeltaAttention.__mro__[1].forward_qkvbfg_fused(layer, x, defer_f_b=defer_f_b)
    for name, a, b in zip(("qkv", "beta", "forget_gate", "g_proj"), ours, theirs):
        assert a.shape == b.shape and not a.isnan().any(), name
        assert torch.equal(a, b), f"{name} differs at M={m}"


def test_weight_views_share_sglang_storage(kda_backend_selected):
    layer = _build_layer()
    layer.forward_qkvbfg_fused(torch.randn(2, HIDDEN).bfloat16())
    w = layer._kda_projection.weights
    assert w.w_qkvg.data_ptr() == layer.fused_qkvg_proj.weight.data_ptr()
    assert w.w_fab.data_ptr() == layer._bfa_w.data_ptr()
    assert w.w_fb.data_ptr() == layer._bfa_f_b_w.data_ptr()


def test_other_backends_keep_sglang_method():
    layer = _build_layer()
    layer.forward_qkvbfg_fused(torch.randn(2, HIDDEN).bfloat16())
    assert layer._kda_projection is None


def test_unmerged_weights_keep_sglang_method(kda_backend_selected, kda_log):
    layer = _build_layer(merge=False)
    layer.forward_qkvbfg_fused(torch.randn(2, HIDDEN).bfloat16())
    assert layer._kda_projection is None
    assert any("did not merge" in m for m in kda_log.messages())


def test_fork_decision_follows_sglang_capture_mode():
    from sglang.srt.model_executor.runner_utils import capture_mode

    from kda_sglang.injection import SglangHost

    host = SglangHost()
    assert host.kda_host_fork_allowed(torch.device("cuda", 0)) is False
    with capture_mode.model_capture_mode():
        assert host.kda_host_fork_allowed(torch.device("cuda", 0)) is True


def test_full_attention_delegate_per_platform():
    from kda_sglang.injection import full_attention_backend_name

    assert full_attention_backend_name((9, 0)) == "fa3"
    assert full_attention_backend_name((10, 0)) == "trtllm_mla"
    assert full_attention_backend_name(None) == "triton"


SGLANG_QKVG_SHARD_IDS = {"q_proj": 0, "k_proj": 1, "v_proj": 2, "g_proj": 3}


def _load_rank(tensors, geometry, tp, rank):
    """SGLang's layer for rank ``rank`` of ``tp`` (SGLang's own ``parallel_scope`` test helper sets the TP and
    attention-TP rank and size the linear layers read), weights loaded from the unsharded checkpoint by SGLang's
    loaders, then ``_merge_bfa_weights`` as ``post_load_weights`` does."""
    from sglang.test.parallel_groups import parallel_scope

    # moe_tp_size keeps the topology consistent (tp = moe_ep * moe_dp * moe_tp); the layer has no MoE.
    with parallel_scope(tp_rank=rank, tp_size=tp, attn_tp_rank=rank, attn_tp_size=tp, moe_tp_size=tp):
        layer = _build_layer(merge=False, hidden=geometry.hidden_size, heads=geometry.num_heads,
                             head_dim=geometry.head_dim)
        qkvg = layer.fused_qkvg_proj.weight
        for name, shard_id in SGLANG_QKVG_SHARD_IDS.items():
            qkvg.weight_loader(qkvg, tensors[f"{PREFIX}.{name}.weight"], shard_id)
        for name in ("f_a_proj", "b_proj", "f_b_proj"):
            param = getattr(layer, name).weight
            param.weight_loader(param, tensors[f"{PREFIX}.{name}.weight"])
        layer._merge_bfa_weights()
    assert layer.attn_tp_size == tp and layer.local_num_heads == geometry.num_heads // tp
    return layer


def test_parity_artifact_through_sglang_loaders(kda_backend_selected, tmp_path, monkeypatch):
    """Load each synthetic checkpoint through SGLang's weight loaders as every rank of every TP size, and write
    the adapter's projections for the cross-engine comparison (tests/engines/test_cross_engine_parity.py)."""
    import sglang.kernels.ops.gemm.kimi_k3 as sglang_tiny_gemm
    import sglang.srt.models.kimi_k3 as kimi_k3

    # SGLang's native path sends the exact K3 TP8 shapes to a CUDA-only tiny-GEMM kernel; on the CPU its own
    # F.linear fallback (what every other shape gets) stands in for it.
    monkeypatch.setattr(sglang_tiny_gemm, "_K3_TINY_GEMM_MAX_TOKENS", {})

    assert (HIDDEN, HEADS, HEAD_DIM) == (TINY.hidden_size, TINY.num_heads, TINY.head_dim)
    results = {}
    for name, geometry in CHECKPOINTS.items():
        make_checkpoint(tmp_path / f"{name}.safetensors", geometry)
        tensors = load_checkpoint(tmp_path / f"{name}.safetensors")
        for case in [c for c in PARITY_CASES if c[0] == name]:
            layer = _load_rank(tensors, geometry, case[1], case[2])
            outputs = {}
            for m in PARITY_MS:
                x = parity_input(m, geometry.hidden_size)
                qkv, beta, forget_gate, g_proj = layer.forward_qkvbfg_fused(x)
                native = kimi_k3.KimiK3DeltaAttention.__mro__[1].forward_qkvbfg_fused(layer, x)
                assert all(torch.equal(a, b) for a, b in zip((qkv, beta, forget_gate, g_proj), native)), (case, m)
                outputs[m] = [torch.cat([qkv, g_proj], dim=-1), forget_gate.clone(), beta.clone()]
            results[case] = {"outputs": outputs, "checksums": loaded_checksums(layer._kda_projection.weights)}
            del layer
    folder = artifacts_dir()
    folder.mkdir(exist_ok=True)
    torch.save({"engine": "sglang", "results": results}, folder / "sglang.pt")
