"""Reliability, arguments and the environment: geometry, weights, projection inputs and ``KDA_BACKEND_*`` variables.

Each case gives one input from outside and asserts the exact outcome: a correct result, an exception whose message
names the input, the value and what is accepted, or one warning and a working fallback. The README's reliability
table lists these cases.
"""

import logging

import numpy as np
import pytest
import torch
from numerics import assert_close

from kda_backend import KDAProjection, ProjectionWeights, env, log
from kda_backend.dispatch import forced_providers
from kda_backend.engine_gate import adapter_enabled
from kda_backend.env import EnvError
from kda_backend.geometry import KDAGeometry, preset
from kda_backend.planning import resolve_plan
from kda_backend.reference import KDALayerWeights, reference_projection

TINY = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16)
VALID_TP = "[1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]"
BOOLEAN = "accepted: 1, true, yes, on or 0, false, no, off (any case)"


def _layer(geometry=TINY, dtype=torch.bfloat16):
    w = KDALayerWeights.random(geometry, torch.Generator().manual_seed(0))
    return w.w_qkvg.to(dtype), w.w_fab.to(dtype), w.w_fb.to(dtype)


def _split(geometry=TINY):
    return ProjectionWeights.from_split(*_layer(geometry), geometry)


# --- geometry ---------------------------------------------------------------------------------------------------

GEOMETRY_CASES = {
    "tp7-does-not-divide-96-heads": (lambda: preset("kimi-k3", 7),
                                     f"tp_size=7 does not divide num_heads=96; valid tp sizes: {VALID_TP}"),
    "tp0": (lambda: preset("kimi-k3", 0), "KDAGeometry.tp_size: 0 (int); accepted: a positive int"),
    "tp-string": (lambda: preset("kimi-k3", "8"), "KDAGeometry.tp_size: '8' (str); accepted: a positive int"),
    "tp-numpy-int": (lambda: preset("kimi-k3", np.int64(8)),
                     "KDAGeometry.tp_size: np.int64(8) (int64); accepted: a positive int"),
    "hidden-float": (lambda: KDAGeometry(hidden_size=7168.0, num_heads=96, head_dim=128),
                     "KDAGeometry.hidden_size: 7168.0 (float); accepted: a positive int"),
    "heads-bool": (lambda: KDAGeometry(hidden_size=7168, num_heads=True, head_dim=128),
                   "KDAGeometry.num_heads: True (bool); accepted: a positive int"),
    "head-dim-negative": (lambda: KDAGeometry(hidden_size=7168, num_heads=96, head_dim=-128),
                          "KDAGeometry.head_dim: -128 (int); accepted: a positive int"),
    "unknown-preset": (lambda: preset("kimi-k4", 8), "unknown geometry preset 'kimi-k4'; known: ['kimi-k3']"),
}


@pytest.mark.parametrize("case", list(GEOMETRY_CASES), ids=[f"geometry-{c}" for c in GEOMETRY_CASES])
def test_geometry_refuses_with_named_value(case):
    build, message = GEOMETRY_CASES[case]
    with pytest.raises(ValueError) as caught:
        build()
    assert str(caught.value) == message


# --- weights ----------------------------------------------------------------------------------------------------

def _packed_args(**override):
    qkvg, fab, fb = _layer()
    args = {"w_packed": torch.cat([qkvg, fab]), "w_fb": fb, "geometry": TINY}
    return {**args, **override}


def _split_args(**override):
    qkvg, fab, fb = _layer()
    return {"w_qkvg": qkvg, "w_fab": fab, "w_fb": fb, "geometry": TINY, **override}


def _as(dtype):
    return lambda t: t.to(dtype)


