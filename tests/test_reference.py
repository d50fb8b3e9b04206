import pytest
import torch
import torch.nn.functional as F

from kda_backend.geometry import KDAGeometry, preset
from kda_backend.reference import (
    KDALayerWeights,
    recurrence_chunked,
    recurrence_token_loop,
    reference_kda_layer,
    reference_projection,
    reference_projection_packed,
    split_packed,
)
from kda_backend.reference.layer import causal_conv_silu, decay_gate

TINY = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16, tp_size=2)


def _recurrence_inputs(b, t, h, d, gen, lower_bound=-5.0):
    q = F.normalize(torch.randn(b, t, h, d, generator=gen, dtype=torch.float64), dim=-1) * d**-0.5
    k = F.normalize(torch.randn(b, t, h, d, generator=gen, dtype=torch.float64), dim=-1)
    v = torch.randn(b, t, h, d, generator=gen, dtype=torch.float64)
    g = lower_bound * torch.sigmoid(torch.randn(b, t, h, d, generator=gen, dtype=torch.float64))
    beta = torch.sigmoid(torch.randn(b, t, h, generator=gen, dtype=torch.float64))
    s0 = torch.randn(b, h, d, d, generator=gen, dtype=torch.float64)
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("t,chunk", [(1, 16), (7, 4), (33, 16), (64, 64)], ids=lambda v: str(v))
def test_recurrence_two_forms_agree(t, chunk):
    gen = torch.Generator().manual_seed(t * 31 + chunk)
    args = _recurrence_inputs(2, t, 3, 16, gen)
    o1, s1 = recurrence_token_loop(*args)
    o2, s2 = recurrence_chunked(*args, chunk_size=chunk)
    assert torch.isfinite(o1).all() and torch.isfinite(s1).all()
    torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s2, s1, rtol=1e-9, atol=1e-9)


def test_recurrence_chunked_survives_strong_decay():
    """Cumulative decays far below fp32's exp range must not overflow the closed form."""
    gen = torch.Generator().manual_seed(5)
    q, k, v, _, beta, s0 = _recurrence_inputs(1, 64, 2, 8, gen)
    g = torch.full_like(q, -5.0)  # G reaches -320 over one chunk
    o1, s1 = recurrence_token_loop(q, k, v, g, beta, s0)
    o2, s2 = recurrence_chunked(q, k, v, g, beta, s0, chunk_size=64)
    assert torch.isfinite(o2).all()
    torch.testing.assert_close(o2, o1, rtol=1e-9, atol=1e-9)


def test_recurrence_single_step_by_hand():
    """One step of the delta rule written out with explicit loops."""
    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta, s0 = _recurrence_inputs(1, 1, 1, 4, gen)
    s = s0[0, 0].clone()
    for i in range(4):
        s[i] *= torch.exp(g[0, 0, 0, i])
    u = beta[0, 0, 0] * (v[0, 0, 0] - s.t() @ k[0, 0, 0])
    s = s + torch.outer(k[0, 0, 0], u)
    o = s.t() @ q[0, 0, 0]
    o_ref, s_ref = recurrence_token_loop(q, k, v, g, beta, s0)
    torch.testing.assert_close(o_ref[0, 0, 0], o)
    torch.testing.assert_close(s_ref[0, 0], s)


def test_projection_packed_equals_split_and_explicit_math():
    g = TINY
    gen = torch.Generator().manual_seed(0)
    w = KDALayerWeights.random(g, gen)
    x = torch.randn(5, g.hidden_size, generator=gen).bfloat16()
    packed = torch.cat([w.w_qkvg, w.w_fab])
    qkvg, g1, beta = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, g)
    qkvg_p, g1_p, beta_p = reference_projection_packed(x, packed, w.w_fb, g)
    assert torch.equal(qkvg, qkvg_p) and torch.equal(g1, g1_p) and torch.equal(beta, beta_p)
    assert qkvg.shape == (5, g.qkvg_rows) and g1.shape == (5, g.local_width) and beta.shape == (5, g.heads_local)
    assert qkvg.dtype == g1.dtype == beta.dtype == torch.float32
    xf = x.double()
    torch.testing.assert_close(qkvg.double(), xf @ w.w_qkvg.double().t(), rtol=1e-5, atol=1e-5)
    f_a = (xf @ w.w_fab[: g.head_dim].double().t()).bfloat16().double()
    torch.testing.assert_close(g1.double(), f_a @ w.w_fb.double().t(), rtol=1e-5, atol=1e-5)
    b_rows = w.w_fab[g.head_dim : g.head_dim + g.heads_local].double()
    torch.testing.assert_close(beta.double(), xf @ b_rows.t(), rtol=1e-5, atol=1e-5)


