"""Tensor-parallel groups of real processes on the CPU: one OS process per rank over gloo, for the engine tests.

The test process (:func:`run_group`) starts ``world_size`` copies of an engine's rank program (``vllm_tp_rank``,
``sglang_tp_rank``), each with its own plan cache folder (``KDA_BACKEND_CACHE_DIR``), and orders what they do after
loading so that ranks reach the layer's first forward at different times: the middle ranks never run a forward and
exit; rank 0 runs its forwards once they are gone; the last rank runs its own only after rank 0 has exited. A rank
that waited on a collective in a forward would wait for a rank that never comes, so every wait has a deadline and a
hang fails the test with each rank's log instead of stalling CI.

The rank programs share the rest of this module: their arguments, the plans they store, planning as on a GPU (a CPU
has no device key, and only a device key selects a stored plan), counting the plan broadcasts over the engine's TP
group, and the hand-off of results. Nothing here imports an engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine_helpers import free_port
from parity.checkpoint import CHECKPOINTS, NAMES, PARITY_MS, artifacts_dir

WORLD_SIZES = (2, 4, 8)
FAKE_GPU = "Fake GPU (tensor-parallel processes on the CPU)"
POLL_S = 0.05


def checkpoints_for(world_size: int) -> tuple[str, ...]:
    """The seeded checkpoints a group loads: every geometry whose heads its ranks divide (tiny's 8 heads at every
    world size; k3-rank's 12 heads of 128, Kimi-K3's per-rank shapes at TP8, over 1, 2 and 4 ranks)."""
    return tuple(name for name, g in CHECKPOINTS.items() if g.num_heads % world_size == 0)


def forward_order(world_size: int) -> tuple[int, ...]:
    """The ranks that run forwards, in the order they run them: rank 0, then the last rank after rank 0 exited.
    The ranks in between never run one."""
    return (0,) if world_size == 1 else (0, world_size - 1)


# --- the test process ------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GroupRun:
    """What the ranks of one group reported: ``loaded[r]`` after loading (outputs, plans, broadcasts), ``forwarded[r]``
    for the ranks in :func:`forward_order`, and the group's wall time from the first start to the last exit."""

    world_size: int
    loaded: dict[int, dict[str, Any]]
    forwarded: dict[int, dict[str, Any]]
    seconds: float


def run_group(program: str, world_size: int, checkpoint_dir: Path, folder: Path, timeout_s: float) -> GroupRun:
    """Run ``python -m program`` as every rank of a ``world_size`` group and collect what each reported.

    :param program: the rank program's module (in tests/engines).
    :param checkpoint_dir: where the seeded checkpoints are (``<name>.safetensors``).
    :param folder: an empty folder for this group: rank cache folders, hand-off files, logs.
    :param timeout_s: the deadline for the whole group; a rank still running then is killed and the test fails.
    """
    tests = Path(__file__).resolve().parents[1]
    # The ranks choose their plans from their own cache folders only: no forced plan or tuning from outside.
    env = {k: v for k, v in os.environ.items() if not k.startswith("KDA_BACKEND_")}
    env["PYTHONPATH"] = os.pathsep.join([str(tests), str(tests / "engines"), env.get("PYTHONPATH", "")])
    # One CPU thread per rank: the ranks share the machine's cores, and with more threads the CPU BLAS may split a
    # skinny GEMM's K by the GEMM's shape (on 2 threads a 1536-row shard's M = 1 GEMV summed in another order than
    # the same rows inside TP1's 6144), which would make gathered shards differ from TP1 in the last bit.
    env["OMP_NUM_THREADS"] = "1"
    port = free_port()
    start = time.monotonic()
    deadline = start + timeout_s
    ranks, logs = [], []
    try:
        for rank in range(world_size):
            log = open(folder / f"rank-{rank}.log", "w")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            ranks.append(subprocess.Popen(
                [sys.executable, "-m", program, "--rank", str(rank), "--world-size", str(world_size),
                 "--port", str(port), "--checkpoints", str(checkpoint_dir), "--folder", str(folder)],
                env={**env, "KDA_BACKEND_CACHE_DIR": str(folder / f"cache-{rank}")},
                stdout=log, stderr=subprocess.STDOUT, cwd=tests.parent,
            ))
        order = forward_order(world_size)
        loaded = {}
        for rank in range(world_size):
            loaded[rank] = torch.load(_wait_for_file(folder / f"loaded-{rank}.pt", ranks, deadline, folder))
        for rank in range(world_size):
            if rank not in order:
                _wait_for_exit(ranks, rank, deadline, folder)
        forwarded = {}
        for rank in order:
            (folder / f"turn-{rank}").touch()
            path = _wait_for_file(folder / f"forwarded-{rank}.json", ranks, deadline, folder)
            forwarded[rank] = json.loads(path.read_text())
            _wait_for_exit(ranks, rank, deadline, folder)
        return GroupRun(world_size, loaded, forwarded, time.monotonic() - start)
    finally:
        for proc in ranks:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for log in logs:
            log.close()