WEIGHT_CASES = {
    "packed-numpy": ("packed", {"w_packed": lambda t: t.float().numpy()}, TypeError,
                     "w_packed: numpy.ndarray; accepted: a torch.Tensor"),
    "packed-int8": ("packed", {"w_packed": _as(torch.int8)}, ValueError,
                    "w_packed: dtype torch.int8; accepted: torch.bfloat16, torch.float16, torch.float32"),
    "packed-3d": ("packed", {"w_packed": lambda t: t[None]}, ValueError,
                  "w_packed: 3-D tensor of shape (1, 288, 64); accepted: a 2-D [rows, cols] weight"),
    "packed-rows": ("packed", {"w_packed": lambda t: t[:-16]}, ValueError,
                    "w_packed: shape (272, 64) != expected (288, 64)"),
    "fb-list": ("packed", {"w_fb": lambda t: t.tolist()}, TypeError, "w_fb: list; accepted: a torch.Tensor"),
    "fb-none": ("packed", {"w_fb": lambda t: None}, TypeError, "w_fb: NoneType; accepted: a torch.Tensor"),
    "geometry-string": ("packed", {"geometry": lambda g: "kimi-k3"}, TypeError,
                        "geometry: str; accepted: a KDAGeometry (kda_backend.preset(...))"),
    "split-int8": ("split", {"w_qkvg": _as(torch.int8)}, ValueError,
                   "w_qkvg: dtype torch.int8; accepted: torch.bfloat16, torch.float16, torch.float32"),
    "split-bool": ("split", {"w_fab": _as(torch.bool)}, ValueError,
                   "w_fab: dtype torch.bool; accepted: torch.bfloat16, torch.float16, torch.float32"),
    "split-complex": ("split", {"w_fb": _as(torch.complex64)}, ValueError,
                      "w_fb: dtype torch.complex64; accepted: torch.bfloat16, torch.float16, torch.float32"),
    "split-mixed-dtypes": ("split", {"w_fab": _as(torch.float16)}, ValueError,
                           "w_fab: dtype torch.float16 != expected torch.bfloat16 (all projection weights share one "
                           "dtype)"),
    "split-column-major": ("split", {"w_fb": lambda t: t.t().contiguous().t()}, ValueError,
                           "w_fb: stride (1, 64) must be unit along the input dim (row-major rows)"),
}


@pytest.mark.parametrize("case", list(WEIGHT_CASES), ids=[f"weights-{c}" for c in WEIGHT_CASES])
def test_weights_refuse_with_named_argument(case):
    layout, changes, error, message = WEIGHT_CASES[case]
    args = _packed_args() if layout == "packed" else _split_args()
    args.update({name: change(args[name]) for name, change in changes.items()})
    build = ProjectionWeights.from_packed if layout == "packed" else ProjectionWeights.from_split
    with pytest.raises(error) as caught:
        build(**args)
    assert str(caught.value) == message


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=lambda d: f"weights-{d}")
def test_weights_in_every_accepted_dtype_project_correctly(dtype):
    w = ProjectionWeights.from_split(*_layer(dtype=dtype), TINY)
    x = torch.randn(3, TINY.hidden_size, dtype=dtype)
    ref = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, TINY)
    for out, expect in zip(KDAProjection(w)(x), ref):
        assert_close(out, expect)


# --- projection -------------------------------------------------------------------------------------------------

PROJECTION_REFUSALS = {
    "x-numpy": (lambda: np.zeros((2, 64)), "x: numpy.ndarray; accepted: a torch.Tensor"),
    "x-int8": (lambda: torch.ones(2, 64, dtype=torch.int8), "x: dtype torch.int8 != weight dtype torch.bfloat16"),
    "x-1d": (lambda: torch.randn(64).bfloat16(), "x: shape (64,) != expected [M, 64]"),
    "x-hidden": (lambda: torch.randn(2, 65).bfloat16(), "x: shape (2, 65) != expected [M, 64]"),
    "x-column-major": (lambda: torch.randn(64, 3).bfloat16().t(), "x: stride (1, 3) must be unit along hidden"),
}


@pytest.mark.parametrize("case", list(PROJECTION_REFUSALS), ids=[f"projection-{c}" for c in PROJECTION_REFUSALS])
def test_projection_refuses_bad_input_before_any_launch(case):
    make, message = PROJECTION_REFUSALS[case]
    with pytest.raises(TypeError if case == "x-numpy" else ValueError) as caught:
        KDAProjection(_split())(make())
    assert str(caught.value) == message


def test_projection_refuses_bad_output_buffers():
    proj = KDAProjection(_split())
    x = torch.randn(2, 64).bfloat16()
    with pytest.raises(ValueError) as caught:
        proj(x, qkvg_out=torch.empty(3, TINY.qkvg_rows, dtype=torch.bfloat16))
    assert str(caught.value) == "qkvg_out: shape (3, 256) != expected (2, 256)"
    with pytest.raises(ValueError) as caught:
        proj(x, g1_out=torch.empty(2, TINY.local_width, dtype=torch.bfloat16), compute_fb=False)
    assert str(caught.value) == "g1_out: given with compute_fb=False, which computes no g1"


