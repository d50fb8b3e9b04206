"""Reliability, plans on disk: plan files (stored and forced), cache folders, and concurrent writers and readers.

A stored plan file that is outside the schema, unreadable or made for another key is ignored with one warning that
names the file and the problem (serving goes on: sequential cuBLAS); a forced one (``KDA_BACKEND_PLAN``) is refused
with an error. Readers take no lock and write nothing; writers wait for the lock at most a bounded time and clean up
after writers that died. The README's reliability table lists these cases.
"""

import fcntl
import json
import os
import stat
import subprocess
import sys
import time

import pytest
import torch

from kda_backend import hookimpl, plan_store, register_plugin
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.cache_files import STALE_TMP_S
from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step
from kda_backend.planning import forced_plan, resolve_plan

G = preset("kimi-k3", 8)
KEY = plan_store.plan_key(G, "NVIDIA H200", (9, 0), torch.bfloat16)
TACTICS = {("qkvg", 6144, 7168, 16): Tactic(block_n=16, block_k=256, block_t=16, stages=4)}
PLAN = Plan(steps={1: Step(True, "cute", "cute", "cute"), 16: Step(False, "torch", "cute", "torch")},
            source="autotune", fallback=SEQUENTIAL_TORCH, tactics=TACTICS)
PROVIDERS = "'auto' or a registered provider (cute, flashinfer, torch)"


def _data():
    return {"format": 1, "key": KEY, **PLAN.to_document()}


def _set(data, path, value):
    """``data`` with the field at ``path`` (a tuple of keys and indices) set to ``value``; ``...`` deletes it."""
    *parents, last = path
    target = data
    for part in parents:
        target = target[part]
    if value is ...:
        del target[last]
    else:
        target[last] = value
    return data


def _nested(depth):
    return "[" * depth + "]" * depth