def _wait_for_file(path: Path, ranks: list[subprocess.Popen], deadline: float, folder: Path) -> Path:
    while not path.exists():
        _check_ranks(ranks, deadline, folder, f"waiting for {path.name}")
        time.sleep(POLL_S)
    return path


def _wait_for_exit(ranks: list[subprocess.Popen], rank: int, deadline: float, folder: Path) -> None:
    while ranks[rank].poll() is None:
        _check_ranks(ranks, deadline, folder, f"waiting for rank {rank} to exit")
        time.sleep(POLL_S)


def _check_ranks(ranks: list[subprocess.Popen], deadline: float, folder: Path, what: str) -> None:
    """Fail, with every rank's log, when a rank exited with an error or the deadline passed."""
    failed = [r for r, proc in enumerate(ranks) if proc.poll() not in (None, 0)]
    if failed or time.monotonic() > deadline:
        reason = f"rank(s) {failed} failed" if failed else "deadline passed (a rank is blocked)"
        logs = "\n".join(f"--- rank {r} (exit {proc.poll()}) ---\n{_tail(folder / f'rank-{r}.log')}"
                         for r, proc in enumerate(ranks))
        raise AssertionError(f"{reason} while {what}\n{logs}")


def _tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else "(no log)"


def gather_ranks(per_rank: list[list[torch.Tensor]], heads_width: int) -> list[torch.Tensor]:
    """Per-rank ``(qkvg, g1, beta)`` -> the unsharded layout: q, k, v and g each concatenated over ranks (each rank
    holds ``heads_width`` columns of each), then g1 and beta concatenated over ranks."""
    qkvg = torch.cat([torch.cat([out[0][:, i * heads_width : (i + 1) * heads_width] for out in per_rank], -1)
                      for i in range(4)], -1)
    return [qkvg, torch.cat([out[1] for out in per_rank], -1), torch.cat([out[2] for out in per_rank], -1)]


def check_group(run: GroupRun, tp1: GroupRun) -> dict[str, Any]:
    """Assert what the issue asks of a group of ``run.world_size`` processes, against the one-process group ``tp1``:
    every rank was built as its rank of that group; every rank serves rank 0's stored plan although each stored its
    own; the plan crossed the engine's TP group once per geometry, at load; the per-rank outputs put together equal
    TP1's bit for bit at every parity M; the ranks that ran forwards (at different times, with the others gone)
    were not blocked and communicated nothing. Returns the facts for the parity report."""
    n = run.world_size
    names = checkpoints_for(n)
    compared = 0
    for name in names:
        geometry = CHECKPOINTS[name].with_tp(n)
        parts = [run.loaded[r]["checkpoints"][name] for r in range(n)]
        rank0_plan = parts[0]["stored_plan"]
        for rank, part in enumerate(parts):
            assert (part["tp_size"], part["local_heads"]) == (n, geometry.heads_local), (name, rank)
            served = part["serving_plan"]
            assert served == rank0_plan, f"{name} rank {rank} serves {served['plan']['source']!r}"
            assert rank == 0 or part["stored_plan"] != rank0_plan, f"{name} rank {rank} stored rank 0's plan"
        reference = tp1.loaded[0]["checkpoints"][name]["outputs"]
        for m in PARITY_MS:
            gathered = gather_ranks([part["outputs"][m] for part in parts], geometry.local_width)
            for out_name, a, b in zip(NAMES, gathered, reference[m], strict=True):
                what = f"{name} TP{n} M={m} {out_name}"
                assert a.shape == b.shape and not a.isnan().any(), what
                assert torch.equal(a, b), f"{what}: max diff {(a.float() - b.float()).abs().max()}"
                compared += 1
    broadcasts = {r: run.loaded[r]["broadcasts"] for r in range(n)}
    assert set(broadcasts.values()) == {len(names)}, f"plan broadcasts at load per rank: {broadcasts}"
    for rank, forwarded in run.forwarded.items():
        assert forwarded["forwards"] == 3 * len(names) and forwarded["equal"], (rank, forwarded)
        assert forwarded["broadcasts"] == broadcasts[rank], f"rank {rank} communicated in a forward: {forwarded}"
    return {
        "world_size": n, "checkpoints": list(names), "outputs_equal_to_tp1": compared,
        "plan": run.loaded[0]["checkpoints"][names[0]]["serving_plan"]["plan"]["source"], "ranks_with_rank0_plan": n,
        "broadcasts_at_load": len(names), "forwarded": list(run.forwarded),
        "never_forwarded": n - len(run.forwarded), "seconds": round(run.seconds, 1),
    }


def write_report(engine: str, facts: list[dict[str, Any]]) -> Path:
    """The engine's multi-process results for the parity report (tests/engines/test_cross_engine_parity.py)."""
    path = artifacts_dir() / f"{engine}-tp-processes.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({"engine": engine, "groups": facts}, indent=1))
    return path


