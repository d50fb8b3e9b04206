"""The optional FlashInfer provider on the CPU: what it accepts, how it calls ``mm_bf16``, where dispatch and the
autotuner place it. The real library runs only on SM 10.x GPUs; here a stand-in module records the calls."""

import importlib.machinery
import sys
import types

import pytest
import torch

from kda_backend import dispatch
from kda_backend.autotune import step_candidates, usable_providers
from kda_backend.geometry import KDAGeometry
from kda_backend.plan import AUTO, Step
from kda_backend.providers.base import GemmCall
from kda_backend.providers.flashinfer_provider import FlashInferProvider
from kda_backend.weights import ProjectionWeights


def _call(**kw):
    base = dict(role="qkvg", m=4, n=6144, k=7168, dtype=torch.bfloat16, device_type="cuda", capability=(10, 0),
                x_row_stride=7168, w_row_stride=7168)
    return GemmCall(**(base | kw))


@pytest.fixture
def fake_flashinfer(monkeypatch):
    """A ``flashinfer`` module whose ``mm_bf16`` records its arguments and computes ``a @ b`` on the CPU."""
    module = types.ModuleType("flashinfer")
    module.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
    module.calls = []

    def mm_bf16(a, b, bias=None, pdl=False, out=None, out_dtype=torch.bfloat16, backend="cudnn"):
        module.calls.append(dict(a=a, b=b, out=out, pdl=pdl, backend=backend))
        out.copy_(a.float() @ b.float())
        return out

    module.mm_bf16 = mm_bf16
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    return module


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(device_type="cpu", capability=None), "needs a CUDA device"),
        (dict(capability=(9, 0)), "compute capability (9, 0) not in SM (10,)"),
        (dict(dtype=torch.float16), "not bfloat16"),
        (dict(role="fb", n=1536, k=128, x_row_stride=144), "x row stride 144 != K=128"),
        (dict(w_row_stride=7176), "weight row stride 7176 != K=7168"),
    ],
)
def test_rejections_name_reason(kw, match, fake_flashinfer):
    reason = FlashInferProvider().why_not(_call(**kw))
    assert reason is not None and match in reason


def test_rejected_when_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import and find_spec both see "not installed"
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n: None if n == "flashinfer" else real_find_spec(n))
    assert FlashInferProvider().why_not(_call()) == "flashinfer is not installed"


@pytest.mark.parametrize("capability", [(10, 0), (10, 3)])
def test_accepts_blackwell(capability, fake_flashinfer):
    assert FlashInferProvider().why_not(_call(capability=capability)) is None


def test_run_passes_the_weight_as_a_transposed_view(fake_flashinfer):
    x = torch.randn(3, 64).bfloat16()
    packed = torch.randn(96, 64).bfloat16()
    w = packed[:80]  # a row view of a packed weight, as the QKVG role gets
    out = torch.full((3, 80), float("nan")).bfloat16()
    FlashInferProvider().run("qkvg", x, w, out)
    (call,) = fake_flashinfer.calls
    assert call["b"].shape == (64, 80) and call["b"].data_ptr() == packed.data_ptr() and call["out"] is out
    assert call["backend"] == "cute-dsl" and call["pdl"] is True
    assert torch.equal(out, (x.float() @ w.float().t()).bfloat16())


def test_dispatch_order_cute_then_flashinfer_then_torch(fake_flashinfer):
    call = _call()
    assert dispatch.select(call).name == "cute"
    dispatch.mark_broken(dispatch.provider_by_name("cute"), "test")
    assert dispatch.select(call).name == "flashinfer"
    assert dispatch.select(_call(role="fb", n=1536, k=128, x_row_stride=144)).name == "torch"


def test_forced_flashinfer_fails_loudly_on_hopper(monkeypatch, fake_flashinfer):
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "qkvg=flashinfer")
    with pytest.raises(ValueError, match="forced provider 'flashinfer' cannot serve qkvg"):
        dispatch.select(_call(capability=(9, 0)))


def test_autotune_candidates_follow_usable_providers():
    g = KDAGeometry(hidden_size=256, num_heads=8, head_dim=32)
    packed, w_fb = torch.zeros(g.packed_rows, 256).bfloat16(), torch.zeros(*g.fb_shape).bfloat16()
    w = ProjectionWeights.from_packed(packed, w_fb, g)
    assert usable_providers(w, 4) == {"qkvg": ("torch",), "fab": ("torch",), "fb": ("torch",)}
    usable = {"qkvg": ("cute", "flashinfer", "torch"), "fab": ("cute", "flashinfer", "torch"), "fb": ("cute", "torch")}
    steps = step_candidates(usable)
    assert len(steps) == 18 and len(set(steps)) == 18
    assert Step(overlap=True, qkvg="cute", fab="flashinfer", fb=AUTO) in steps
    assert Step(overlap=False, qkvg="flashinfer", fab="cute", fb="cute") in steps
    fused = step_candidates(usable, fusing=("cute",))
    assert fused[:18] == steps and fused[18:] == [Step(overlap=True, qkvg="cute", fab="cute", fb="cute", fused=True)]
    # Above 64 tokens CuTe serves F_B but not F_A/beta: F_B on CuTe is a candidate beside each F_A/beta provider.
    large = step_candidates({"qkvg": ("cute", "torch"), "fab": ("torch",), "fb": ("cute", "torch")})
    assert len(large) == 8 and len(set(large)) == 8
    assert Step(overlap=False, qkvg="cute", fab="torch", fb="cute") in large
    assert Step(overlap=False, qkvg="cute", fab="torch", fb="torch") in large