# Case -> (file content: a change to a valid file's data, or raw text; the problem the warning names).
FILE_CASES = {
    "overlap-string-false": (("plan", "steps", "1", "overlap"), "false",
                             "plan.steps['1'].overlap: 'false' is a string; accepted: true or false"),
    "overlap-int": (("plan", "steps", "1", "overlap"), 1, "plan.steps['1'].overlap: 1 is an integer; accepted: true "
                                                          "or false"),
    "chained-field": (("plan", "steps", "1", "chained"), "no",
                      "plan.steps['1']: unknown fields ['chained']; accepted: overlap, qkvg, fab, fb, fused"),
    "fused-string": (("plan", "steps", "1", "fused"), "yes",
                     "plan.steps['1'].fused: 'yes' is a string; accepted: true or false"),
    "provider-int": (("plan", "steps", "1", "qkvg"), 5, f"plan.steps['1'].qkvg: 5 is an integer; accepted: {PROVIDERS}"),
    "provider-empty": (("plan", "steps", "16", "fb"), "", f"plan.steps['16'].fb: '' is a string; accepted: {PROVIDERS}"),
    "provider-unregistered": (("plan", "steps", "1", "fab"), "triton",
                              f"plan.steps['1'].fab: provider 'triton' is not registered; accepted: {PROVIDERS}"),
    "fallback-provider-list": (("plan", "fallback", "qkvg"), ["torch"],
                               f"plan.fallback.qkvg: ['torch'] is a list; accepted: {PROVIDERS}"),
    "m-zero": (("plan", "steps", "0"), {}, 'plan.steps: key \'0\' is not an M; accepted: positive integers ("1", '
                                           '"16")'),
    "m-negative": (("plan", "steps", "-1"), {}, 'plan.steps: key \'-1\' is not an M; accepted: positive integers '
                                                '("1", "16")'),
    "m-fraction": (("plan", "steps", "1.5"), {}, 'plan.steps: key \'1.5\' is not an M; accepted: positive integers '
                                                 '("1", "16")'),
    "steps-list": (("plan", "steps"), [], 'plan.steps: a list; accepted: an object keyed by M ("1", "2", ...)'),
    "step-string": (("plan", "steps", "1"), "overlap",
                    "plan.steps['1']: a string; accepted: an object with fields overlap, qkvg, fab, fb, fused"),
    "plan-missing": (("plan",), ..., "plan: null; accepted: an object with fields source, fallback, steps"),
    "plan-unknown-field": (("plan", "chained"), True, "plan: unknown fields ['chained']; accepted: source, fallback, "
                                                      "steps"),
    "source-int": (("plan", "source"), 3, "plan.source: 3 is an integer; accepted: a string"),
    "key-list": (("key",), [], "key: a list; accepted: an object (what the plan was tuned for)"),
    "key-string": (("key",), "H200", "key: a string; accepted: an object (what the plan was tuned for)"),
    "format-2": (("format",), 2, "format: 2; accepted: 1"),
    "unknown-top-field": (("comment",), "x", "file: unknown fields ['comment']; accepted: format, key, plan, tactics"),
    "tactics-object": (("tactics",), {}, "tactics: an object; accepted: a list of objects"),
    "tactic-block-n-string": (("tactics", 0, "tactic", "block_n"), "big",
                              "tactics[0].tactic.block_n: 'big' is a string; accepted: an integer"),
    "tactic-stages-negative": (("tactics", 0, "tactic", "stages"), -3,
                               "tactics[0].tactic: stages=-3 must be a positive integer"),
    "tactic-block-n-zero": (("tactics", 0, "tactic", "block_n"), 0,
                            "tactics[0].tactic: block_n=0 must be a positive integer"),
    "tactic-block-k-zero": (("tactics", 0, "tactic", "block_k"), 0,
                            "tactics[0].tactic: block_k=0 must be a positive integer"),
    "tactic-block-k": (("tactics", 0, "tactic", "block_k"), 100,
                       "tactics[0].tactic: block_k=100 must be a multiple of 64 dividing K=7168"),
    "tactic-pdl-string": (("tactics", 0, "tactic", "pdl"), "yes",
                          "tactics[0].tactic.pdl: 'yes' is a string; accepted: true or false"),
    "tactic-split-k-bool": (("tactics", 0, "tactic", "split_k"), True,
                            "tactics[0].tactic.split_k: True is a bool; accepted: an integer"),
    "tactic-unknown-field": (("tactics", 0, "tactic", "warps"), 4,
                             "tactics[0].tactic: unknown fields ['warps']; accepted: kernel, block_n, block_k, "
                             "block_t, stages, pdl, x_via_l1, split_k, x_tma, x_bulk"),
    "tactic-unknown-kernel": (("tactics", 0, "tactic", "kernel"), "hmma",
                              "tactics[0].tactic.kernel: 'hmma'; accepted: 'mma', 'wgmma'"),
    "tactic-kernel-list": (("tactics", 0, "tactic", "kernel"), ["wgmma"],
                           "tactics[0].tactic.kernel: ['wgmma']; accepted: 'mma', 'wgmma'"),
    "tactic-two-paths": (("tactics", 0, "tactic", "x_tma"), True,
                         "tactics[0].tactic: x_tma, x_via_l1 and x_bulk exclude each other (one activation path)"),
    "tactic-bucket": (("tactics", 0, "bucket"), 7, "tactics[0].bucket: 7; accepted: 1, 16, 32, 64, 128, 256"),
    "tactic-role": (("tactics", 0, "role"), "qkv", "tactics[0].role: 'qkv'; accepted: qkvg, fab, fb"),
    "tactic-n-string": (("tactics", 0, "n"), "6144", "tactics[0].n: '6144' is a string; accepted: a positive integer"),
    "tactic-k-zero": (("tactics", 0, "k"), 0, "tactics[0].k: 0 is an integer; accepted: a positive integer"),
    "empty": ("", None, "empty file"),
    "blank": (" \n", None, "empty file"),
    "truncated": ('{"format": 1, "key": ', None,
                  "not JSON (Expecting value: line 1 column 22 (char 21))"),
    "not-utf8": (b"\xff\xfe{}", None, "not UTF-8 text (invalid start byte at byte 0)"),
    "deeply-nested": (_nested(100_000), None, "JSON nested too deeply to be a plan"),
    "list": ("[]", None, "file: a list; accepted: an object with fields format, key, plan, tactics"),
}


