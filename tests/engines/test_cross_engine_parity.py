"""Cross-engine parity (nox session `parity`, after `vllm` and `sglang` wrote their artifacts).

The same synthetic checkpoint, loaded by each engine's own loaders and projected through each adapter, against the
core on the same path (packed for vLLM, split for SGLang) bit for bit, against each other, and against the fp32
reference within bf16 tolerance. Prints the parity report.
"""

import pytest
import torch

from kda_backend import KDAProjection, ProjectionWeights
from kda_backend.reference import reference_projection

from parity.checkpoint import PARITY_MS, PREFIX, TINY, artifacts_dir, checksums, make_checkpoint, parity_input

ENGINES = ("vllm", "sglang")
NAMES = ("qkvg", "g1", "beta")


@pytest.fixture(scope="module")
def artifacts():
    found = {}
    for engine in ENGINES:
        path = artifacts_dir() / f"{engine}.pt"
        if not path.exists():
            pytest.fail(f"{path} missing: run the nox sessions `vllm` and `sglang` before `parity`")
        found[engine] = torch.load(path)
    return found


@pytest.fixture(scope="module")
def core_weights(tmp_path_factory):
    t = make_checkpoint(tmp_path_factory.mktemp("ckpt") / "model.safetensors")
    g = TINY
    w_qkvg = torch.cat([t[f"{PREFIX}.{n}_proj.weight"] for n in "qkvg"])
    fab_used = torch.cat([t[f"{PREFIX}.f_a_proj.weight"], t[f"{PREFIX}.b_proj.weight"]])
    pad16 = fab_used.new_zeros(g.fab_rows - g.fab_rows_used, g.hidden_size)
    w_fb = t[f"{PREFIX}.f_b_proj.weight"]
    packed = ProjectionWeights.from_packed(torch.cat([w_qkvg, fab_used, pad16]), w_fb, g)
    g8 = g.__class__(g.hidden_size, g.num_heads, g.head_dim, 1, g.conv_width, row_multiple=8)
    pad8 = fab_used.new_zeros(g8.fab_rows - g8.fab_rows_used, g.hidden_size)
    split = ProjectionWeights.from_split(w_qkvg, torch.cat([fab_used, pad8]), w_fb, g8)
    return {"vllm": packed, "sglang": split}


def _diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_engines_loaded_the_same_weights(artifacts, core_weights):
    for engine in ENGINES:
        w = core_weights[engine]
        g = w.geometry
        expected = checksums({"qkvg": w.w_qkvg, "fab": w.w_fab[: g.fab_rows_used], "fb": w.w_fb})
        assert artifacts[engine]["checksums"] == expected, engine


def test_cross_engine_parity_report(artifacts, core_weights, capsys):
    rows, failures = [], []
    core = {engine: KDAProjection(core_weights[engine]) for engine in ENGINES}
    for m in PARITY_MS:
        x = parity_input(m, TINY.hidden_size)
        w = core_weights["vllm"]
        ref = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, TINY)
        for engine in ENGINES:
            got = artifacts[engine]["outputs"][m]
            same_path = core[engine](x)
            for name, a, b, r in zip(NAMES, got, same_path, ref):
                equal = torch.equal(a, b)
                rel = ((a.float() - r).norm() / r.norm()).item()
                rows.append((engine, m, name, equal, _diff(a, b), rel))
                if not equal or rel > 1e-2 or a.isnan().any():
                    failures.append((engine, m, name))
        cross = [torch.equal(a, b) for a, b in zip(artifacts["vllm"]["outputs"][m], artifacts["sglang"]["outputs"][m])]
        rows += [("vllm=sglang", m, n, c, _diff(a, b), float("nan")) for n, c, a, b in
                 zip(NAMES, cross, artifacts["vllm"]["outputs"][m], artifacts["sglang"]["outputs"][m])]
        if not all(cross):
            failures.append(("vllm vs sglang", m, cross))
    with capsys.disabled():
        print("\nparity report: engine | M | output | bitwise equal to core (same path) | max abs diff | rel err vs fp32")
        for engine, m, name, equal, diff, rel in rows:
            print(f"{engine:>12} | {m:>2} | {name:>5} | {'equal' if equal else 'DIFFERS':>7} | {diff:.3e} | {rel:.2e}")
    assert not failures, failures
