"""The SGLang adapter against the real sglang==0.5.23 package (CPU): plugins, argument resolution, MLA dispatch,
the KDA layer, load-time plans and parity.

Runs in the nox session `sglang` (its own environment: SGLang pins torch). Layers are built by SGLang's own model
code on a one-rank gloo group (SGLang's `init_single_process_dist`); platforms are emulated with SGLang's
`override_platform`, server arguments resolved by SGLang's own `prepare_server_args` / `resolve_once` for a
Kimi-K3 config.
"""

import dataclasses
import json
import logging
import os
import subprocess
import sys
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

sglang = pytest.importorskip("sglang")

from engine_helpers import CountingShare, free_port  # noqa: E402
from parity.checkpoint import (  # noqa: E402
    CHECKPOINTS, PARITY_CASES, PARITY_MS, PREFIX, TINY, artifacts_dir, load_checkpoint, loaded_checksums,
    make_checkpoint, parity_input,
)

from kda_backend import GemmProvider, hookimpl, plugins, register_plugin  # noqa: E402
from kda_backend.geometry import preset  # noqa: E402

HIDDEN, HEADS, HEAD_DIM = 256, 8, 32

# Kimi-K3's text model with four layers (three KDA, one MLA): what SGLang's resolution reads from a checkpoint.
K3_CONFIG = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "model_type": "kimi_k3",
    "torch_dtype": "bfloat16",
    "text_config": {
        "model_type": "kimi_linear", "architectures": ["KimiK3LinearForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
        "num_hidden_layers": 4, "num_attention_heads": 64, "num_key_value_heads": 64, "q_lora_rank": 1536,
        "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "num_experts": 16,
        "num_experts_per_token": 4, "num_shared_experts": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 8192, "mla_use_output_gate": True,
        "linear_attn_config": {
            "head_dim": 128, "num_heads": 96, "short_conv_kernel_size": 4, "gate_lower_bound": -5.0,
            "use_full_rank_gate": True, "kda_layers": [1, 2, 3], "full_attn_layers": [4],
        },
    },
}
_CUDA = dict(is_cuda=True, is_hip=False, is_npu=False, is_xpu=False, is_musa=False, is_mps=False, is_sm110=False,
             is_sm120=False, has_flashinfer=True)
# What SGLang's probes answer on an H200 (CUDA >= 12.3), a B200 and a B300; `delegate` is SGLang's default for Kimi-K3
# there.
PLATFORMS = {
    "sm90": dict(facts=dict(_CUDA, is_sm90=True, is_hopper_with_cuda_12_3=True, is_sm100=False,
                            is_sm100_or_sm110=False, is_blackwell=False, device_sm=90, device_capability=(9, 0)),
                 delegate="fa3"),
    "sm100": dict(facts=dict(_CUDA, is_sm90=False, is_hopper_with_cuda_12_3=False, is_sm100=True,
                             is_sm100_or_sm110=True, is_blackwell=True, device_sm=100, device_capability=(10, 0)),
                  delegate="trtllm_mla"),
    "sm103": dict(facts=dict(_CUDA, is_sm90=False, is_hopper_with_cuda_12_3=False, is_sm100=True,
                             is_sm100_or_sm110=True, is_blackwell=True, device_sm=103, device_capability=(10, 3)),
                  delegate="trtllm_mla"),
}
SPECULATIVE = {"no-spec": [], "eagle": ["--speculative-algorithm", "EAGLE"]}


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


@contextmanager
def _published(server_args):
    """``server_args`` resolved and published as a scheduler process does; the previous context comes back after."""
    from sglang.srt.runtime_context import publish, restore_context, snapshot_context

    state = snapshot_context()
    try:
        publish(server_args, role="scheduler")
        yield server_args
    finally:
        restore_context(state)


@pytest.fixture
def kda_backend_selected():
    """A scheduler of a server started with ``--attention-backend kda`` (no model: resolution stops early)."""
    from sglang.srt.server_args import ServerArgs

    with _published(ServerArgs(model_path="dummy", attention_backend="kda")):
        yield


_layer_count = iter(range(10_000))


def _build_layer(seed=0, dtype=torch.bfloat16, merge=True, hidden=HIDDEN, heads=HEADS, head_dim=HEAD_DIM):
    """SGLang's model code path: the (hooked) module attribute, constructed as the model does, weights random, then
    ``_merge_bfa_weights`` as SGLang's ``post_load_weights`` calls it."""
    from sglang.srt.configs.kimi_linear import KimiLinearConfig
    from sglang.srt.models import kimi_k3

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
        layer._merge_bfa_weights()
    return layer