def _write_case(path, case):
    where, value, _ = FILE_CASES[case]
    if isinstance(where, tuple):
        path.write_text(json.dumps(_set(_data(), where, value)))
    elif isinstance(where, bytes):
        path.write_bytes(where)
    else:
        path.write_text(where)


@pytest.mark.parametrize("case", list(FILE_CASES), ids=[f"plan-file-{c}" for c in FILE_CASES])
def test_stored_plan_file_outside_the_schema_is_ignored_with_one_warning(case, tmp_path, kda_log):
    path = plan_store.plan_path(KEY, tmp_path)
    _write_case(path, case)
    assert plan_store.load(KEY, tmp_path) is None
    assert plan_store.load(KEY, tmp_path) is None
    assert kda_log.messages() == [f"ignoring unreadable plan {path}: {FILE_CASES[case][2]}"]


@pytest.mark.parametrize("case", ["overlap-string-false", "tactic-stages-negative", "tactic-block-k-zero",
                                  "deeply-nested"], ids=lambda c: f"plan-file-forced-{c}")
def test_forced_plan_file_outside_the_schema_is_refused(case, tmp_path, monkeypatch):
    path = tmp_path / "plan.json"
    _write_case(path, case)
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    with pytest.raises(ValueError) as caught:
        forced_plan()
    assert str(caught.value) == (f"KDA_BACKEND_PLAN={str(path)!r}: not a plan file ({FILE_CASES[case][2]}); accepted: "
                                 "'sequential', 'overlap' or the path of a plan file written by `kda-backend autotune`")


def test_plan_file_that_is_a_folder_is_ignored_with_one_warning(tmp_path, kda_log):
    path = plan_store.plan_path(KEY, tmp_path)
    path.mkdir()
    assert plan_store.load(KEY, tmp_path) is None
    assert kda_log.messages() == [f"ignoring unreadable plan {path}: Is a directory"]


def test_stored_plan_for_another_device_is_ignored_naming_both_values(tmp_path, kda_log):
    other = plan_store.plan_key(preset("kimi-k3", 4), "NVIDIA H100", (9, 0), torch.bfloat16)
    path = plan_store.plan_path(KEY, tmp_path)
    path.write_text(json.dumps({**_data(), "key": other}))
    assert plan_store.load(KEY, tmp_path) is None
    assert kda_log.messages() == [
        f"ignoring plan {path}: made for another device, geometry (device: file 'NVIDIA H100', here 'NVIDIA H200'; "
        "geometry.tp_size: file 4, here 8; geometry.heads_local: file 24, here 12; geometry.qkvg: file [12288, 7168], "
        "here [6144, 7168]; geometry.fab: file [160, 7168], here [144, 7168]; geometry.fb: file [3072, 128], here "
        "[1536, 128]; geometry.packed: file [12448, 7168], here [6288, 7168])"]


@pytest.fixture
def fake_gpu(tmp_path, monkeypatch):
    """Planning as on an H200 (device key ``KEY``) with its own cache folder."""
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(plan_store, "device_key", lambda g, d, t: plan_store.plan_key(g, "NVIDIA H200", (9, 0), t))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "NVIDIA H200")
    return tmp_path


def test_serving_with_a_corrupt_stored_plan_runs_sequential_cublas(fake_gpu, kda_log):
    plan_store.plan_path(KEY, fake_gpu).write_text(json.dumps(_set(_data(), ("plan", "steps", "1", "overlap"), "no")))
    plan = resolve_plan(G, torch.device("cuda", 0))
    assert plan.step(1) == SEQUENTIAL_TORCH
    assert [m.split(":")[0] for m in kda_log.messages()] == [
        f"ignoring unreadable plan {plan_store.plan_path(KEY, fake_gpu)}", "no tuned plan for NVIDIA H200 tp8"]


def test_forced_plan_file_for_another_gpu_and_tp_is_refused_naming_both_keys(fake_gpu, monkeypatch):
    other = plan_store.plan_key(preset("kimi-k3", 4), "NVIDIA H100", (9, 0), torch.bfloat16)
    path = plan_store.save(other, PLAN, fake_gpu / "elsewhere")
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    with pytest.raises(ValueError) as caught:
        resolve_plan(G, torch.device("cuda", 0))
    message = str(caught.value)
    assert message.startswith(f"KDA_BACKEND_PLAN={str(path)!r}: made for another device, geometry or dtype (device: "
                              "file 'NVIDIA H100', here 'NVIDIA H200'; geometry.tp_size: file 4, here 8; ")
    assert message.endswith(f"); accepted: a plan file made for this key {KEY}")


