"""Tensor parallelism with one process per rank (CPU, gloo): 2, 4 and 8 ranks against one, in each engine installed
(the nox sessions `vllm` and `sglang` each have one).

Each rank is a process set up as the engine sets up its own: vLLM's worker (vllm_tp_rank.py: its distributed and
model-parallel init and plugin loading) or SGLang's scheduler (sglang_tp_rank.py: its plugin loading, published
server arguments with ``--attention-backend kda`` and the rank's placement, its parallel runtime); the layer is built
and loaded by the engine's own code with the real TP rank and world size. Every rank serves rank 0's stored plan,
shared at load through the adapter's ``kda_share_plan`` over the engine's TP group; the per-rank projections put
together equal the one-rank group's bit for bit; ranks that reach their first forward at different times, or never
(as SGLang's DP-attention ranks that skip self-attention), block no one. Writes
``.parity-artifacts/<engine>-tp-processes.json`` for the parity report.
"""

import importlib.util

import pytest

import tp_processes
from parity.checkpoint import CHECKPOINTS, make_checkpoint

# The program each rank runs, per engine.
PROGRAMS = {"vllm": "vllm_tp_rank", "sglang": "sglang_tp_rank"}
# The deadline of one group on a 2-core machine: each rank imports its engine (5-10 s of CPU), so 8 ranks take about
# a minute; a rank blocked on a collective holds the group until then.
TIMEOUT_S = {1: 120, 2: 180, 4: 300, 8: 480}
INSTALLED = [engine for engine in PROGRAMS if importlib.util.find_spec(engine) is not None]

pytestmark = pytest.mark.skipif(not INSTALLED, reason="needs vllm or sglang installed")


@pytest.fixture(scope="module", params=INSTALLED)
def engine(request):
    return request.param


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("checkpoints")
    for name, geometry in CHECKPOINTS.items():
        make_checkpoint(folder / f"{name}.safetensors", geometry)
    return folder


@pytest.fixture(scope="module")
def report(engine):
    """The facts of every group that passed, written for the parity report once the engine's groups are done."""
    facts = []
    yield facts
    tp_processes.write_report(engine, facts)


@pytest.fixture(scope="module")
def tp1(engine, checkpoints, tmp_path_factory):
    """The one-rank group, run the same way: the reference the larger groups must reproduce."""
    return tp_processes.run_group(PROGRAMS[engine], 1, checkpoints, tmp_path_factory.mktemp("tp1"), TIMEOUT_S[1])


@pytest.mark.parametrize("world_size", tp_processes.WORLD_SIZES, ids=lambda n: f"tp{n}")
def test_tensor_parallel_processes(engine, checkpoints, tp1, report, world_size, tmp_path):
    run = tp_processes.run_group(PROGRAMS[engine], world_size, checkpoints, tmp_path, TIMEOUT_S[world_size])
    report.append(tp_processes.check_group(run, tp1))