def _sglang_method(layer, x, defer_f_b):
    """SGLang's own ``forward_qkvbfg_fused`` on the same layer."""
    from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention

    return KimiK3DeltaAttention.__mro__[1].forward_qkvbfg_fused(layer, x, defer_f_b=defer_f_b)


def _assert_same_outputs(ours, theirs, what):
    """Bitwise: values, shapes, strides and dtypes of SGLang's ``(qkv, beta, forget_gate, g_proj)``."""
    for name, a, b in zip(("qkv", "beta", "forget_gate", "g_proj"), ours, theirs, strict=True):
        assert (a.shape, a.stride(), a.dtype) == (b.shape, b.stride(), b.dtype), f"{what}: {name} layout"
        assert not a.isnan().any(), f"{what}: {name} has NaN"
        assert torch.equal(a, b), f"{what}: {name} differs"


# --- plugin and registration -----------------------------------------------------------------------------------------


def test_adapter_import_is_light():
    code = "import sys, kda_sglang; print([m for m in ('torch', 'sglang', 'kda_backend') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_registered_where_sglang_looks_and_nowhere_else():
    """``kda`` is a CLI choice resolved away at the first resolution step: it is no attention backend of its own,
    so nothing in SGLang's backend registry or MLA handler table can ever see it."""
    from kda_sglang.injection import FIRST_RESOLUTION_STEP, kda_means_platform_default
    from kda_sglang.layer import KdaBackendKimiK3DeltaAttention
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS
    from sglang.srt.models import kimi_k3
    from sglang.srt.models.deepseek_common.attention_backend_handler import AttentionBackendRegistry

    assert ATTENTION_BACKEND_CHOICES.count("kda") == 1
    assert _HOOKS[FIRST_RESOLUTION_STEP] == [kda_means_platform_default]
    assert "kda" not in ATTENTION_BACKENDS and "kda" not in AttentionBackendRegistry._handlers
    assert kimi_k3.KimiK3DeltaAttention is KdaBackendKimiK3DeltaAttention
    assert "sglang-host" in plugins.plugin_names()


def test_first_resolution_step_is_the_first_pipeline_step():
    """The step our wrapper rides on must run before every other step (all of them may read the backend)."""
    import inspect

    from kda_sglang.injection import FIRST_RESOLUTION_STEP
    from sglang.srt.arg_groups import pipeline

    source = inspect.getsource(pipeline.run_resolution_pipeline)
    assert source.index("run_hook(") == source.index(f"run_hook({FIRST_RESOLUTION_STEP},")
    assert "run_post_process_pass(" not in source[: source.index("run_hook(")]


def test_register_twice_is_harmless():
    import kda_sglang
    from kda_sglang.injection import FIRST_RESOLUTION_STEP
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.arg_groups.resolution_hooks import _HOOKS
    from sglang.srt.plugins.hook_registry import HookRegistry

    kda_sglang.register()
    kda_sglang.register()
    assert ATTENTION_BACKEND_CHOICES.count("kda") == 1
    assert len(_HOOKS[FIRST_RESOLUTION_STEP]) == 1
    assert len(HookRegistry._hooks["sglang.srt.models.kimi_k3.KimiK3DeltaAttention"]) == 1