def test_split_packed_views_share_storage_and_check_shape():
    g = TINY
    packed = torch.randn(g.packed_rows, g.hidden_size)
    w_qkvg, w_fab = split_packed(packed, g)
    assert w_qkvg.data_ptr() == packed.data_ptr()
    assert w_fab.data_ptr() == packed[g.qkvg_rows :].data_ptr()
    with pytest.raises(ValueError, match=r"packed weight shape \(3, 64\)"):
        split_packed(packed[:3], g)


def test_decay_gate_forms():
    g1 = torch.randn(3, 2, 4)
    a_log = torch.randn(2)
    dt_bias = torch.randn(2, 4)
    a = a_log.exp()[:, None]
    bounded = decay_gate(g1, a_log, dt_bias, -5.0)
    torch.testing.assert_close(bounded, -5.0 * torch.sigmoid(a * (g1 + dt_bias)))
    assert (bounded <= 0).all() and (bounded >= -5.0).all()
    free = decay_gate(g1, a_log, dt_bias, None)
    torch.testing.assert_close(free, -a * F.softplus(g1 + dt_bias))


def test_causal_conv_by_hand_and_state_roll():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 3, 2, generator=gen)
    state = torch.randn(1, 3, 2, generator=gen)
    weight = torch.randn(2, 4, generator=gen)
    y, new_state = causal_conv_silu(x, state, weight)
    seq = torch.cat([state, x], dim=1)[0]  # 6 x 2
    for t in range(3):
        expect = (seq[t : t + 4] * weight.t()).sum(0)
        torch.testing.assert_close(y[0, t], F.silu(expect))
    torch.testing.assert_close(new_state[0], seq[-3:])


def _layer_setup(seed, geometry, b):
    gen = torch.Generator().manual_seed(seed)
    w = KDALayerWeights.random(geometry, gen)
    conv = torch.randn(b, geometry.conv_width - 1, geometry.conv_channels, generator=gen).bfloat16()
    rec = torch.randn(b, geometry.heads_local, geometry.head_dim, geometry.head_dim, generator=gen) * 0.1
    return gen, w, conv, rec


@pytest.mark.parametrize("lower_bound", [-5.0, None], ids=["bounded", "softplus"])
def test_prefill_equals_decode_steps(lower_bound):
    """Prefill of T tokens = T decode steps carrying conv and recurrent state; chunked recurrence agrees."""
    g = TINY
    gen, w, conv, rec = _layer_setup(3, g, b=2)
    x = torch.randn(2, 9, g.hidden_size, generator=gen).bfloat16()
    out, conv_p, rec_p = reference_kda_layer(x, w, g, conv, rec, lower_bound=lower_bound)
    assert out.shape == (2, 9, g.hidden_size) and torch.isfinite(out).all()
    conv_d, rec_d, steps = conv, rec, []
    for t in range(9):
        o, conv_d, rec_d = reference_kda_layer(x[:, t : t + 1], w, g, conv_d, rec_d, lower_bound=lower_bound)
        steps.append(o)
    torch.testing.assert_close(torch.cat(steps, 1), out, rtol=1e-5, atol=1e-5)
    assert torch.equal(conv_d, conv_p)
    torch.testing.assert_close(rec_d, rec_p, rtol=1e-5, atol=1e-5)
    out_c, _, rec_c = reference_kda_layer(x, w, g, conv, rec, lower_bound=lower_bound, recurrence=recurrence_chunked)
    torch.testing.assert_close(out_c, out, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rec_c, rec_p, rtol=1e-4, atol=1e-4)


def test_layer_does_not_modify_inputs_and_uses_state():
    g = TINY
    gen, w, conv, rec = _layer_setup(4, g, b=1)
    x = torch.randn(1, 1, g.hidden_size, generator=gen).bfloat16()
    conv0, rec0 = conv.clone(), rec.clone()
    out1, _, _ = reference_kda_layer(x, w, g, conv, rec)
    assert torch.equal(conv, conv0) and torch.equal(rec, rec0)
    out2, _, _ = reference_kda_layer(x, w, g, conv, rec * 2)
    assert not torch.allclose(out1, out2)


def test_layer_runs_at_k3_tp16_geometry():
    g = preset("kimi-k3", 16)
    gen, w, conv, rec = _layer_setup(6, g, b=1)
    x = torch.randn(1, 2, g.hidden_size, generator=gen).bfloat16()
    out, conv_n, rec_n = reference_kda_layer(x, w, g, conv, rec)
    assert out.shape == (1, 2, 7168) and conv_n.shape == (1, 3, 3 * 6 * 128) and rec_n.shape == (1, 6, 128, 128)
    assert torch.isfinite(out).all()