def test_forced_plan_file_of_other_versions_serves_with_one_warning(fake_gpu, monkeypatch, kda_log):
    path = plan_store.save({**KEY, "torch": "2.0.0"}, PLAN, fake_gpu / "elsewhere")
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    assert resolve_plan(G, torch.device("cuda", 0)) == PLAN
    assert kda_log.messages() == [f"KDA_BACKEND_PLAN={str(path)!r} was tuned with other versions (torch: file "
                                  f"'2.0.0', here {KEY['torch']!r}); serving it (`kda-backend autotune` re-tunes it)"]


def test_forced_plan_file_on_cpu_must_match_the_geometry(tmp_path, monkeypatch):
    path = plan_store.save(plan_store.plan_key(preset("kimi-k3", 4), "NVIDIA H200", (9, 0), torch.bfloat16), PLAN,
                           tmp_path)
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    with pytest.raises(ValueError, match=r"made for another device, geometry or dtype \(geometry.tp_size: file 4, "
                                         r"here 8; "):
        resolve_plan(G, torch.device("cpu"))
    assert resolve_plan(preset("kimi-k3", 4), torch.device("cpu")) == PLAN


def test_forced_plan_in_a_missing_folder_is_refused_and_creates_nothing(tmp_path, monkeypatch):
    path = tmp_path / "missing" / "dir" / "plan.json"
    monkeypatch.setenv("KDA_BACKEND_PLAN", str(path))
    with pytest.raises(ValueError) as caught:
        resolve_plan(G, torch.device("cpu"))
    assert str(caught.value) == (f"KDA_BACKEND_PLAN={str(path)!r}: no such file; accepted: 'sequential', 'overlap' "
                                 "or the path of a plan file written by `kda-backend autotune`")
    assert list(tmp_path.iterdir()) == []


def _snapshot(folder):
    return {p.name: (p.stat().st_mtime_ns, p.stat().st_size) for p in folder.iterdir()}


def test_read_only_cache_folder_serves_its_plans_and_is_not_written(fake_gpu):
    plan_store.save(KEY, PLAN)
    before = _snapshot(fake_gpu)
    for p in fake_gpu.iterdir():
        p.chmod(0o444)
    fake_gpu.chmod(0o555)
    try:
        assert resolve_plan(G, torch.device("cuda", 0)) == PLAN
        assert plan_store.load(KEY) == PLAN
        assert _snapshot(fake_gpu) == before
    finally:
        fake_gpu.chmod(0o755)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_saving_into_a_read_only_folder_says_so(tmp_path):
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(OSError) as caught:
            plan_store.save(KEY, PLAN, tmp_path)
    finally:
        tmp_path.chmod(0o755)
    assert str(caught.value) == (f"cannot store plans in {tmp_path}: Permission denied; accepted: a "
                                 "folder this process may write (KDA_BACKEND_CACHE_DIR)")


