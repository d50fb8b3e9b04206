"""KimiK3DeltaAttention: the whole layer over explicit state, on the CPU (reference path) and the GPU (fla)."""

import pytest
import torch
from numerics import assert_close

from kda_backend.geometry import KDAGeometry, preset
from kda_backend.layer import KimiK3DeltaAttention
from kda_backend.reference import KDALayerWeights, reference_kda_layer

TINY = KDAGeometry(hidden_size=128, num_heads=4, head_dim=32, tp_size=2)


def _layer(geometry, device="cpu", seed=0):
    w = KDALayerWeights.random(geometry, torch.Generator().manual_seed(seed), device=device)
    return KimiK3DeltaAttention(geometry, w), w


def _random_state(layer, slots, gen_seed=1):
    conv, rec = layer.new_state(slots)
    gen = torch.Generator().manual_seed(gen_seed)
    conv.copy_(torch.randn(conv.shape, generator=gen).to(conv.dtype))
    rec.copy_(torch.randn(rec.shape, generator=gen) * 0.1)
    return conv, rec


def _run_reference(layer, w, steps, conv, rec, slots):
    """The fp32 oracle over the same steps, with states in the reference layout ([B, W-1, C])."""
    conv_ref = conv[slots][:, :, 1:].transpose(1, 2).float().to(torch.bfloat16).cpu()
    rec_ref = rec[slots].cpu()
    outs = []
    w_cpu = KDALayerWeights(*(t.cpu() for t in (w.w_qkvg, w.w_fab, w.w_fb, w.conv_weight, w.a_log, w.dt_bias,
                                               w.o_norm_weight, w.w_o)))
    for x in steps:
        o, conv_ref, rec_ref = reference_kda_layer(x.cpu(), w_cpu, layer.geometry, conv_ref, rec_ref)
        outs.append(o)
    return outs, conv_ref, rec_ref


def _check(layer, w, device, lengths, tol, slot_dtype=torch.int64):
    conv, rec = _random_state(layer, 5)
    conv, rec = conv.to(device), rec.to(device)
    slots = torch.tensor([3, 0], device=device, dtype=slot_dtype)
    conv0, rec0 = conv.clone(), rec.clone()
    gen = torch.Generator().manual_seed(7)
    steps = [torch.randn(2, t, layer.geometry.hidden_size, generator=gen).bfloat16().to(device) for t in lengths]
    outs = [layer(x, conv, rec, slots) for x in steps]
    ref_outs, conv_ref, rec_ref = _run_reference(layer, w, steps, conv0, rec0, slots)
    for o, r in zip(outs, ref_outs):
        assert_close(o, r, "layer output", tolerance=tol)
    got_conv = conv[slots][:, :, 1:].transpose(1, 2).cpu().float()
    torch.testing.assert_close(got_conv, conv_ref.float(), rtol=2e-2, atol=2e-2)
    assert_close(rec[slots], rec_ref, "recurrent state", tolerance=tol)
    untouched = [i for i in range(5) if i not in (0, 3)]
    assert torch.equal(conv[untouched], conv0[untouched]) and torch.equal(rec[untouched], rec0[untouched])


@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32], ids=["slots-int64", "slots-int32"])
def test_cpu_layer_prefill_then_decode_matches_reference(slot_dtype):
    layer, w = _layer(TINY)
    _check(layer, w, "cpu", lengths=[5, 1, 1, 3], tol=1e-2, slot_dtype=slot_dtype)  # bf16 output rounding


def test_cpu_layer_bad_state_named():
    layer, _ = _layer(TINY)
    conv, rec = layer.new_state(2)
    x = torch.randn(2, 1, TINY.hidden_size).bfloat16()
    with pytest.raises(ValueError, match=r"conv_state: \(2, 192, 3\)"):
        layer(x, conv[:, :, :3], rec)
    with pytest.raises(ValueError, match=r"recurrent_state: .* torch.bfloat16"):
        layer(x, conv, rec.bfloat16())
    with pytest.raises(ValueError, match=r"slots: shape \(3,\)"):
        layer(x, conv, rec, torch.tensor([0, 1, 1]))
    with pytest.raises(ValueError, match=r"x: shape \(2, 128\)"):
        layer(x[:, 0], conv, rec)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [8, 16], ids=lambda t: f"tp{t}")
def test_gpu_layer_prefill_then_decode_matches_reference(tp):
    layer, w = _layer(preset("kimi-k3", tp), device="cuda", seed=tp)
    _check(layer, w, "cuda", lengths=[37, 1, 1, 1, 20, 1], tol=2e-2)
