import pytest

from kda_backend.geometry import KDAGeometry, preset, valid_tp_sizes

K3 = dict(hidden_size=7168, num_heads=96, head_dim=128)


@pytest.mark.parametrize("tp", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96], ids=lambda t: f"tp{t}")
def test_k3_shapes_follow_formulas(tp):
    g = preset("kimi-k3", tp)
    h = 96 // tp
    assert g.heads_local == h
    assert g.qkvg_rows == 4 * h * 128
    assert g.fab_rows_used == 128 + h
    assert g.fab_rows % 16 == 0 and g.fab_rows - g.fab_rows_used < 16 and g.fab_rows >= g.fab_rows_used
    assert g.fb_shape == (h * 128, 128)
    assert g.packed_rows == g.qkvg_rows + g.fab_rows
    assert g.conv_channels == 3 * h * 128


def test_k3_tp8_matches_published_per_rank_shapes():
    g = preset("kimi-k3", 8)
    assert (g.qkvg_rows, g.hidden_size) == (6144, 7168)
    assert g.fab_rows == 144  # 128 f_a + 12 beta + 4 pad
    assert g.packed_rows == 6288
    assert g.fb_shape == (1536, 128)
    assert g.weight_bytes() == (6288 * 7168 + 1536 * 128) * 2


def test_tp16_pads_to_multiple_of_16():
    g = preset("kimi-k3", 16)
    assert g.heads_local == 6 and g.fab_rows == 144


@pytest.mark.parametrize("tp", [5, 7, 9, 64, 97])
def test_tp_not_dividing_heads_is_rejected_with_numbers(tp):
    with pytest.raises(ValueError, match=rf"tp_size={tp} does not divide num_heads=96"):
        preset("kimi-k3", tp)


@pytest.mark.parametrize("field", ["hidden_size", "num_heads", "head_dim", "tp_size", "conv_width", "row_multiple"])
@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_non_positive_or_non_int_fields_rejected(field, bad):
    kwargs = dict(K3, **{field: bad})
    with pytest.raises(ValueError, match=field):
        KDAGeometry(**kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown geometry preset 'nope'.*kimi-k3"):
        preset("nope")


def test_valid_tp_sizes():
    assert valid_tp_sizes(96) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]


def test_describe_is_plain_data():
    d = preset("kimi-k3", 8).describe()
    assert d["qkvg"] == [6144, 7168] and d["fab"] == [144, 7168] and d["fb"] == [1536, 128]
