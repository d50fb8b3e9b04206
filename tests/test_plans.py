"""Plans: serialization, the persisted store (atomic, locked, corrupt/mismatched files), resolution order."""

import json
import logging
import multiprocessing as mp

import pytest
import torch

from kda_backend import hookimpl, plan_store, planning, register_plugin
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step
from kda_backend.planning import forced_plan, resolve_plan, share

G = preset("kimi-k3", 8)
KEY = plan_store.plan_key(G, "NVIDIA H200", (9, 0), torch.bfloat16)
TACTICS = {("qkvg", 6144, 7168, 16): Tactic(block_n=16, block_k=256, block_t=16, stages=4),
           ("qkvg", 6144, 7168, 1): Tactic(block_n=16, block_k=256, block_t=16, stages=4, x_via_l1=False, x_bulk=True)}
PLAN = Plan(
    steps={1: Step(True, "cute", "cute", "cute"), 2: Step(False, "torch", "cute", "cute"),
           3: Step(True, "torch", "torch", "torch"), 4: Step(True, "cute", "cute", "cute", fused=True)},
    source="autotune",
    fallback=SEQUENTIAL_TORCH,
    tactics=TACTICS,
)


def test_plan_json_round_trip_and_lookup():
    again = Plan.from_document(json.loads(json.dumps(PLAN.to_document())))
    assert again == PLAN
    assert again.tactic_for("qkvg", 6144, 7168, 1) == TACTICS[("qkvg", 6144, 7168, 1)]
    assert again.tactic_for("qkvg", 6144, 7168, 2) == TACTICS[("qkvg", 6144, 7168, 16)]
    assert again.tactic_for("qkvg", 6144, 7168, 20) is None and again.tactic_for("fab", 144, 7168, 1) is None
    assert again.step(1).overlap and again.step(3).qkvg == "torch" and again.step(5) == SEQUENTIAL_TORCH
    assert [again.step(m).mode for m in (1, 2, 3, 4)] == ["overlap", "sequential", "overlap", "fused"]
    assert again.max_m == 4 and again.step(4).fused and not again.step(1).fused
    assert "M 3: overlap    qkvg=torch" in again.describe() and "M 4: fused      qkvg=cute" in again.describe()
    with pytest.raises(ValueError, match="unknown fields"):
        Step.from_json({"overlap": True, "qkv": "x"})


def test_key_names_everything_that_changes_the_answer():
    assert set(KEY) == {"device", "capability", "geometry", "dtype", "kda_backend", "torch", "cutlass_dsl"}
    other = plan_store.plan_key(preset("kimi-k3", 4), "NVIDIA H200", (9, 0), torch.bfloat16)
    assert plan_store.plan_path(KEY) != plan_store.plan_path(other)


def test_store_round_trip(tmp_path):
    path = plan_store.save(KEY, PLAN, tmp_path)
    assert path.parent == tmp_path and not list(tmp_path.glob("*.tmp"))
    assert plan_store.load(KEY, tmp_path) == PLAN


def test_store_uses_hook_cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    assert plan_store.save(KEY, PLAN).parent == tmp_path
    assert plan_store.load(KEY) == PLAN


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "key": ', "", '{"format": 99}', "[]"],
                         ids=["corrupt", "truncated", "empty", "format", "list"])
def test_corrupt_files_warn_once_and_are_ignored(tmp_path, content, kda_log):
    path = plan_store.plan_path(KEY, tmp_path)
    path.write_text(content)
    assert plan_store.load(KEY, tmp_path) is None
    assert plan_store.load(KEY, tmp_path) is None
    warnings = [m for m in kda_log.messages() if "ignoring unreadable plan" in m]
    assert len(warnings) == 1


def test_mismatched_key_is_ignored_with_reason(tmp_path, kda_log):
    path = plan_store.save(KEY, PLAN, tmp_path)
    data = json.loads(path.read_text())
    data["key"]["device"] = "NVIDIA H100"
    path.write_text(json.dumps(data))
    assert plan_store.load(KEY, tmp_path) is None
    assert any("made for another device" in m for m in kda_log.messages())


def _writer(folder, worker, rounds):
    plan = Plan(steps={m: Step(overlap=bool(worker % 2)) for m in range(1, 200)}, source=f"worker{worker}",
                tactics=TACTICS)
    for _ in range(rounds):
        plan_store.save(KEY, plan, folder)
        loaded = plan_store.load(KEY, folder)
        assert loaded is not None and loaded.source.startswith("worker")


def test_concurrent_writers_never_tear_the_file(tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(tmp_path, w, 30)) for w in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 0]
    plan = plan_store.load(KEY, tmp_path)
    assert plan.source in {"worker0", "worker1"} and plan.tactics == TACTICS