def test_sglang_cli_accepts_kda():
    proc = subprocess.run(
        [sys.executable, "-m", "sglang.launch_server", "--help"], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kda" in proc.stdout.split("--attention-backend", 1)[1].split("--", 1)[0]


def test_a_layer_that_fails_to_load_leaves_kda_a_choice_and_sglang_its_layer():
    """Where the KDA layer cannot be imported, SGLang's plugin loader logs the error and carries on: ``kda`` still
    parses (the choice and the resolution step come before the layer), and SGLang's own layer stays in place."""
    code = (
        "import sys\n"
        "sys.modules['kda_sglang.layer'] = None  # importing it now raises ImportError\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "import sglang.srt.models.kimi_k3 as m\n"
        "from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES\n"
        "from kda_sglang import injection\n"
        "print(m.KimiK3DeltaAttention.__name__, 'kda' in ATTENTION_BACKEND_CHOICES, injection._layer_load_failure)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "KimiK3DeltaAttention True ModuleNotFoundError: import of kda_sglang.layer halted" in proc.stdout, proc.stdout
    assert "Failed to execute general plugin: kda_backend" in proc.stderr  # SGLang logged the import error


def test_kda_is_refused_at_resolution_where_the_layer_failed_to_load(k3_model_path, monkeypatch):
    """``--attention-backend kda`` after a failed layer import: resolution refuses it with the import's reason
    instead of serving SGLang's own projection silently; no backend given resolves as always."""
    from kda_sglang import injection

    monkeypatch.setitem(sys.modules, "kda_sglang.layer", None)
    with pytest.raises(ImportError, match="kda_sglang.layer"):
        injection.install()
    with pytest.raises(ValueError, match=r"--attention-backend kda: kda-backend's KDA layer failed to load "
                                         r"\(ModuleNotFoundError: import of kda_sglang.layer halted"):
        _resolve(k3_model_path, "sm90", ["--attention-backend", "kda"])
    assert _resolve(k3_model_path, "sm90", []).resolved_dict()["attention_backend"] == "fa3"
    monkeypatch.undo()
    injection.install()  # the layer loads again: kda resolves as the platform's default
    assert _resolve(k3_model_path, "sm90", ["--attention-backend", "kda"]).attention_backend == "kda"


@pytest.mark.parametrize(
    "env,expect",
    [({"SGLANG_PLUGINS": "none-of-ours"}, False), ({"KDA_BACKEND_DISABLE": "1"}, False), ({}, True)],
    ids=["sglang-filter-excludes", "kda-disabled", "default"],
)
def test_plugin_switches(env, expect):
    """SGLang's plugin filter and the kill switch keep SGLang's layer and choices; switched off, the core (the
    projection, its providers and plugins) is not even imported."""
    code = (
        "import sys\n"
        "from sglang.srt.plugins import load_plugins\n"
        "load_plugins()\n"
        "core = 'kda_backend.projection' in sys.modules\n"
        "import sglang.srt.models.kimi_k3 as m\n"
        "from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES\n"
        "print(m.KimiK3DeltaAttention.__name__, 'kda' in ATTENTION_BACKEND_CHOICES, 'core' if core else 'no-core')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env}, check=False
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    injected = "KdaBackendKimiK3DeltaAttention True" in proc.stdout
    plain = "KimiK3DeltaAttention False no-core" in proc.stdout
    assert (injected, plain) == (expect, not expect), proc.stdout + proc.stderr[-2000:]


# --- argument resolution: `kda` leaves every full-attention decision to SGLang's default --------------------------


@pytest.fixture(scope="module")
def k3_model_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-k3")
    (path / "config.json").write_text(json.dumps(K3_CONFIG))
    return str(path)


def _resolve(model_path, platform, argv, tp=8):
    """SGLang's launcher path: ``prepare_server_args`` then ``resolve_once``, on the emulated platform. Arguments
    this process publishes take ``tp=1``: publishing checks them against the one-rank group this process has."""
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import prepare_server_args

    # A fixed seed: an unset one is drawn at random during resolution.
    base = ["--model-path", model_path, "--tp", str(tp), "--device", "cuda", "--random-seed", "0"]
    with override_platform(**PLATFORMS[platform]["facts"]):
        server_args = prepare_server_args(base + argv)
        server_args.resolve_once()
    return server_args


@pytest.mark.parametrize("spec", SPECULATIVE, ids=list(SPECULATIVE))
@pytest.mark.parametrize("platform", PLATFORMS, ids=list(PLATFORMS))
def test_kda_resolves_as_the_platform_default(k3_model_path, platform, spec):
    """Every resolved field with ``--attention-backend kda`` equals SGLang's with no backend given (page size, KV
    dtype, prefill/decode backends, speculative settings, ...); the operator's raw input records ``kda``."""
    default = _resolve(k3_model_path, platform, SPECULATIVE[spec])
    kda = _resolve(k3_model_path, platform, ["--attention-backend", "kda", *SPECULATIVE[spec]])
    resolved, expected = kda.resolved_dict(), default.resolved_dict()
    assert resolved.keys() == expected.keys()
    assert {k: (resolved[k], expected[k]) for k in expected if resolved[k] != expected[k]} == {}
    assert expected["attention_backend"] == PLATFORMS[platform]["delegate"]
    assert (kda.attention_backend, default.attention_backend) == ("kda", None)
    raw_kda, raw_default = dict(kda._raw_input), dict(default._raw_input)
    assert raw_kda.pop("attention_backend") == "kda" and raw_default.pop("attention_backend") is None
    assert raw_kda == raw_default


@pytest.mark.parametrize("spec", SPECULATIVE, ids=list(SPECULATIVE))
@pytest.mark.parametrize("platform", PLATFORMS, ids=list(PLATFORMS))
def test_kda_resolves_as_the_delegate_named(k3_model_path, platform, spec):
    """The same against ``--attention-backend <delegate>``. Naming it makes SGLang skip Kimi-K3's SM100 default
    of split prefill/decode fields (which name the same backend): there the (prefill, decode) pair is compared."""
    from sglang.srt.arg_groups.overrides import attention_backends_of

    named = _resolve(k3_model_path, platform, ["--attention-backend", PLATFORMS[platform]["delegate"],
                                               *SPECULATIVE[spec]])
    kda = _resolve(k3_model_path, platform, ["--attention-backend", "kda", *SPECULATIVE[spec]])
    resolved, expected = kda.resolved_dict(), named.resolved_dict()
    split = {"prefill_attention_backend", "decode_attention_backend"}
    assert {k: (resolved[k], expected[k]) for k in expected if k not in split and resolved[k] != expected[k]} == {}
    pair = (PLATFORMS[platform]["delegate"],) * 2
    assert attention_backends_of(SimpleNamespace(**resolved)) == attention_backends_of(SimpleNamespace(**expected))
    assert attention_backends_of(SimpleNamespace(**resolved)) == pair


@pytest.mark.parametrize("platform", PLATFORMS, ids=list(PLATFORMS))
def test_every_scheduler_knows_kda_was_chosen(k3_model_path, platform):
    """The launcher's resolved record reaches a scheduler pickled (SGLang spawns them); there the resolved config
    names the delegate while the adapter still reads `kda` from the operator's input."""
    import pickle

    from sglang.srt.runtime_context import get_exec

    from kda_sglang.injection import kda_selected

    launched = _resolve(k3_model_path, platform, ["--attention-backend", "kda"], tp=1)
    with _published(pickle.loads(pickle.dumps(launched))):
        assert kda_selected()
        assert get_exec().kernel.attention_backend == PLATFORMS[platform]["delegate"]
    with _published(pickle.loads(pickle.dumps(_resolve(k3_model_path, platform, [], tp=1)))):
        assert not kda_selected()


def test_sm100_page_size_is_trtllm_mla_s(k3_model_path):
    """The regression that started it: SM 10.x resolved page size 1 for `kda`, where TRT-LLM MLA needs 64."""
    assert _resolve(k3_model_path, "sm100", ["--attention-backend", "kda"]).resolved_dict()["page_size"] == 64


@pytest.mark.parametrize("flag", ["--prefill-attention-backend", "--decode-attention-backend"])
def test_kda_on_a_split_backend_flag_is_refused(k3_model_path, flag):
    with pytest.raises(ValueError, match=f"{flag} kda: .* --attention-backend only"):
        _resolve(k3_model_path, "sm90", [flag, "kda"])


# --- the MLA layers: SGLang's own forward-method dispatch ----------------------------------------------------------

FORWARD_CASES = {  # forward mode, prefix lengths of the batch
    "decode": ("DECODE", [0, 0]),
    "prefill": ("EXTEND", [0, 0]),
    "prefill-cached-prefix": ("EXTEND", [9000, 128]),
    "target-verify": ("TARGET_VERIFY", [64, 64]),
}


def _mla_dispatch(server_args, platform):
    """What ``KimiK3MLAAttention.dispatch_attn_forward_method`` picks for each forward case in a scheduler that
    published ``server_args``, after the model runner stamped its resolved (prefill, decode) pair on the backend:
    ``{case: (forward method, backend name the layer records)}``."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
    from sglang.srt.model_executor.model_runner_components.attention_backend_setup import (
        resolve_attention_backend_strs,
    )
    from sglang.srt.models.kimi_k3 import KimiK3MLAAttention
    from sglang.srt.runtime_context import override_platform

    out = {}
    with override_platform(**PLATFORMS[platform]["facts"]), _published(server_args):
        pair = resolve_attention_backend_strs(
            model_runner=SimpleNamespace(is_draft_worker=False, draft_attention_backend=None)
        )
        backend = SimpleNamespace(prefill_attention_backend_str=pair.prefill, decode_attention_backend_str=pair.decode)
        # The layer's dispatch inputs, set by SGLang's own initialisers from the published config.
        attn = KimiK3MLAAttention.__new__(KimiK3MLAAttention)
        torch.nn.Module.__init__(attn)
        attn.qk_rope_head_dim = K3_CONFIG["text_config"]["qk_rope_head_dim"]
        attn.init_mha_forward()
        attn.init_mla_forward()
        with forward_context(ForwardContext(attn_backend=backend)):
            for case, (mode, prefix_lens) in FORWARD_CASES.items():
                batch = SimpleNamespace(
                    forward_mode=getattr(ForwardMode, mode), extend_prefix_lens_cpu=prefix_lens,
                    seq_lens_cpu=[n + 16 for n in prefix_lens], get_max_chunk_capacity=lambda: 1 << 20,
                )
                method = KimiK3MLAAttention.dispatch_attn_forward_method(attn, batch)
                out[case] = (method, attn.current_attention_backend)
    return (pair.prefill, pair.decode), out


@pytest.mark.parametrize("spec", SPECULATIVE, ids=list(SPECULATIVE))
@pytest.mark.parametrize("platform", PLATFORMS, ids=list(PLATFORMS))
def test_mla_forward_method_under_kda_is_the_delegates(k3_model_path, platform, spec):
    """The issue: `kda` reached the MLA dispatch, missed FORWARD_ABSORB_CORE_ATTENTION_BACKENDS and the handler
    table, took a non-absorbed branch (and skipped fp8 handling keyed on "fa3"). Now the layers see the delegate."""
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    delegate = PLATFORMS[platform]["delegate"]
    kda = _mla_dispatch(_resolve(k3_model_path, platform, ["--attention-backend", "kda", *SPECULATIVE[spec]], tp=1),
                        platform)
    for argv in ([], ["--attention-backend", delegate]):
        assert kda == _mla_dispatch(_resolve(k3_model_path, platform, argv + SPECULATIVE[spec], tp=1), platform), argv
    assert kda[0] == (delegate, delegate)
    assert {name for _, name in kda[1].values()} == {delegate}
    assert kda[1]["decode"][0] == AttnForwardMethod.MLA  # the absorbed path, with q_rope / k_rope


# --- the KDA layer ---------------------------------------------------------------------------------------------------


class _Recorder(GemmProvider):
    """Serves every GEMM as the torch provider does (``torch.mm``), recording the roles it ran."""

    name, priority = "recorder", 50

    def __init__(self):
        self.calls = []

    def why_not(self, call):
        return None

    def run(self, role, x, w, out):
        self.calls.append(role)
        torch.mm(x, w.t(), out=out)

    @hookimpl
    def kda_gemm_providers(self):
        return [self]


def test_sglang_builds_our_subclass():
    from kda_sglang.layer import KdaBackendKimiK3DeltaAttention

    assert type(_build_layer()) is KdaBackendKimiK3DeltaAttention


@pytest.mark.parametrize("defer_f_b", [False, True], ids=["f_b", "defer_f_b"])
@pytest.mark.parametrize("m", [0, *range(1, 17), 64])
def test_projection_bitwise_equal_to_sglang(kda_backend_selected, m, defer_f_b):
    """SGLang's ``forward_qkvbfg_fused`` contract in both modes: with ``defer_f_b`` (SGLang's fused decode applies
    F_B itself) ``forget_gate`` is f_a and no F_B GEMM runs at all."""
    recorder = _Recorder()
    register_plugin(recorder, recorder.name)
    layer = _build_layer(seed=m)
    assert layer._kda_projection is not None
    x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(100 + m)).bfloat16()
    ours = layer.forward_qkvbfg_fused(x, defer_f_b=defer_f_b)
    _assert_same_outputs(ours, _sglang_method(layer, x, defer_f_b), f"M={m} defer_f_b={defer_f_b}")
    if m:
        assert sorted(recorder.calls) == (["fab", "qkvg"] if defer_f_b else ["fab", "fb", "qkvg"])


def test_weight_views_share_sglang_storage(kda_backend_selected):
    layer = _build_layer()
    w = layer._kda_projection.weights
    assert w.w_qkvg.data_ptr() == layer.fused_qkvg_proj.weight.data_ptr()
    assert w.w_fab.data_ptr() == layer._bfa_w.data_ptr()
    assert w.w_fb.data_ptr() == layer._bfa_f_b_w.data_ptr()


@pytest.mark.parametrize("backend", [None, "triton", "fa3"], ids=["default", "triton", "fa3"])
def test_other_backends_keep_sglang_method(backend):
    """Only ``kda`` turns the projection on; SGLang's own method serves otherwise."""
    from sglang.srt.server_args import ServerArgs

    with _published(ServerArgs(model_path="dummy", attention_backend=backend)):
        layer = _build_layer()
        x = torch.randn(2, HIDDEN).bfloat16()
        assert layer._kda_projection is None
        _assert_same_outputs(layer.forward_qkvbfg_fused(x), _sglang_method(layer, x, False), "SGLang's path")


def test_nothing_published_keeps_sglang_method():
    assert _build_layer()._kda_projection is None


def test_unmerged_weights_keep_sglang_method(kda_backend_selected, kda_log, monkeypatch):
    """Where SGLang leaves [f_a | b] unmerged (NPU, quantized ROCm checkpoints) its own method serves, one warning
    says why, and no forward ever builds a projection."""
    from sglang.srt.models.kimi_k3 import KimiK3DeltaAttention

    monkeypatch.setattr(KimiK3DeltaAttention.__mro__[1], "_merge_bfa_weights", lambda self: None)
    layer = _build_layer()
    assert layer._bfa_w is None and layer._kda_projection is None
    assert any("did not merge" in m for m in kda_log.messages())
    x = torch.randn(3, HIDDEN).bfloat16()
    _assert_same_outputs(layer.forward_qkvbfg_fused(x), _sglang_method(layer, x, False), "unmerged")
    assert layer._kda_projection is None


def test_weights_loaded_without_post_load_weights_keep_sglang_method_with_one_warning(kda_backend_selected, kda_log):
    """SGLang's IPC weight cache maps weights a daemon processed and skips ``post_load_weights``: no projection is
    built, SGLang's method serves, and the first forward says so once (not a silent slow path)."""
    layer = _build_layer(merge=False)
    x = torch.randn(3, HIDDEN).bfloat16()
    for _ in range(2):
        _assert_same_outputs(layer.forward_qkvbfg_fused(x), _sglang_method(layer, x, False), "no post-load")
    assert layer._kda_projection is None
    assert sum("loaded without post_load_weights" in m for m in kda_log.messages()) == 1


def test_projection_that_cannot_build_keeps_sglang_method_with_one_error(kda_backend_selected, kda_log, monkeypatch):
    """Where building fails after the plan was shared (a kernel that does not compile, memory), the model still
    loads: SGLang's method serves every layer, one error says why."""
    from kda_backend import serving

    monkeypatch.setattr(serving, "KDAProjection", lambda *args, **kwargs: (_ for _ in ()).throw(RuntimeError("oom")))
    layers = [_build_layer(seed) for seed in range(2)]
    assert all(layer._kda_projection is None for layer in layers)
    assert sum("could not build the KDA projection" in m and "RuntimeError: oom" in m
               for m in kda_log.messages(logging.ERROR)) == 1
    x = torch.randn(3, HIDDEN).bfloat16()
    _assert_same_outputs(layers[0].forward_qkvbfg_fused(x), _sglang_method(layers[0], x, False), "build failed")


def test_projection_state_survives_sglangs_release_and_resume_of_weights(kda_backend_selected, monkeypatch):
    """SGLang's memory saver (``release_memory_occupation`` / ``resume_memory_occupation`` with the weights tag)
    maps the weights' memory again without its contents and restores the model's buffers only: the projection's
    state (its arrival counters) is one of them, so it comes back as it was saved."""
    from sglang.srt.managers.scheduler_components.weight_updater import _export_static_state, _import_static_state

    from kda_backend import KDAProjection

    counters = torch.zeros(4, 8, dtype=torch.int32)
    monkeypatch.setattr(KDAProjection, "state_buffers", lambda self: {"kda_arrival_counters": counters})
    model = torch.nn.ModuleDict({"0": _build_layer(0), "1": _build_layer(1)})
    stash = _export_static_state(model)
    counters.fill_(7)  # what the released memory holds once it is mapped again
    _import_static_state(model, stash)
    assert not counters.any()
    assert not any("kda_arrival_counters" in key for key in model.state_dict())


def test_rocm_keeps_sglang_method(kda_backend_selected, kda_log, monkeypatch):
    """On ROCm SGLang fuses the in-projection itself: under ``kda`` its method still serves, with one warning."""
    import sglang.srt.utils

    monkeypatch.setattr(sglang.srt.utils, "is_hip", lambda: True)
    layer = _build_layer()
    assert layer._kda_projection is None
    assert any("ROCm: SGLang's own ROCm projection serves" in m for m in kda_log.messages())


def test_deterministic_inference_keeps_sglang_method(kda_log):
    """With ``--enable-deterministic-inference`` SGLang promises results independent of the batch; kda-backend's
    kernels pick tactics per M, so SGLang's method serves, with one warning."""
    from sglang.srt.server_args import ServerArgs

    with _published(ServerArgs(model_path="dummy", attention_backend="kda", enable_deterministic_inference=True)):
        layer = _build_layer()
    assert layer._kda_projection is None
    assert any("--enable-deterministic-inference" in m for m in kda_log.messages())


@pytest.mark.parametrize("case", ["no-plan", "plan-to-8", "sequential-cublas-at-8"])
def test_batch_sizes_the_plan_has_no_step_for_run_sglangs_method(kda_backend_selected, case, monkeypatch):
    """Where the plan has no step of its own for M (no tuned plan, M above its largest tuned one, or sequential
    cuBLAS there, which SGLang's own GEMMs or overlap match or beat) SGLang's own method serves; where it has one,
    the projection does."""
    from kda_backend import serving
    from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step

    plan, served = {
        "no-plan": (Plan(source="default (no tuned plan)", fallback=SEQUENTIAL_TORCH), []),
        "plan-to-8": (Plan.uniform(8, Step(overlap=False), source="autotune"), [4, 8]),
        "sequential-cublas-at-8": (Plan(steps={4: Step(overlap=False), 8: SEQUENTIAL_TORCH, 16: Step(overlap=False)},
                                        source="autotune"), [4, 16]),
    }[case]
    monkeypatch.setattr(serving, "resolve_plan", lambda *args, **kwargs: plan)
    recorder = _Recorder()
    register_plugin(recorder, recorder.name)
    layer = _build_layer(seed=5)
    assert layer._kda_projection is not None
    # The plan's own steps run on the recorder (its sequential cuBLAS step stays the baseline).
    plan = dataclasses.replace(plan, steps={m: step if step == SEQUENTIAL_TORCH else dataclasses.replace(
        step, qkvg="recorder", fab="recorder", fb="recorder") for m, step in plan.steps.items()})
    layer._kda_projection.plan = plan
    for m in (4, 8, 16):
        recorder.calls.clear()
        x = torch.randn(m, HIDDEN, generator=torch.Generator().manual_seed(m)).bfloat16()
        _assert_same_outputs(layer.forward_qkvbfg_fused(x), _sglang_method(layer, x, False), f"M={m}")
        assert bool(recorder.calls) == (m in served), f"M={m}"


def test_fork_follows_sglang_gate_in_capture_mode_and_breakable_graphs():
    """SGLang's own overlap gate: capture mode (warm-ups and capture) and breakable graphs; eager serving never."""
    from kda_sglang.injection import SglangHost
    from sglang.srt.model_executor.runner_backend_utils.breakable_cuda_graph.context import (
        enable_breakable_cuda_graph,
    )
    from sglang.srt.model_executor.runner_utils import capture_mode

    host, device = SglangHost(), torch.device("cuda", 0)
    assert host.kda_host_fork_allowed(device) is False
    with capture_mode.model_capture_mode():
        assert host.kda_host_fork_allowed(device) is True
    with enable_breakable_cuda_graph():
        assert host.kda_host_fork_allowed(device) is True
    assert host.kda_host_fork_allowed(device) is False


# --- the plan: resolved at load on every rank together, never in a forward -----------------------------------------


def test_plan_is_shared_at_load_on_every_rank_and_never_in_forward(kda_backend_selected, monkeypatch):
    from sglang.test.parallel_groups import parallel_scope

    from kda_backend import planning

    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")  # on the CPU only a forced or stored plan is shared
    collective = CountingShare()
    register_plugin(collective, "counting-collective")
    layers = {}
    for rank in (0, 1):
        monkeypatch.setattr(planning, "_resolved", {})  # each rank is its own process
        with parallel_scope(tp_rank=rank, tp_size=2, attn_tp_rank=rank, attn_tp_size=2, moe_tp_size=2):
            layers[rank] = [_build_layer(seed=rank), _build_layer(seed=10 + rank)]
        assert collective.calls == rank + 1, "each rank shares the plan once, while its weights are loaded"
        assert all(layer._kda_projection is not None for layer in layers[rank])
    for rank, built in layers.items():
        for layer in built:
            for m in (1, 3, 16):
                for defer_f_b in (False, True):
                    x = torch.randn(m, HIDDEN).bfloat16()
                    _assert_same_outputs(layer.forward_qkvbfg_fused(x, defer_f_b=defer_f_b),
                                         _sglang_method(layer, x, defer_f_b), f"rank {rank} M={m}")
    assert collective.calls == 2


def test_cuda_graph_token_counts_reach_the_projection(k3_model_path, monkeypatch):
    """serve_layer gets SGLang's decode CUDA-graph token counts (batch sizes, times the draft tokens a target
    verifies under speculative decoding), so every kernel is compiled before capture."""
    import kda_sglang.layer as layer_module

    seen = []
    real = layer_module.serve_layer

    def spy(layer, weights, **kwargs):
        seen.append(tuple(kwargs["batch_sizes"]))
        return real(layer, weights, **kwargs)

    monkeypatch.setattr(layer_module, "serve_layer", spy)
    eagle = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
             "--speculative-num-draft-tokens", "4"]
    for argv, widths in (([], {1}), (eagle, {4}), ([*eagle, "--speculative-adaptive"], None)):
        server_args = _resolve(k3_model_path, "sm90", ["--attention-backend", "kda", "--cuda-graph-bs-decode",
                                                        "1", "2", "8", *argv], tp=1)
        with _published(server_args):
            if widths is None:  # adaptive: a verify width per candidate step (SGLang's default config: 0, 1, 3, 5, 7)
                from sglang.srt.runtime_context import get_spec
                from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config

                assert get_spec().speculative_adaptive, "SGLang turned adaptive speculation off for this config"
                widths = {steps + 1 for steps in resolve_candidate_steps_from_config(None)}
                assert widths == {1, 2, 4, 6, 8}
            _build_layer()
        assert seen.pop() == tuple(sorted({bs * width for bs in (1, 2, 8) for width in widths}))
    server_args = _resolve(k3_model_path, "sm90", ["--attention-backend", "kda", "--disable-cuda-graph"], tp=1)
    with _published(server_args):
        _build_layer()
    assert seen.pop() == ()


# --- TP16: SGLang's 136-row [f_a | b] ----------------------------------------------------------------------------


def test_tp16_serves_the_136_row_merged_weight(kda_backend_selected, monkeypatch):
    """Kimi-K3 at TP16: 6 heads per rank, SGLang pads [f_a | b] (128 + 6 rows) to 136; the adapter hands that
    tensor to the core unchanged and serves equal to SGLang's method."""
    import sglang.kernels.ops.gemm.kimi_k3 as sglang_tiny_gemm
    from sglang.test.parallel_groups import parallel_scope

    # SGLang's CUDA-only tiny-GEMM kernel; on the CPU its own F.linear fallback stands in for it.
    monkeypatch.setattr(sglang_tiny_gemm, "_K3_TINY_GEMM_MAX_TOKENS", {})
    k3 = preset("kimi-k3", 16)
    rank = 5
    with parallel_scope(tp_rank=rank, tp_size=16, attn_tp_rank=rank, attn_tp_size=16, moe_tp_size=16):
        layer = _build_layer(hidden=k3.hidden_size, heads=k3.num_heads, head_dim=k3.head_dim)
    assert tuple(layer._bfa_w.shape) == (136, k3.hidden_size)
    projection = layer._kda_projection
    assert projection is not None and projection.weights.w_fab.data_ptr() == layer._bfa_w.data_ptr()
    g = projection.geometry
    assert (g.tp_size, g.heads_local, g.fab_rows, g.qkvg_rows) == (16, 6, 136, 3072)
    assert projection.gemm_call("fab", 4).n == 136
    for m in (1, 7, 16):
        x = torch.randn(m, k3.hidden_size, generator=torch.Generator().manual_seed(m)).bfloat16()
        for defer_f_b in (False, True):
            _assert_same_outputs(layer.forward_qkvbfg_fused(x, defer_f_b=defer_f_b),
                                 _sglang_method(layer, x, defer_f_b), f"TP16 M={m} defer_f_b={defer_f_b}")


# --- parity artifact ---------------------------------------------------------------------------------------------

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
                native = _sglang_method(layer, x, False)
                assert all(torch.equal(a, b) for a, b in zip((qkv, beta, forget_gate, g_proj), native)), (case, m)
                outputs[m] = [torch.cat([qkv, g_proj], dim=-1), forget_gate.clone(), beta.clone()]
            results[case] = {"outputs": outputs, "checksums": loaded_checksums(layer._kda_projection.weights)}
            del layer
    folder = artifacts_dir()
    folder.mkdir(exist_ok=True)
    torch.save({"engine": "sglang", "results": results}, folder / "sglang.pt")
