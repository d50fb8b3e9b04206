"""vLLM tensor parallelism with one process per rank (CPU, gloo): 2, 4 and 8 ranks against one.

Each rank is a process set up as a vLLM worker sets itself up (vllm_tp_rank.py): vLLM's distributed and
model-parallel init, vLLM's plugin loading, the layer built and loaded by vLLM's own code with the real TP rank
and world size. Every rank serves rank 0's stored plan, shared at load through the adapter's ``kda_share_plan``
over vLLM's TP group; the per-rank projections put together equal the one-rank group's bit for bit; ranks that
reach their first forward at different times, or never, block no one. Runs in the nox session `vllm`; writes
``.parity-artifacts/vllm-tp-processes.json`` for the parity report.
"""

import pytest

pytest.importorskip("vllm")

import tp_processes  # noqa: E402
from parity.checkpoint import CHECKPOINTS, make_checkpoint  # noqa: E402

ENGINE, PROGRAM = "vllm", "vllm_tp_rank"
# The deadline of one group on a 2-core machine: each rank imports vLLM (about 10 s of CPU), so 8 ranks take about
# a minute; a rank blocked on a collective holds the group until then.
TIMEOUT_S = {1: 120, 2: 180, 4: 300, 8: 480}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    for name, geometry in CHECKPOINTS.items():
        make_checkpoint(folder / f"{name}.safetensors", geometry)
    return folder


@pytest.fixture(scope="module")
def report():
    """The facts of every group that passed, written for the parity report once the module is done."""
    facts = []
    yield facts
    tp_processes.write_report(ENGINE, facts)


@pytest.fixture(scope="module")
def tp1(checkpoints, tmp_path_factory):
    """The one-rank group, run the same way: the reference the larger groups must reproduce."""
    return tp_processes.run_group(PROGRAM, 1, checkpoints, tmp_path_factory.mktemp("tp1"), TIMEOUT_S[1])


@pytest.mark.parametrize("world_size", tp_processes.WORLD_SIZES, ids=lambda n: f"tp{n}")
def test_tensor_parallel_processes(checkpoints, tp1, report, world_size, tmp_path):
    run = tp_processes.run_group(PROGRAM, world_size, checkpoints, tmp_path, TIMEOUT_S[world_size])
    report.append(tp_processes.check_group(run, tp1))