def test_stored_plans_are_readable_by_every_user(tmp_path):
    """A plan a tuning job (another user) stored serves the serving user: 0644, not mkstemp's 0600."""
    path = plan_store.save(KEY, PLAN, tmp_path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_saving_where_the_lock_cannot_be_created_says_so(tmp_path, monkeypatch):
    """What a read-only folder gives a writer, also where the tests run as root (who may write anywhere)."""

    def refused(path, *args):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(plan_store.os, "open", refused)
    with pytest.raises(PermissionError) as caught:
        plan_store.save(KEY, PLAN, tmp_path)
    assert str(caught.value) == (f"cannot store plans in {tmp_path}: Permission denied; accepted: a folder this "
                                 "process may write (KDA_BACKEND_CACHE_DIR)")


def _folder_cases(tmp_path):
    dangling, loop_a, loop_b, file = (tmp_path / n for n in ("dangling", "loop_a", "loop_b", "file"))
    dangling.symlink_to(tmp_path / "nowhere")
    loop_a.symlink_to(loop_b)
    loop_b.symlink_to(loop_a)
    file.write_text("x")
    return {
        "dangling-symlink": (dangling, f"{dangling} is a symbolic link to {str(tmp_path / 'nowhere')!r}, which does "
                                       "not exist"),
        "symlink-loop": (loop_a, f"{loop_a} is a symbolic link loop"),
        "a-file": (file, f"{file} is not a folder"),
        "under-a-file": (file / "cache", f"{file} is not a folder"),
        "under-a-dangling-symlink": (dangling / "cache", f"{dangling} is a symbolic link to "
                                                         f"{str(tmp_path / 'nowhere')!r}, which does not exist"),
    }


FOLDER_CASES = ["dangling-symlink", "symlink-loop", "a-file", "under-a-file", "under-a-dangling-symlink"]


@pytest.mark.parametrize("case", FOLDER_CASES, ids=[f"cache-folder-{c}" for c in FOLDER_CASES])
def test_cache_folder_that_cannot_be_one_is_named(case, tmp_path, monkeypatch):
    folder, problem = _folder_cases(tmp_path)[case]
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(folder))
    with pytest.raises(ValueError) as caught:
        plan_store.load(KEY)
    assert str(caught.value) == (f"cache folder {folder} from KDA_BACKEND_CACHE_DIR={str(folder)!r}: {problem}; "
                                 "accepted: a folder, or a path where one can be created")
    with pytest.raises(ValueError) as caught:
        plan_store.save(KEY, PLAN, folder)
    assert str(caught.value) == f"cannot store plans in {folder}: {problem}"


# --- concurrency ------------------------------------------------------------------------------------------------

