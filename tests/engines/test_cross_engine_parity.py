"""Cross-engine parity (nox session `parity`, after `vllm` and `sglang` wrote their artifacts).

For every checkpoint, TP size and rank (``PARITY_CASES``): the shard each engine loaded through its own loaders
equals the shard sliced here; each adapter's projections equal the core's on the same path (packed for vLLM,
split for SGLang) bit for bit, equal each other, and are within bf16 tolerance of the fp32 reference; and the
per-rank outputs of TP 2, 4 and 8, put together, are the TP 1 outputs (f_a replicated, QKVG, beta and F_B
sharded). Prints the parity report, then one line per engine and world size for the groups of one process per
rank that the nox sessions `vllm` and `sglang` ran (``test_tp_processes.py``).
"""

import json

import pytest
import torch

from kda_backend import KDAProjection
from kda_backend.reference import reference_projection

from parity.checkpoint import (
    CHECKPOINTS, NAMES, PARITY_CASES, PARITY_MS, TP_SIZES, artifacts_dir, core_weights, loaded_checksums,
    make_checkpoint, parity_input, rank_shards,
)
from tp_processes import WORLD_SIZES

ENGINES = ("vllm", "sglang")
# Each engine's storage: vLLM packs [QKVG; FAB] padded to 16 rows, SGLang keeps QKVG and pads [f_a | b] to 8.
LAYOUTS = {"vllm": dict(packed=True, row_multiple=16), "sglang": dict(packed=False, row_multiple=8)}


@pytest.fixture(scope="module")
def artifacts():
    found = {}
    for engine in ENGINES:
        path = artifacts_dir() / f"{engine}.pt"
        if not path.exists():
            pytest.fail(f"{path} missing: run the nox sessions `vllm` and `sglang` before `parity`")
        found[engine] = torch.load(path)["results"]
        missing = set(PARITY_CASES) - set(found[engine])
        assert not missing, f"{engine} artifact lacks cases {sorted(missing)}"
    return found


@pytest.fixture(scope="module")
def core(tmp_path_factory):
    """Per case and engine layout, the core's weights over the shard sliced from the same seeded checkpoint."""
    folder = tmp_path_factory.mktemp("ckpt")
    tensors = {name: make_checkpoint(folder / f"{name}.safetensors", g) for name, g in CHECKPOINTS.items()}
    return {
        (case, engine): core_weights(
            rank_shards(tensors[case[0]], CHECKPOINTS[case[0]], case[1], case[2]),
            CHECKPOINTS[case[0]].with_tp(case[1]), **LAYOUTS[engine],
        )
        for case in PARITY_CASES for engine in ENGINES
    }


def _diff(a, b):
    return (a.float() - b.float()).abs().max().item()


def test_engines_loaded_the_same_shards(artifacts, core):
    for case in PARITY_CASES:
        for engine in ENGINES:
            assert artifacts[engine][case]["checksums"] == loaded_checksums(core[case, engine]), (engine, case)


def test_f_a_is_replicated_on_every_rank(artifacts):
    for engine in ENGINES:
        for name in CHECKPOINTS:
            f_a = {case: artifacts[engine][case]["checksums"]["f_a"] for case in PARITY_CASES if case[0] == name}
            assert len({tuple(v) for v in f_a.values()}) == 1, (engine, name, f_a)