def test_forced_plans(tmp_path, monkeypatch):
    assert forced_plan() is None
    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")
    plan = forced_plan()
    assert plan.step(16).overlap and plan.source == "env:overlap"
    monkeypatch.setenv("KDA_BACKEND_PLAN", "sequential")
    assert not forced_plan().step(1).overlap
    monkeypatch.setenv("KDA_BACKEND_PLAN", "chained")
    with pytest.raises(ValueError, match="'chained': no such file; accepted: 'sequential', 'overlap' or the path"):
        forced_plan()
    path = plan_store.save(KEY, PLAN, tmp_path)
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    assert forced_plan() == PLAN
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json': no such file; accepted: 'sequential', 'overlap'"):
        forced_plan()


def test_resolve_on_cpu_is_the_automatic_plan():
    """On a CPU every M up to the forced plans' bound has the sequential step with automatic providers (an engine
    adapter's layer serves there), and nothing above it."""
    plan = resolve_plan(G, torch.device("cpu"))
    assert plan.source == "cpu" and set(plan.steps) == set(range(1, planning.FORCED_MAX_M + 1))
    assert set(plan.steps.values()) == {Step(overlap=False)}
    assert plan.covers(planning.FORCED_MAX_M) and not plan.covers(planning.FORCED_MAX_M + 1)


def test_a_plan_covers_its_tuned_and_borrowed_m_only():
    """What an engine adapter asks before serving a call: a step for M, tuned or borrowed from a larger tuned M;
    no tuned plan covers nothing."""
    plan = Plan(steps={8: Step(True), 32: Step(False)}, fallback=SEQUENTIAL_TORCH)
    assert [m for m in (1, 8, 9, 32, 33, 256) if plan.covers(m)] == [1, 8, 9, 32]
    assert not Plan(source="default (no tuned plan)", fallback=SEQUENTIAL_TORCH).covers(1)


def test_resolve_miss_falls_back_to_sequential_torch_with_one_warning(tmp_path, monkeypatch, kda_log):
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_store, "device_key", lambda g, d, t: plan_store.plan_key(g, "Fake GPU", (9, 0), t))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    for _ in range(2):
        plan = resolve_plan(G, torch.device("cuda", 0))
        assert plan.step(4) == SEQUENTIAL_TORCH and not plan.covers(1)
    assert len([m for m in kda_log.messages() if "no tuned plan" in m]) == 1