def _hold_lock(path):
    """Hold the writers' lock of ``path`` as a stalled writer would (a separate open file: flock conflicts)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_WRONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_reader_never_waits_for_a_stalled_writer(tmp_path):
    plan_store.save(KEY, PLAN, tmp_path)
    fd = _hold_lock(plan_store.plan_path(KEY, tmp_path))
    try:
        start = time.monotonic()
        assert plan_store.load(KEY, tmp_path) == PLAN
        assert time.monotonic() - start < 1
    finally:
        os.close(fd)


def test_writer_waits_for_a_stalled_writer_a_bounded_time(tmp_path):
    path = plan_store.plan_path(KEY, tmp_path)
    fd = _hold_lock(path)
    try:
        start = time.monotonic()
        with pytest.raises(TimeoutError) as caught:
            plan_store.save(KEY, PLAN, tmp_path, lock_timeout=0.3)
        assert 0.3 <= time.monotonic() - start < 2
    finally:
        os.close(fd)
    assert str(caught.value) == (f"plan store: waited 0.3 s for {path.with_suffix('.lock')}, which another writer "
                                 "holds (a stalled process?); the plan was not stored")
    assert not path.exists()


def test_writer_killed_holding_the_lock_does_not_block_the_next(tmp_path):
    path = plan_store.plan_path(KEY, tmp_path)
    code = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); print('locked', flush=True); time.sleep(60)")
    holder = subprocess.Popen([sys.executable, "-c", code, str(path.with_suffix(".lock"))], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        holder.kill()
        holder.wait(10)
        assert plan_store.save(KEY, PLAN, tmp_path, lock_timeout=5) == path
    finally:
        holder.kill()
        holder.stdout.close()


def test_temp_files_of_killed_writers_are_removed_at_the_next_save(tmp_path):
    path = plan_store.plan_path(KEY, tmp_path)
    stale, live, other = (tmp_path / f"{path.name}{tag}.tmp" for tag in ("dead1", "live2", "x"))
    foreign = tmp_path / "notes.tmp"
    for p in (stale, live, other, foreign):
        p.write_text("{")
    old = time.time() - STALE_TMP_S - 5
    for p in (stale, other, foreign):
        os.utime(p, (old, old))
    plan_store.save(KEY, PLAN, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([path.name, path.with_suffix(".lock").name,
                                                                 live.name, foreign.name])
    assert plan_store.load(KEY, tmp_path) == PLAN


def test_threads_writing_and_reading_see_whole_files(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    plans = [Plan(steps={m: Step(overlap=bool(i % 2)) for m in range(1, 100)}, source=f"writer{i}", tactics=TACTICS)
             for i in range(4)]

    def write(i):
        for _ in range(20):
            plan_store.save(KEY, plans[i], tmp_path)

    def read(_):
        seen = [plan_store.load(KEY, tmp_path) for _ in range(50)]
        return all(s is None or (s in plans and s.tactics == TACTICS) for s in seen)

    with ThreadPoolExecutor(8) as pool:
        writers = [pool.submit(write, i) for i in range(4)]
        readers = [pool.submit(read, i) for i in range(4)]
        assert all(r.result() for r in readers) and [w.result() for w in writers] == [None] * 4
    assert plan_store.load(KEY, tmp_path) in plans and not list(tmp_path.glob("*.tmp"))


def test_shared_plan_answer_goes_through_the_schema(fake_gpu):
    """A host's broadcast is input too: an answer outside the schema drops that host plugin (see the plugin
    tests); a good one is served."""

    class Rank0:
        @hookimpl
        def kda_share_plan(self, plan):
            return {"plan": Plan.uniform(2, Step(overlap=True), source="rank0").to_json(), "tactics": []}

    register_plugin(Rank0(), "rank0")
    assert resolve_plan(G, torch.device("cuda", 0)).source == "rank0"


def test_plan_tuned_at_load_serves_when_the_cache_folder_refuses_it(fake_gpu, monkeypatch, kda_log):
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    monkeypatch.setattr("kda_backend.autotune.autotune", lambda geometry, device, ms=(): PLAN)

    def refused(*args, **kwargs):
        raise PermissionError(f"cannot store plans in {fake_gpu}: Permission denied; accepted: a folder this process "
                              "may write (KDA_BACKEND_CACHE_DIR)")

    monkeypatch.setattr(plan_store, "save", refused)
    assert resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 16]) == PLAN
    assert kda_log.messages() == [f"cannot store plans in {fake_gpu}: Permission denied; accepted: a folder this "
                                  "process may write (KDA_BACKEND_CACHE_DIR); serving the tuned plan without storing it"]


def _tuning_fails(geometry, device, ms=()):
    raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 88.00 MiB")


def test_failed_tuning_at_load_falls_back_to_the_engines_path_with_one_warning(fake_gpu, monkeypatch, kda_log):
    """KDA_BACKEND_AUTOTUNE=1 with no stored plan, and tuning fails (here: the GPU is full beside the model): the
    engine loads on, its own path at every M, nothing stored, and one warning names the failure and the remedy."""
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    monkeypatch.setattr("kda_backend.autotune.autotune", _tuning_fails)
    plan = resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 16])
    assert plan.steps == {} and not plan.covers(1) and plan.source == "default (tuning failed)"
    assert plan_store.load(KEY) is None
    assert kda_log.messages() == [
        "KDA_BACKEND_AUTOTUNE=1: tuning the plan for NVIDIA H200 tp8 failed (OutOfMemoryError: CUDA out of memory. "
        "Tried to allocate 88.00 MiB); this rank falls back to no tuned plan (the engine's own path), and every TP "
        "rank serves rank 0's plan. Run `kda-backend autotune` on this GPU before serving: it tunes without the "
        "engine's weights beside it"
    ]


def test_failed_tuning_at_load_keeps_the_stored_plan(fake_gpu, monkeypatch, kda_log):
    """A stored plan lacking some of the host's batch sizes is retuned at load; where that fails it serves as
    stored (unchanged on disk), with one warning."""
    plan_store.save(KEY, PLAN)
    monkeypatch.setenv("KDA_BACKEND_AUTOTUNE", "1")
    monkeypatch.setattr("kda_backend.autotune.autotune", _tuning_fails)
    assert resolve_plan(G, torch.device("cuda", 0), batch_sizes=[1, 8, 16]) == PLAN
    assert plan_store.load(KEY) == PLAN
    assert [m.split(";")[1] for m in kda_log.messages()] == [
        " this rank falls back to the stored plan, and every TP rank serves rank 0's plan. Run `kda-backend "
        "autotune` on this GPU before serving: it tunes without the engine's weights beside it"]