def test_projection_refuses_weights_on_another_cuda_device_than_the_current_one(monkeypatch):
    """Weights on cuda:1 while cuda:0 is current (several GPUs in one process): the kernels would launch on cuda:0's
    stream, so the first stage built for an M refuses, naming both devices and the remedy, before any launch."""
    monkeypatch.setattr(ProjectionWeights, "device", property(lambda self: torch.device("cuda", 1)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    proj = KDAProjection(_split())
    with pytest.raises(RuntimeError) as caught:
        proj.prepare([2])
    assert str(caught.value) == (
        "weights on cuda:1 while cuda:0 is the current CUDA device: kda-backend builds and launches its kernels on the "
        "current device; make cuda:1 current first (torch.cuda.set_device(1) or `with torch.cuda.device(1):`)"
    )


@pytest.mark.parametrize("m", [0, 1, 7, 4099, 100_000], ids=lambda m: f"projection-M{m}")
@pytest.mark.parametrize("packed", [False, True], ids=["split", "packed"])
def test_projection_any_m_matches_reference(m, packed):
    qkvg, fab, fb = _layer()
    w = ProjectionWeights.from_packed(torch.cat([qkvg, fab]), fb, TINY) if packed else _split()
    x = torch.randn(m, TINY.hidden_size).bfloat16()
    outs = KDAProjection(w)(x)
    assert [tuple(o.shape) for o in outs] == [(m, TINY.qkvg_rows), (m, TINY.local_width), (m, TINY.heads_local)]
    if m:
        for out, expect in zip(outs, reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, TINY)):
            assert_close(out, expect)


def test_projection_strided_rows_and_nonfinite_rows_stay_in_their_row():
    w = _split()
    base = torch.randn(10, TINY.hidden_size).bfloat16()
    base[2, 5], base[4, 7] = float("nan"), float("inf")
    x = base[::2]  # rows 0, 2, 4, 6, 8: row stride 128, unit along hidden
    qkvg, g1, beta = KDAProjection(w)(x)
    bad = torch.tensor([False, True, True, False, False])
    for out in (qkvg, g1, beta):
        assert not out[bad].isfinite().all(dim=1).any() and out[~bad].isfinite().all()
    ref = reference_projection(x[~bad], w.w_qkvg, w.w_fab, w.w_fb, TINY)
    for out, expect in zip((qkvg, g1, beta), ref):
        assert_close(out[~bad], expect)


# --- environment variables --------------------------------------------------------------------------------------

FLAG_CASES = {
    "disable-2": ("KDA_BACKEND_DISABLE", "2", lambda: adapter_enabled("pluggy", "1.")),
    "force-engine-version-garbage": ("KDA_BACKEND_FORCE_ENGINE_VERSION", "garbage",
                                     lambda: adapter_enabled("pluggy", "0.0.")),
    "autotune-2": ("KDA_BACKEND_AUTOTUNE", "2", lambda: resolve_plan(TINY, torch.device("cpu"))),
    "autotune-garbage": ("KDA_BACKEND_AUTOTUNE", "garbage", lambda: resolve_plan(TINY, torch.device("cpu"))),
}


@pytest.mark.parametrize("case", list(FLAG_CASES), ids=[f"env-{c}" for c in FLAG_CASES])
def test_boolean_variables_refuse_other_values(case, monkeypatch):
    name, value, use = FLAG_CASES[case]
    monkeypatch.setenv(name, value)
    with pytest.raises(EnvError) as caught:
        use()
    assert str(caught.value) == f"{name}={value!r}: not a boolean; {BOOLEAN}"


@pytest.mark.parametrize("value,expected", [("1", True), ("TRUE", True), (" on ", True), ("Yes", True),
                                            ("0", False), ("off", False), ("No", False), ("", False)],
                         ids=lambda v: f"env-flag-{v!r}" if isinstance(v, str) else str(v))
def test_boolean_variables_accept_their_words(value, expected, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", value)
    assert env.flag("KDA_BACKEND_AUTOTUNE") is expected


PROVIDER_ACCEPTED = ("accepted: one provider name for every role, or role=name,... with roles qkvg, fab, fb; "
                     "providers: cute, flashinfer, torch")
PROVIDER_CASES = {
    "role-without-provider": ("qkvg=", "role 'qkvg' without a provider"),
    "two-names-without-roles": ("cute,torch", "a provider name without a role beside others"),
    "name-beside-roles": ("torch,fb=cute", "a provider name without a role beside others"),
    "unknown-role": ("qkv=torch", "unknown role 'qkv'"),
    "role-twice": ("qkvg=torch,qkvg=cute", "role 'qkvg' pinned twice"),
    "unknown-provider": ("cutlass", "provider 'cutlass' is not registered"),
    "unknown-provider-for-role": ("fb=cublas", "provider 'cublas' is not registered"),
}


@pytest.mark.parametrize("case", list(PROVIDER_CASES), ids=[f"env-provider-{c}" for c in PROVIDER_CASES])
def test_provider_variable_refuses_ambiguous_values(case, monkeypatch):
    value, problem = PROVIDER_CASES[case]
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", value)
    with pytest.raises(EnvError) as caught:
        forced_providers()
    assert str(caught.value) == f"KDA_BACKEND_PROVIDER={value!r}: {problem}; {PROVIDER_ACCEPTED}"


@pytest.mark.parametrize("value,pins", [("torch", {"qkvg": "torch", "fab": "torch", "fb": "torch"}),
                                        (" qkvg = torch , fb=cute ", {"qkvg": "torch", "fb": "cute"}),
                                        ("", {})], ids=["env-provider-all", "env-provider-roles", "env-provider-unset"])
def test_provider_variable_accepted_forms(value, pins, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", value)
    assert forced_providers() == pins


@pytest.fixture
def fresh_logger():
    """The package logger as on its first use in a process (no handler, level unset); restored afterwards."""
    logger = logging.getLogger("kda_backend")
    saved = logger.handlers[:], logger.level
    logger.handlers.clear()
    logger.setLevel(logging.NOTSET)
    yield logger
    logger.handlers[:] = saved[0]
    logger.setLevel(saved[1])


@pytest.mark.parametrize("value,level,warning", [
    ("LOUD", logging.INFO, "KDA_BACKEND_LOG_LEVEL='LOUD': not a log level; accepted: DEBUG, INFO, WARNING, ERROR, "
                           "CRITICAL (any case); using INFO"),
    ("5", logging.INFO, "KDA_BACKEND_LOG_LEVEL='5': not a log level; accepted: DEBUG, INFO, WARNING, ERROR, "
                        "CRITICAL (any case); using INFO"),
    ("debug", logging.DEBUG, None),
    ("Warning", logging.WARNING, None),
], ids=["env-log-level-LOUD", "env-log-level-number", "env-log-level-debug", "env-log-level-Warning"])
def test_log_level_variable(value, level, warning, monkeypatch, fresh_logger, capsys):
    monkeypatch.setenv("KDA_BACKEND_LOG_LEVEL", value)
    logger = log.get_logger()
    assert logger.level == level and [h.get_name() for h in logger.handlers].count(log._HANDLER_NAME) == 1
    log.warn_once("after", "the logger still works")
    err = capsys.readouterr().err.splitlines()
    assert err == ([f"[kda-backend] WARNING {warning}"] if warning else []) + [
        "[kda-backend] WARNING the logger still works"]


def test_misspelt_variable_warned_once_with_the_close_name(monkeypatch, kda_log):
    monkeypatch.setenv("KDA_BACKEND_PROVIDERS", "torch")
    for _ in range(3):
        env.get("KDA_BACKEND_PLAN")
    known = ", ".join(v.name for v in env.ENV_VARS)
    assert kda_log.messages() == [f"KDA_BACKEND_PROVIDERS is not a kda-backend variable and is ignored; did you "
                                  f"mean KDA_BACKEND_PROVIDER? known: {known}"]



@pytest.mark.parametrize("value,warned", [
    ("nosuchplugin", ["KDA_BACKEND_BLOCK_PLUGINS names 'nosuchplugin', which no installed plugin has (known: "
                      "builtin-host, builtin-providers, sglang-host, vllm-host); it blocks only a plugin registered "
                      "later under that name"]),
    ("vllm-host, sglang-host", []),
], ids=["env-block-plugins-unknown-name", "env-block-plugins-host-names"])
def test_block_list_names_no_plugin_has_are_warned(value, warned, monkeypatch, kda_log):
    from kda_backend import hooks, plugins

    monkeypatch.setenv("KDA_BACKEND_BLOCK_PLUGINS", value)
    plugins.reset_plugin_manager()
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]
    assert kda_log.messages() == warned