def test_resolve_hit_serves_the_stored_plan_with_its_tactics(tmp_path, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    key = plan_store.plan_key(G, "Fake GPU", (9, 0), torch.bfloat16)
    monkeypatch.setattr(plan_store, "device_key", lambda g, d, t: key)
    plan_store.save(key, PLAN)
    plan = resolve_plan(G, torch.device("cuda", 0))
    assert plan == PLAN and plan.tactics == TACTICS


def test_resolve_once_per_key(tmp_path, monkeypatch):
    """69 layers ask for one plan: it is loaded (and broadcast across ranks) once."""
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    key = plan_store.plan_key(G, "Fake GPU", (9, 0), torch.bfloat16)
    monkeypatch.setattr(plan_store, "device_key", lambda g, d, t: key)
    plan_store.save(key, PLAN)
    shares = []

    class Counting:
        @hookimpl
        def kda_share_plan(self, plan):
            shares.append(plan)
            return plan

    register_plugin(Counting(), "counting")
    plans = [resolve_plan(G, torch.device("cuda", 0)) for _ in range(5)]
    assert all(p == PLAN for p in plans) and len(shares) == 1
    monkeypatch.setenv("KDA_BACKEND_PLAN", "overlap")
    assert resolve_plan(G, torch.device("cuda", 0)).source == "env:overlap" and len(shares) == 2


def test_share_passes_through_host_hook():
    class Rank0:
        @hookimpl
        def kda_share_plan(self, plan):
            return {"plan": Plan.uniform(2, Step(overlap=True), source="rank0").to_json(), "tactics": plan["tactics"]}

    register_plugin(Rank0(), "rank0")
    plan = share(PLAN)
    assert plan.source == "rank0" and plan.tactics == TACTICS


def test_untuned_m_takes_the_next_larger_tuned_steps_and_the_fallback_above():
    """Between tuned M the step of the next larger tuned M serves (both engines pad a batch up to the next captured
    size); above the largest tuned M, the fallback."""
    fast, mid = Step(True, "cute", "cute", "cute"), Step(True, "torch", "torch", "torch")
    plan = Plan(steps={1: fast, 2: fast, 4: fast, 16: fast, 24: mid, 64: mid}, fallback=SEQUENTIAL_TORCH)
    assert [plan.step(m) for m in (3, 5, 16, 17, 40, 64)] == [fast, fast, fast, mid, mid, mid]
    assert plan.step(65) == plan.step(4096) == SEQUENTIAL_TORCH
    assert plan.tuned(24) and not plan.tuned(20)
    assert "next larger tuned M" in plan.describe()


def test_borrowed_step_names_a_provider_only_where_it_serves():
    """A step borrowed from a larger M names its provider where that provider serves this M; where it does not,
    the choice is automatic, never an error. A tuned step's provider is binding."""
    from kda_backend import KDAProjection, ProjectionWeights
    from kda_backend.geometry import KDAGeometry
    from kda_backend.reference import KDALayerWeights

    g = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16, tp_size=1)
    w = KDALayerWeights.random(g, torch.Generator().manual_seed(0))
    weights = ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, g)
    plan = Plan(steps={8: Step(True, "cute", "cute", "cute")}, fallback=SEQUENTIAL_TORCH)
    proj = KDAProjection(weights, plan)
    x = torch.randn(4, g.hidden_size).bfloat16()
    proj(x)  # M = 4 borrows M = 8's step; the CuTe provider cannot serve on the CPU
    assert {proj.provider(role, 4).name for role in ("qkvg", "fab", "fb")} == {"torch"}
    with pytest.raises(ValueError, match="forced provider 'cute' cannot serve qkvg M=8"):
        proj(torch.randn(8, g.hidden_size).bfloat16())


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Planning as on a GPU named "Fake GPU" with a cache folder of its own; tuning records the M it was asked for
    and answers with an overlapped step for each."""
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    key = plan_store.plan_key(G, "Fake GPU", (9, 0), torch.bfloat16)
    monkeypatch.setattr(plan_store, "device_key", lambda g, d, t: key)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    tuned: list[list[int]] = []

    def fake_autotune(geometry, device, ms=()):
        tuned.append(list(ms))
        return Plan(steps={m: Step(overlap=True) for m in ms}, source="autotune", fallback=SEQUENTIAL_TORCH)

    monkeypatch.setattr("kda_backend.autotune.autotune", fake_autotune)
    return key, tuned


def test_autotune_at_load_tunes_exactly_the_hosts_batch_sizes(fake_gpu, monkeypatch):
    key, tuned = fake_gpu
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    plan = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[16, 1, 2, 8, 300])
    assert tuned == [[1, 2, 8, 16]] and sorted(plan.steps) == [1, 2, 8, 16]
    assert plan_store.load(key) == plan  # stored, and it says which M were tuned
    again = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 2, 8, 16])
    assert again == plan and len(tuned) == 1


def test_autotune_at_load_stores_the_plan_every_rank_serves(fake_gpu, monkeypatch):
    """Each TP rank tunes on its own GPU, then serves rank 0's plan (the broadcast): that plan, not this rank's
    own, is what it stores for the next start."""
    key, _ = fake_gpu
    rank0 = Plan(steps={m: SEQUENTIAL_TORCH for m in (1, 8)} | {16: Step(overlap=True, fused=True)},
                 source="autotune on rank 0", fallback=SEQUENTIAL_TORCH)

    class Broadcast:
        @hookimpl
        def kda_share_plan(self, plan):
            return rank0.to_document()

    register_plugin(Broadcast(), "broadcast")
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    plan = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 8, 16])
    assert plan == rank0 and plan_store.load(key) == rank0


def test_autotune_at_load_leaves_the_hosts_random_state_as_it_was(fake_gpu, monkeypatch):
    """Tuning draws random weights; an engine's random state (its sampling, seeded before the model loads) is the
    same after planning as before it."""
    import kda_backend.autotune

    tune, drawn = kda_backend.autotune.autotune, []

    def drawing(geometry, device, ms=()):
        drawn.append(torch.randn(1000))
        return tune(geometry, device, ms)

    monkeypatch.setattr(kda_backend.autotune, "autotune", drawing)
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    torch.manual_seed(1234)
    resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 8])
    after = torch.randn(4)
    assert len(drawn) == 1  # the tuning ran, drawing from the host's generator
    torch.manual_seed(1234)
    assert torch.equal(after, torch.randn(4))


def test_stored_plan_missing_host_batch_sizes_is_retuned_with_them_or_borrows(fake_gpu, monkeypatch, kda_log):
    key, tuned = fake_gpu
    plan_store.save(key, Plan(steps={1: Step(True), 16: Step(True)}, fallback=SEQUENTIAL_TORCH))
    plan = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 4, 16, 24])
    assert tuned == [] and plan.step(4) == Step(True) and plan.step(24) == SEQUENTIAL_TORCH
    messages = kda_log.messages(logging.INFO)
    assert any("M = 4 were not tuned" in m for m in messages)
    assert any("M = 24 are above the plan's largest tuned M (16)" in m for m in kda_log.messages())
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    plan = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 4, 16, 24])
    assert tuned == [[1, 4, 16, 24]] and plan.tuned(24)