def test_cross_engine_parity_report(artifacts, core, capsys):
    """Per engine, checkpoint, TP and M (all ranks and outputs together): bitwise equality with the core on the
    same path, max abs diff, worst relative error vs the fp32 reference; then vLLM vs SGLang."""
    rows, failures = [], []
    projections = {key: KDAProjection(w) for key, w in core.items()}
    for name in CHECKPOINTS:
        for tp in TP_SIZES[name]:
            cases = [c for c in PARITY_CASES if c[:2] == (name, tp)]
            for m in PARITY_MS:
                x = parity_input(m, CHECKPOINTS[name].hidden_size)
                stats = {engine: [0, 0, 0.0, 0.0] for engine in (*ENGINES, "vllm=sglang")}
                for case in cases:
                    w = core[case, "vllm"]
                    ref = reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, w.geometry)
                    outs = {engine: artifacts[engine][case]["outputs"][m] for engine in ENGINES}
                    for engine in ENGINES:
                        same_path = projections[case, engine](x)
                        for out_name, a, b, r in zip(NAMES, outs[engine], same_path, ref):
                            rel = ((a.float() - r).norm() / r.norm()).item()
                            _tally(stats[engine], torch.equal(a, b), _diff(a, b), rel)
                            if not torch.equal(a, b) or rel > 1e-2 or a.isnan().any():
                                failures.append((engine, case, m, out_name))
                    for out_name, a, b in zip(NAMES, outs["vllm"], outs["sglang"]):
                        _tally(stats["vllm=sglang"], torch.equal(a, b), _diff(a, b), 0.0)
                        if not torch.equal(a, b):
                            failures.append(("vllm vs sglang", case, m, out_name))
                rows += [(engine, name, tp, m, *s) for engine, s in stats.items()]
    with capsys.disabled():
        print("\nparity report (per engine x checkpoint x TP x M, over every rank and output): "
              "bitwise equal to the core on the same path | max abs diff | worst rel err vs fp32")
        for engine, name, tp, m, equal, total, diff, rel in rows:
            rel_text = "-" if engine == "vllm=sglang" else f"{rel:.2e}"
            print(f"{engine:>12} | {name:>7} | tp{tp} | M={m:>2} | {equal:>3}/{total:<3} equal | {diff:.3e} | "
                  f"{rel_text}")
    assert not failures, failures[:20]


def _tally(stat, equal, diff, rel):
    stat[0] += equal
    stat[1] += 1
    stat[2] = max(stat[2], diff)
    stat[3] = max(stat[3], rel)


def test_tensor_parallel_processes_report(capsys):
    """Per engine and world size, what the engine's group of one process per rank (gloo, the engine's own
    parallel state, loaders and plan broadcast) established; a world size is listed once its test passed there."""
    groups = {}
    for engine in ENGINES:
        path = artifacts_dir() / f"{engine}-tp-processes.json"
        if not path.exists():
            pytest.fail(f"{path} missing: run the nox sessions `vllm` and `sglang` before `parity`")
        groups[engine] = {g["world_size"]: g for g in json.loads(path.read_text())["groups"]}
    with capsys.disabled():
        print("\ntensor-parallel processes (one per rank, gloo): outputs over all ranks vs the one-process group | "
              "plan every rank serves | forwards at different times | wall time")
        for engine in ENGINES:
            for n, g in sorted(groups[engine].items()):
                print(f"{engine:>12} | tp{n} | {n} processes | {'+'.join(g['checkpoints']):<12} | "
                      f"{g['outputs_equal_to_tp1']:>3} outputs bitwise equal to TP1 | {g['plan']!r} on "
                      f"{g['ranks_with_rank0_plan']}/{n} ranks, {g['broadcasts_at_load']} broadcast(s) at load, none "
                      f"in forwards | ranks {g['forwarded']} forwarded, {g['never_forwarded']} never, none blocked | "
                      f"{g['seconds']:.0f} s")
    for engine in ENGINES:
        passed = sorted(groups[engine])
        assert passed == list(WORLD_SIZES), f"{engine}: world sizes that passed: {passed}"


def _gather_ranks(per_rank, geometry):
    """Per-rank ``(qkvg, g1, beta)`` of one TP size -> the unsharded layout: q, k, v and g each concatenated over
    ranks, then g1 and beta concatenated over ranks."""
    hd = geometry.local_width
    qkvg = torch.cat([torch.cat([out[0][:, i * hd : (i + 1) * hd] for out in per_rank], dim=-1) for i in range(4)], -1)
    return qkvg, torch.cat([out[1] for out in per_rank], -1), torch.cat([out[2] for out in per_rank], -1)


@pytest.mark.parametrize("engine", ENGINES)
def test_tensor_parallel_shards_reproduce_unsharded(artifacts, engine):
    for name, geometry in CHECKPOINTS.items():
        for tp in TP_SIZES[name][1:]:
            for m in PARITY_MS:
                per_rank = [artifacts[engine][(name, tp, rank)]["outputs"][m] for rank in range(tp)]
                unsharded = artifacts[engine][(name, 1, 0)]["outputs"][m]
                for out_name, a, b in zip(NAMES, _gather_ranks(per_rank, geometry.with_tp(tp)), unsharded):
                    assert torch.equal(a, b), f"{engine} {name} TP{tp} M={m} {out_name}: max diff {_diff(a, b)}"