# --- the rank programs -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RankArgs:
    rank: int
    world_size: int
    port: int
    checkpoints: Path
    folder: Path

    @property
    def init_method(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"


def parse_args() -> RankArgs:
    parser = argparse.ArgumentParser(description="one tensor-parallel rank (started by tp_processes.run_group)")
    for name, kind in (("rank", int), ("world-size", int), ("port", int), ("checkpoints", Path), ("folder", Path)):
        parser.add_argument(f"--{name}", type=kind, required=True)
    ns = parser.parse_args()
    return RankArgs(ns.rank, ns.world_size, ns.port, ns.checkpoints, ns.folder)


def plan_as_on_a_gpu() -> None:
    """Resolve plans as on a CUDA device named :data:`FAKE_GPU`, so each rank reads the plan stored in its own cache
    folder and shares it over the engine's group; the projection itself still runs on the CPU.

    On a CPU the core has no device key to look a stored plan up by and serves its CPU plan without sharing it. Only
    the device :func:`kda_backend.build_projection` plans for and the key it looks up are replaced; the engine's
    layer, the adapter's ``kda_share_plan`` and the group are the real ones.
    """
    from kda_backend import plan_store, planning, serving

    resolve = planning.resolve_plan

    def on_a_gpu(geometry, device, dtype, batch_sizes):
        return resolve(geometry, torch.device("cuda", 0), dtype, batch_sizes)

    serving.resolve_plan = on_a_gpu
    plan_store.device_key = lambda geometry, device, dtype: plan_store.plan_key(geometry, FAKE_GPU, (9, 0), dtype)


def stored_plan(geometry, rank: int):
    """The plan rank ``rank`` keeps in its cache folder for ``geometry``: rank 0 overlaps at every parity M and
    carries CuTe tactics for its QKVG GEMM; every other rank has a sequential plan of its own (another source, other
    M, no tactics), so sharing is visible on every rank."""
    from kda_backend.kernels.skinny_gemm import default_tactic
    from kda_backend.kernels.tactics import tactic_bucket
    from kda_backend.plan import SEQUENTIAL_TORCH, Plan, Step

    if rank == 0:
        n, k = geometry.qkvg_rows, geometry.hidden_size
        tactics = {("qkvg", n, k, tactic_bucket(m)): default_tactic(n, k, m) for m in (1, 16)}
        return Plan(steps={m: Step(overlap=True) for m in PARITY_MS}, source="stored on rank 0",
                    fallback=SEQUENTIAL_TORCH, tactics=tactics)
    return Plan(steps={m: SEQUENTIAL_TORCH for m in (1, 8, 16)}, source=f"stored on rank {rank}")


def store_plan(geometry, rank: int) -> dict[str, Any]:
    """Save :func:`stored_plan` under the key planning looks up for ``geometry`` (after :func:`plan_as_on_a_gpu`);
    returns the document of what this rank's folder now holds, read back."""
    from kda_backend import plan_store

    key = plan_store.device_key(geometry, torch.device("cuda", 0), torch.bfloat16)
    plan_store.save(key, stored_plan(geometry, rank))
    return plan_store.load(key).to_document()


def count_calls(obj: Any, method: str) -> list[int]:
    """Wrap ``obj.method`` (an instance attribute shadowing it) to count its calls; the one-element list counts."""
    calls = [0]
    real = getattr(obj, method)

    @functools.wraps(real)
    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    setattr(obj, method, counted)
    return calls


def loaded_checkpoint(outputs: dict[int, Any], stored: Any, projection: Any, tp_size: int, local_heads: int
                      ) -> dict[str, Any]:
    """One checkpoint's entry in a rank's load-time report: its outputs per M, the plan this rank stored, the plan
    its projection serves, and the engine's TP size and local heads."""
    return {"outputs": outputs, "stored_plan": stored, "serving_plan": projection.plan.to_document(),
            "tp_size": tp_size, "local_heads": local_heads}


def report_loaded(args: RankArgs, report: dict[str, Any], broadcasts: int, marks: tuple[float, float, float]) -> None:
    """Hand this rank's load-time report to the test process (written whole, then renamed), with the plan
    broadcasts so far and the seconds spent importing, forming the group and loading (``marks``: the monotonic
    times at start, after the imports and after the group)."""
    start, imported, grouped = marks
    report |= {"broadcasts": broadcasts, "seconds": {"import": imported - start, "group": grouped - imported,
                                                     "load": time.monotonic() - grouped}}
    path = args.folder / f"loaded-{args.rank}.pt"
    torch.save(report, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)


def forward_when_its_turn(args: RankArgs, forward: Callable[[], dict[str, Any]], timeout_s: float = 600) -> None:
    """Ranks in :func:`forward_order` wait for their turn, run ``forward`` and report what it returned; the others
    return at once (and exit) without ever running a forward."""
    if args.rank not in forward_order(args.world_size):
        return
    turn = args.folder / f"turn-{args.rank}"
    deadline = time.monotonic() + timeout_s
    while not turn.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank {args.rank}: no turn to forward within {timeout_s} s")
        time.sleep(POLL_S)
    path = args.folder / f"forwarded-{args.rank}.json"
    path.with_suffix(".tmp").write_text(json.dumps(forward()))
    os.replace(path.with_suffix(".tmp"), path)


def exit_at_once() -> None:
    """Exit with status 0 without finalizing the interpreter: the engines import thousands of modules, whose
    teardown costs about 3 s of CPU per rank; everything a rank reports is already written whole."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
