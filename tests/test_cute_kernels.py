"""CuTe DSL skinny GEMM: tactics, provider selection and compilation for every target architecture on the CPU."""

import collections
import dataclasses
import errno
import importlib
import inspect
import json
import os
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from kda_backend.geometry import preset, valid_tp_sizes
from kda_backend.kernels.compile_cache import KernelKey, SideChainKey, StageKey, compile_gemm, target_arch
from kda_backend.kernels.side_chain_gemm import why_not_one_launch, why_not_one_launch_stage
from kda_backend.kernels.skinny_gemm import (
    Link,
    Tactic,
    block_t_for,
    candidate_tactics,
    default_tactic,
    output_tiles,
    validate_link,
    validate_tactic,
)
from kda_backend.kernels.tactics import tactic_bucket
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.plan import Plan
from kda_backend.providers.base import GemmCall
from kda_backend.providers.cute_provider import CuteDslProvider

ARCHS = ["sm_90a", "sm_100a"]


def _roles(tp, row_multiple=16):
    """``role -> (N, K, x row stride)`` of Kimi-K3 at ``tp``, F_A/beta padded to ``row_multiple`` rows (16: vLLM's
    packed layout, 8: SGLang's, which leaves N % 16 == 8 at TP4 and TP16)."""
    g = dataclasses.replace(preset("kimi-k3", tp), row_multiple=row_multiple)
    return {
        "qkvg": (g.qkvg_rows, g.hidden_size, g.hidden_size),
        "fab": (g.fab_rows, g.hidden_size, g.hidden_size),
        "fb": (g.local_width, g.head_dim, g.fab_rows),
    }


@pytest.mark.parametrize("row_multiple", [16, 8], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("tp", valid_tp_sizes(96), ids=lambda t: f"tp{t}")
@pytest.mark.parametrize("m", [1, 16, 17, 64])
def test_default_tactic_valid_for_every_role(tp, m, row_multiple):
    for role, (n, k, xs) in _roles(tp, row_multiple).items():
        tactic = default_tactic(n, k, m)
        assert validate_tactic(tactic, n, k, xs) is None, (role, tactic)
        assert tactic.block_t >= min(m, 64)


def test_block_t_buckets():
    assert [block_t_for(m) for m in (1, 16, 17, 32, 33, 64, 65)] == [16, 16, 32, 32, 64, 64, 64]
    assert [tactic_bucket(m) for m in (1, 2, 16, 17, 64)] == [1, 16, 16, 32, 64]


def test_bulk_activations_are_a_single_token_candidate():
    """Bulk copies cost one copy per token row and K-tile: tuned for M = 1 only, one path of three exclusive ones."""
    n, k = 6144, 7168
    assert any(c.x_bulk for c in candidate_tactics(n, k, 1, k))
    assert not any(c.x_bulk for m in (2, 16, 64) for c in candidate_tactics(n, k, m, k))
    bulk = Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True)
    assert bulk.key() == "n16k256t16s4pB" and bulk.with_activations_from_l2() == Tactic(16, 256, 16, 4, x_via_l1=False)
    # The ring's activation rows are padded by 16 bytes (no ldmatrix bank conflicts), plus one mbarrier per slot.
    assert bulk.smem_bytes() == Tactic(16, 256, 16, 4).smem_bytes() + 4 * 16 * 16 + 128
    for other in ({"x_via_l1": True}, {"x_tma": True}):
        assert "exclude each other" in validate_tactic(Tactic(x_bulk=True, **other), n, k, k)


@pytest.mark.parametrize(
    "tactic,n,k,xs,match",
    [
        (Tactic(block_n=16), 100, 7168, 7168, "N=100 must be a multiple of 8"),
        (Tactic(block_n=32), 6160, 7168, 7168, "block_n=32 must be a multiple of 16 dividing N=6160"),
        (Tactic(block_n=32), 136, 7168, 7168, "block_n=32 must be a multiple of 16 dividing N=136 rounded up"),
        (Tactic(block_n=24), 144, 7168, 7168, "block_n=24 must be a multiple of 16"),
        (Tactic(block_k=96), 6144, 7168, 7168, "block_k=96"),
        (Tactic(block_k=256), 6144, 7040, 7040, "dividing K=7040"),
        (Tactic(block_t=8), 6144, 7168, 7168, "block_t=8"),
        (Tactic(stages=1), 6144, 7168, 7168, "stages=1"),
        (Tactic(block_n=64, block_k=512, stages=6), 6144, 7168, 7168, "shared memory"),
        (Tactic(block_n=16, block_k=512), 6144, 7168, 7168, "cannot cover a row"),
        (Tactic(block_k=128), 1536, 128, 140, "x row stride 140"),
    ],
)
def test_validate_tactic_reasons(tactic, n, k, xs, match):
    reason = validate_tactic(tactic, n, k, xs)
    assert reason is not None and match in reason


def test_odd_row_tiles_split_tokens_between_warps():
    """Copy passes cover a power-of-two row count (whole rows of 8-row swizzle atoms) for every block_n."""
    assert Tactic(block_n=48).warp_grid == (1, 2) and Tactic(block_n=64).warp_grid == (4, 1)
    assert Tactic(block_n=16).warp_grid == (1, 1)
    for block_n in range(16, 257, 16):
        for block_k in (64, 128, 256, 512):
            tactic = Tactic(block_n=block_n, block_k=block_k)
            lanes = block_k // 8
            if tactic.threads >= lanes:
                rows_per_pass = tactic.threads // lanes
                assert block_n % rows_per_pass == 0 and (8 % rows_per_pass == 0 or rows_per_pass % 8 == 0)


def test_candidates_are_valid_and_include_default():
    n, k = 6144, 7168
    cands = candidate_tactics(n, k, 4, k)
    assert cands and all(validate_tactic(c, n, k, k) is None for c in cands)
    assert default_tactic(n, k, 4) in cands


def test_no_candidate_ring_is_deeper_than_its_k_tiles():
    """F_B (K = 128: one 128-element K-tile) is timed with 2-slot rings only; wider K keeps its deeper rings."""
    for tp in (4, 8, 16):
        for n, k, xs in _roles(tp).values():
            for m in (1, 16, 64):
                cands = candidate_tactics(n, k, m, xs)
                assert cands and all(c.stages <= max(2, k // c.block_k // c.split_k) for c in cands)
        fb_n, fb_k, fb_xs = _roles(tp)["fb"]
        assert {c.stages for c in candidate_tactics(fb_n, fb_k, 64, fb_xs)} == {2}
    assert {c.stages for c in candidate_tactics(6144, 7168, 16, 7168)} == {2, 3, 4, 6}


def test_partial_row_block_runs_n_as_rounded_up_to_16_rows():
    """N % 16 == 8 (SGLang's F_A/beta: 152 rows at TP4, 136 at TP16) has the tactics, tiles and CTAs of 8 rows more,
    the last row block partial; for N % 16 == 0 every candidate's row blocks still divide N."""
    from kda_backend.kernels.occupancy import SmBudget, spare_slot_tactics

    k = 7168
    for n in (136, 152):
        padded = n + 8
        assert default_tactic(n, k, 16) == default_tactic(padded, k, 16)
        for m in (1, 16, 40):
            assert candidate_tactics(n, k, m, k) == candidate_tactics(padded, k, m, k)
        assert output_tiles(Tactic(block_n=16, block_t=16), n, 17) == padded // 16 * 2
        qkvg = Tactic(16, 256, 16, 4)
        h200 = SmBudget(sms=132, smem_per_sm=233472)
        spare = spare_slot_tactics(n, k, 16, k, qkvg, output_tiles(qkvg, 6144, 16), h200)
        assert spare and spare == spare_slot_tactics(padded, k, 16, k, qkvg, output_tiles(qkvg, 6144, 16), h200)
    assert validate_tactic(Tactic(48, 128, 16, 4, split_k=4), 136, k, k) is None  # rows 48 + 48 + 40
    for tp in (1, 2, 4, 8, 16):
        for n, k_role, xs in _roles(tp).values():
            assert all(n % c.block_n == 0 for m in (1, 16) for c in candidate_tactics(n, k_role, m, xs))


def _call(**kw):
    base = dict(role="qkvg", m=4, n=6144, k=7168, dtype=torch.bfloat16, device_type="cuda", capability=(9, 0),
                x_row_stride=7168, w_row_stride=7168)
    base.update(kw)
    return GemmCall(**base)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(device_type="cpu", capability=None), "needs a CUDA device"),
        (dict(capability=(8, 0)), "compute capability (8, 0)"),
        (dict(capability=(12, 0)), "compute capability (12, 0)"),
        (dict(dtype=torch.float16), "not bfloat16"),
        (dict(m=65, capability=(10, 0)), "M > 64"),  # the wgmma kernel serves Hopper only
        (dict(m=257), "M > 256"),
        (dict(role="fab", n=144, m=65), "M > 64"),  # and QKVG only
        (dict(role="fb", n=1536, k=128, x_row_stride=144, m=65), "M > 64 without a tuned tactic"),
        (dict(role="fb", n=1536, k=128, x_row_stride=144, m=257, tuned=Tactic()), "M > 256"),
        (dict(role="fab", n=144, m=32, tuned=WgmmaTactic()), "the wgmma kernel serves qkvg"),
        (dict(n=100), "N=100"),
        (dict(role="fb", n=1536, k=128, x_row_stride=140), "x row stride 140"),
    ],
)
def test_provider_rejections_name_reason(kw, match):
    reason = CuteDslProvider().why_not(_call(**kw))
    assert reason is not None and match in reason


@pytest.mark.parametrize("capability", [(9, 0), (10, 0), (10, 3)])
def test_provider_accepts_hopper_and_blackwell(capability):
    assert CuteDslProvider().why_not(_call(capability=capability)) is None


@pytest.mark.parametrize("row_multiple", [16, 8], ids=lambda r: f"rows{r}")
@pytest.mark.parametrize("tp", [1, 2, 4, 8, 16], ids=lambda t: f"tp{t}")
def test_provider_serves_every_role_at_every_tp(tp, row_multiple):
    """Each GEMM alone and the trailing side chain, with F_A/beta padded as vLLM (16 rows) and SGLang (8 rows: 152
    at TP4, 136 at TP16) pad it."""
    p = CuteDslProvider()
    calls = _stage_calls(tp, row_multiple)
    for call in calls.values():
        assert p.why_not(call) is None, call
    assert p.why_not_trailing(calls) is None


def test_provider_uses_the_plans_tactic():
    p = CuteDslProvider()
    tuned = Tactic(block_n=32, block_k=128, block_t=16, stages=6)
    plan = Plan(tactics={("qkvg", 6144, 7168, 16): tuned})

    def call(m):
        return _call(m=m, tuned=plan.tactic_for("qkvg", 6144, 7168, m))

    assert p.tactic(call(3)) == tuned
    assert p.tactic(call(1)) == tuned  # no single-token tactic: the 16-token bucket's
    assert p.tactic(call(20)) == default_tactic(6144, 7168, 20)
    single = Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True)
    plan = Plan(tactics={**plan.tactics, ("qkvg", 6144, 7168, 1): single})
    assert p.tactic(call(1)) == single and p.tactic(call(2)) == tuned


def test_target_arch_needs_device_or_env(monkeypatch):
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    with pytest.raises(ValueError, match="set CUTE_DSL_ARCH"):
        target_arch(torch.device("cpu"))
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_100a")
    assert target_arch(None) == "sm_100a"


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("role", ["qkvg", "fab", "fb"])
@pytest.mark.parametrize("m", [1, 32, 64], ids=lambda m: f"M{m}")
def test_kernel_compiles_on_cpu(arch, role, m):
    n, k, xs = _roles(8)[role]
    assert compile_gemm(KernelKey(default_tactic(n, k, m), n, k, xs, k, arch)) is not None


@pytest.mark.parametrize("tp", [1, 16], ids=lambda t: f"tp{t}")
def test_kernel_compiles_for_other_tp_sizes(tp):
    for n, k, xs in _roles(tp).values():
        assert compile_gemm(KernelKey(default_tactic(n, k, 4), n, k, xs, k, "sm_90a")) is not None


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("role", ["qkvg", "fab", "fb"])
def test_tma_and_wide_tactics_compile_on_cpu(arch, role):
    """The activation paths by TMA and by bulk copies (incl. split-K and F_B's strided input; 64-token tiles, two
    rows per lane) and 48-row CTAs (two warps per token tile) build for every architecture."""
    n, k, xs = _roles(8)[role]
    split = 14 if role == "fab" else 1
    tactics = [Tactic(16, 128, 16, 2, x_via_l1=False, x_tma=True, split_k=split),
               Tactic(16, 128, 16, 3, x_via_l1=False, x_bulk=True, split_k=split)]
    if role == "qkvg":
        tactics += [Tactic(48, 256, 16, 5), Tactic(48, 256, 64, 3, x_via_l1=False, x_tma=True),
                    Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True),
                    Tactic(48, 256, 64, 3, x_via_l1=False, x_bulk=True)]
    for tactic in tactics:
        assert validate_tactic(tactic, n, k, xs) is None
        assert compile_gemm(KernelKey(tactic, n, k, xs, k, arch)) is not None


def _signature(key: KernelKey, folder) -> str:
    """The TVM-FFI signature of ``key``'s kernel, as its arity error names it (exported and loaded: a function
    to call even where the DSL builds no execution engine, on a machine without a GPU)."""
    from kda_backend.kernels import compile_cache

    path = folder / "kernel.o"
    compile_cache.export(compile_gemm(key), path, "kernel")
    with pytest.raises(TypeError, match="Expects 7 parameters") as error:
        compile_cache.load_exported(path, "kernel")()
    return str(error.value)


ROLE_OPERANDS = {  # (role, tactic, link) -> what the kernel takes after x, w and out
    ("fb", Tactic(16, 128, 16, 2), Link()): "m_work: None, m_arrivals: None, m_chain: None, expected: None",
    ("fab", Tactic(16, 128, 16, 3, split_k=14), Link()):
        "m_work: Tensor([14, n0, 144], float32), m_arrivals: Tensor([n1], int32), m_chain: None, expected: None",
    ("fab", Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14), Link(signals=True, x_ready=True)):
        "m_work: Tensor([14, n0, 144], float32), m_arrivals: Tensor([n1], int32), m_chain: Tensor([3], int32), "
        "expected: None",
    ("fab", Tactic(16, 256, 16, 4, x_via_l1=False), Link(signals=True, x_ready=True)):
        "m_work: None, m_arrivals: None, m_chain: Tensor([3], int32), expected: None",
    ("fb", Tactic(16, 128, 16, 2, x_via_l1=False), Link(waits=True)):
        "m_work: None, m_arrivals: None, m_chain: Tensor([3], int32), expected: int32",
}


@pytest.mark.parametrize("role, tactic, link", ROLE_OPERANDS, ids=lambda v: v.key() if isinstance(v, Tactic) else None)
def test_one_entry_point_takes_the_operands_of_its_roles(role, tactic, link, tmp_path):
    """Every kernel has the one entry point ``(x, w, out, work, arrivals, chain, expected)``: x, w and out as torch
    holds them, and ``None`` (a constant) in each slot its tactic and link give it no role for."""
    n, k, xs = _roles(8)[role]
    signature = _signature(KernelKey(tactic, n, k, xs, k, "sm_90a", link), tmp_path)
    assert f"m_x: Tensor([n0, {k}], bfloat16), m_w: Tensor([{n}, {k}], bfloat16), m_out: Tensor([n0, {n}], bfloat16), " \
           f"{ROLE_OPERANDS[role, tactic, link]})" in signature


def test_entry_point_refuses_a_missing_role_operand_at_compile():
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    from kda_backend.kernels.skinny_gemm import SkinnyGemm

    n, k, xs = _roles(8)["fab"]
    gemm = SkinnyGemm(Tactic(16, 128, 16, 3, split_k=14), n, k, xs, k)
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, k), (xs, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (n, k), (k, 1), assumed_align=16)
    out = make_fake_tensor(cutlass.BFloat16, (m, n), (n, 1), assumed_align=16)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    with pytest.raises(ValueError, match="m_work, m_arrivals required by tactic n16k128t16s3x14pL"):
        cute.compile(gemm, x, w, out, None, None, None, None, stream,
                     options="--enable-tvm-ffi --gpu-arch sm_90a")


def test_tma_excludes_l1_path():
    assert "exclude each other" in validate_tactic(Tactic(x_via_l1=True, x_tma=True), 6144, 7168, 7168)


def _compile_and_dump(key: KernelKey, dump_dir, keep: str = "ptx") -> str:
    """Compile ``key`` in a fresh process with the DSL keeping ``keep`` artifacts in ``dump_dir``; its PTX text."""
    code = (
        "from kda_backend.kernels.compile_cache import KernelKey, SideChainKey, StageKey, compile_gemm\n"
        "from kda_backend.kernels.skinny_gemm import Link, Tactic\n"
        "from kda_backend.kernels.wgmma_gemm import WgmmaTactic\n"
        f"compile_gemm({key!r})\n"
    )
    env = dict(os.environ, CUTE_DSL_KEEP=keep, CUTE_DSL_DUMP_DIR=str(dump_dir))
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    ptx = list(dump_dir.glob("*.ptx"))
    assert ptx, list(dump_dir.iterdir())
    return ptx[0].read_text()


@pytest.mark.parametrize("tactic", [WgmmaTactic(64, 64, 32, 12), WgmmaTactic(64, 64, 64, 6, split_k=2)],
                         ids=lambda t: t.key())
def test_wgmma_kernel_releases_the_next_launch_only_after_its_wait_for_x(tactic, tmp_path):
    """A CTA's first ``griddepcontrol.launch_dependents`` is the one that counts (PTX ISA), and a side chain
    launched behind QKVG with ``x_ready`` loads x without waiting: the wgmma kernel releases the next launch once,
    after its wait for the kernel that wrote x."""
    text = _compile_and_dump(KernelKey(tactic, 6144, 7168, 7168, 7168, "sm_90a"), tmp_path)
    assert text.count("griddepcontrol.launch_dependents") == 1 and text.count("griddepcontrol.wait") == 1
    assert text.index("griddepcontrol.wait") < text.index("griddepcontrol.launch_dependents")


@pytest.mark.parametrize("arch", ARCHS)
def test_ptx_targets_requested_architecture(arch, tmp_path):
    text = _compile_and_dump(KernelKey(default_tactic(1536, 128, 1), 1536, 128, 144, 128, arch), tmp_path, "ptx,ir")
    assert f".target {arch}" in text
    assert "mma.sync.aligned.m16n8k16" in text and "cp.async" in text and "griddepcontrol.wait" in text
    host_ir = "".join(p.read_text() for p in tmp_path.glob("*.mlir"))
    assert "cuda.launch_cfg.shared_mem_carveout" in host_ir and "%c100_i32" in host_ir  # SMEM_CARVEOUT_PERCENT


@pytest.mark.parametrize("arch", ARCHS)
def test_bulk_activations_are_one_bulk_copy_per_row(arch, tmp_path):
    """x_bulk loads each K-tile's token rows with non-tensor bulk copies completed on the slot's mbarrier (whose
    expected bytes are set first), and never with a per-thread cp.async or a tensor map."""
    n, k, xs = _roles(8)["qkvg"]
    tactic = Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True)
    text = _compile_and_dump(KernelKey(tactic, n, k, xs, k, arch), tmp_path)
    bulk = text.index("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes")
    assert text.index("mbarrier.arrive.expect_tx") < bulk
    assert "cp.async.bulk.tensor" not in text and "cp.async.cg.shared.global" in text  # weights keep cp.async


ACTIVATION_PATHS = {
    "cp.async L2": {"x_via_l1": False},
    "cp.async L1": {"x_via_l1": True},
    "bulk": {"x_via_l1": False, "x_bulk": True},
    "TMA": {"x_via_l1": False, "x_tma": True},
}


def _copies_by_policy(ptx: str) -> collections.Counter:
    """``(instruction, L2 priority of the policy register it carries or None)`` -> count, for every load into
    shared memory (cp.async, bulk and TMA copies)."""
    priority = {reg: p for p, reg in re.findall(r"createpolicy\.fractional\.L2::(\w+)\.b64 (%rd\d+)", ptx)}
    copies = collections.Counter()
    for line in ptx.splitlines():
        words = line.split()
        if words and words[0].startswith("cp.async.") and not words[0].startswith(("cp.async.commit", "cp.async.wait")):
            held = [priority[reg] for reg in re.findall(r"%rd\d+", line) if reg in priority]
            copies[words[0], held[0] if len(held) == 1 else None] += 1
    return copies


@pytest.mark.parametrize("path", ACTIVATION_PATHS)
@pytest.mark.parametrize("arch", ARCHS)
def test_loads_carry_their_l2_policies(arch, path, tmp_path):
    """Every weight cp.async carries the kernel's evict-first L2 policy and every activation load, whichever path,
    its evict-last policy (see kda_backend/kernels/l2_cache_policy.py)."""
    n, k, xs = _roles(8)["qkvg"]
    tactic = Tactic(48, 256, 16, 4, **ACTIVATION_PATHS[path])
    ptx = _compile_and_dump(KernelKey(tactic, n, k, xs, k, arch), tmp_path)
    assert ptx.count("createpolicy.fractional.L2::evict_first.b64") == 1
    assert ptx.count("createpolicy.fractional.L2::evict_last.b64") == 1
    copies = _copies_by_policy(ptx)
    weights = copies.pop(("cp.async.cg.shared.global.L2::cache_hint", "evict_first"))
    assert weights == 48 * 256 // 8 // tactic.threads * tactic.stages  # stages - 1 in the prologue, 1 in the loop
    assert copies and all(priority == "evict_last" and "L2::cache_hint" in op for op, priority in copies), copies


def test_skinny_n_is_split_along_k():
    for tp in (1, 2, 4, 8, 16):
        n, k, _ = _roles(tp)["fab"]
        tactic = default_tactic(n, k, 1)
        assert tactic.split_k > 1 and (n // tactic.block_n) * tactic.split_k <= 128
    assert default_tactic(6144, 7168, 1).split_k == 1


def test_tactics_are_chosen_by_their_worst_slowdown_over_the_bucket():
    from kda_backend.autotune import most_robust

    low_m, even, first = Tactic(16, 256, 16, 4, x_via_l1=False), Tactic(16, 256, 16, 4), Tactic(16, 128, 16, 4)
    # Sums: 65.6 for low_m, 65.7 for even; but low_m is 3.1 % slower at the last M, even at most 1.9 % anywhere.
    times = {low_m: [21.0, 21.6, 23.0], even: [21.4, 22.0, 22.3], first: [22.0, 22.5, 23.5]}
    assert sum(times[low_m]) < sum(times[even])
    assert most_robust(times) == even
    assert most_robust({first: [1.0, 2.0], even: [1.0, 2.0]}) == first  # a tie keeps the first listed


def test_side_chain_is_retuned_in_the_stage_among_neighbours():
    """The autotuner's in-stage pass for F_A/beta and F_B tries the tactic that won alone first, then the same tile
    shape with one stage more or fewer or the other activation path, e.g. split-K F_A/beta with 3 stages."""
    from kda_backend.autotune import _neighbours

    g = preset("kimi-k3", 8)
    for n, k, xs in ((g.fab_rows, g.hidden_size, g.hidden_size), (g.local_width, g.head_dim, g.fab_rows)):
        alone = default_tactic(n, k, 16)
        near = _neighbours(alone, candidate_tactics(n, k, 16, xs))
        assert near[0] == alone and len(set(near)) == len(near) > 1
        for t in near[1:]:
            assert (t.block_n, t.block_k, t.split_k) == (alone.block_n, alone.block_k, alone.split_k)
            assert abs(t.stages - alone.stages) <= 1
    two_stages = dataclasses.replace(default_tactic(g.fab_rows, g.hidden_size, 16), stages=2)
    near = _neighbours(two_stages, candidate_tactics(g.fab_rows, g.hidden_size, 16, g.hidden_size))
    for via_l1 in (True, False):
        assert dataclasses.replace(two_stages, stages=3, x_via_l1=via_l1) in near


@pytest.mark.parametrize("arch", ARCHS)
def test_split_k_kernel_reduces_in_kernel(arch, tmp_path):
    """The split-K kernel publishes partials, counts CTAs in with a device-scope atomic and the last one reads the
    partials back from L2 (never a possibly stale L1 line) and resets the counter."""
    n, k, xs = _roles(8)["fab"]
    tactic = Tactic(block_n=16, block_k=128, block_t=16, stages=2, split_k=14)
    assert validate_tactic(tactic, n, k, xs) is None
    text = _compile_and_dump(KernelKey(tactic, n, k, xs, k, arch), tmp_path)
    publish = text.index("fence.acq_rel.gpu")
    arrive = text.index("atom.global.acq_rel.add")
    read_back = text.index("ld.global.cg")
    reset = text.index("], 0;", read_back)  # st.global of a literal 0 into the arrival counter
    assert publish < arrive < read_back < reset
    assert text.count("ld.global.cg") == tactic.split_k * 8  # every split's partial, 8 accumulators per thread


def _small_key():
    n, k, xs = _roles(8)["fb"]
    return KernelKey(default_tactic(n, k, 1), n, k, xs, k, "sm_90a")


@pytest.fixture
def kernel_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    return tmp_path / "kernels"


def test_compiled_kernel_is_reused_from_disk(kernel_cache, monkeypatch):
    from kda_backend.kernels import compile_cache

    key = _small_key()
    assert compile_cache.CompiledGemms().get(key, kernel_cache) is not None
    files = list(kernel_cache.rglob("*.o"))
    assert [f.relative_to(kernel_cache) for f in files] == [
        Path(compile_cache.CODE_VERSION, f"kda_gemm_{compile_cache.fingerprint(key)}.o")]

    def no_compiler(key):
        raise AssertionError("a kernel on disk must not be compiled again")

    monkeypatch.setattr(compile_cache, "compile_gemm", no_compiler)
    fresh = compile_cache.CompiledGemms()  # as in a new process
    assert callable(fresh.get(key, kernel_cache)) and fresh.get(key) is fresh.get(key, kernel_cache)


def test_compiled_kernels_on_disk_are_readable_by_every_user(kernel_cache):
    """A cache a warm-up job (another user) filled serves the serving user: files are 0644, not mkstemp's 0600."""
    from kda_backend.kernels import compile_cache

    compile_cache.CompiledGemms().get(_small_key(), kernel_cache)
    assert [stat.S_IMODE(f.stat().st_mode) for f in kernel_cache.rglob("*.o")] == [0o644]


def test_kernel_cache_folder_that_cannot_be_searched_compiles_instead(kernel_cache, monkeypatch, kda_log):
    """A folder this process may not search (``Path.exists`` raises) costs a compile and one warning each way, not
    the CuTe provider."""
    from kda_backend.kernels import compile_cache

    exists = Path.exists

    def refused(path, *args, **kwargs):
        if kernel_cache in path.parents:
            raise PermissionError(13, "Permission denied", str(path))
        return exists(path, *args, **kwargs)

    monkeypatch.setattr(Path, "exists", refused)
    assert compile_cache.CompiledGemms().get(_small_key(), kernel_cache) is not None
    messages = kda_log.messages()
    assert len(messages) == 2 and messages[0].startswith("ignoring unreadable compiled kernel")
    assert messages[1].startswith(f"cannot write compiled kernels to {kernel_cache}: [Errno 13] Permission denied")


def test_kernel_cache_without_folder_is_memory_only_until_given_one(kernel_cache):
    """No folder: nothing on disk. A kernel compiled so is stored once a folder is given, and loads from there."""
    from kda_backend.kernels import compile_cache

    key = _small_key()
    cache = compile_cache.CompiledGemms()
    kernel = cache.get(key)
    assert kernel is not None and not kernel_cache.exists()
    assert cache.get(key, kernel_cache) is kernel
    path = kernel_cache / compile_cache.CODE_VERSION / f"kda_gemm_{compile_cache.fingerprint(key)}.o"
    assert path.stat().st_size > 1000 and compile_cache.load_exported(path, path.stem) is not None


def test_provider_keeps_kernels_in_the_cache_folder_it_is_given(tmp_path, monkeypatch):
    """The built-in CuTe provider asks the plugin manager's cache folder (``KDA_BACKEND_CACHE_DIR`` first) when it
    needs one; a provider built alone keeps kernels in memory."""
    from kda_backend import dispatch

    assert CuteDslProvider().kernel_folder() is None
    assert CuteDslProvider(lambda: tmp_path).kernel_folder() == tmp_path / "kernels"
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path / "env"))
    assert dispatch.provider_by_name("cute").kernel_folder() == tmp_path / "env" / "kernels"


def test_fingerprint_covers_key_and_toolchain(monkeypatch):
    """The key and the code this process imported name a binary: a toolchain (or source) changed on disk after the
    import does not rename what this process compiles, and it names what a new process compiles."""
    from kda_backend.kernels import compile_cache

    key = _small_key()
    first = compile_cache.fingerprint(key)
    assert compile_cache.fingerprint(key) == first
    assert compile_cache.fingerprint(dataclasses.replace(key, arch="sm_100a")) != first
    assert compile_cache.fingerprint(dataclasses.replace(key, tactic=Tactic(block_n=16, stages=3))) != first
    assert compile_cache._code_digest() == compile_cache.CODE_DIGEST
    monkeypatch.setattr(compile_cache.importlib.metadata, "version", lambda package: "0.0-other")
    assert compile_cache.fingerprint(key) == first and compile_cache._code_digest() != compile_cache.CODE_DIGEST


def test_fingerprint_covers_every_module_the_kernel_traces():
    """Every kernel module's own kda_backend.kernels imports (code or constants traced into the binary) are
    fingerprinted, and the names skinny_gemm's kernels use come from fingerprinted modules."""
    from kda_backend.kernels import compile_cache, skinny_gemm

    traced = {
        inspect.getsourcefile(sys.modules[value.__module__])
        for value in vars(skinny_gemm).values()
        if getattr(value, "__module__", "").startswith("kda_backend.kernels")
    }
    assert inspect.getsourcefile(skinny_gemm) in traced and len(traced) > 1
    assert traced <= set(compile_cache.KERNEL_SOURCES)
    imported = {
        inspect.getsourcefile(importlib.import_module(f"kda_backend.kernels.{name}"))
        for source in compile_cache.KERNEL_SOURCES
        for name in re.findall(r"^from kda_backend\.kernels\.(\w+) import", Path(source).read_text(), re.M)
    }
    assert imported and imported <= set(compile_cache.KERNEL_SOURCES)


def test_unreadable_kernel_file_is_recompiled_with_one_warning(kernel_cache, kda_log):
    from kda_backend.kernels import compile_cache

    key = _small_key()
    path = kernel_cache / compile_cache.CODE_VERSION / f"kda_gemm_{compile_cache.fingerprint(key)}.o"
    path.parent.mkdir(parents=True)
    path.write_bytes(b"\x7fELF truncated")
    assert compile_cache.CompiledGemms().get(key, kernel_cache) is not None
    assert sum("unreadable compiled kernel" in m for m in kda_log.messages()) == 1
    assert path.stat().st_size > 1000  # replaced by a good export
    assert compile_cache.load_exported(path, path.stem) is not None


def test_unwritable_kernel_cache_still_serves(kernel_cache, kda_log, monkeypatch):
    from kda_backend.kernels import compile_cache

    kernel_cache.parent.mkdir(parents=True, exist_ok=True)
    kernel_cache.write_text("a file where the folder should be")
    assert compile_cache.CompiledGemms().get(_small_key(), kernel_cache) is not None
    assert any("cannot write compiled kernels" in m for m in kda_log.messages())


def _aged(path: Path, days: float) -> Path:
    """``path`` last modified ``days`` ago."""
    when = time.time() - days * 86400
    os.utime(path, (when, when), follow_symlinks=False)
    return path


def _version_folder(parent: Path, name: str, days: float, files=("kda_gemm_a.o", ".tmp-b.o")) -> Path:
    folder = parent / name
    folder.mkdir(parents=True)
    for file in files:
        (folder / file).write_bytes(b"object")
    return _aged(folder, days)


def test_first_use_of_a_kernel_folder_removes_code_versions_unused_for_30_days(kernel_cache, kda_log):
    """A kernel folder keeps one folder per code version; a process's first use of it marks its own version used
    and removes other versions no process marked for 30 days, and object files outside any version folder as old.
    Versions used since, anything not named as ours and folders reached through links stay, without a word."""
    from kda_backend.kernels import compile_cache

    current = _version_folder(kernel_cache, compile_cache.CODE_VERSION, days=40, files=())
    unused = _version_folder(kernel_cache, "0123456789abcdef", days=31)
    recent = _version_folder(kernel_cache, "fedcba9876543210", days=29)
    other = _version_folder(kernel_cache, "backup", days=90)
    elsewhere = _version_folder(kernel_cache.parent / "elsewhere", "aaaaaaaaaaaaaaaa", days=90)
    link = kernel_cache / "bbbbbbbbbbbbbbbb"
    link.symlink_to(elsewhere)
    _aged(link, 90)
    loose_old, loose_new, notes = (kernel_cache / name for name in ("kda_gemm_0f.o", "kda_gemm_1f.o", "notes.txt"))
    for path, days in ((loose_old, 31), (loose_new, 0), (notes, 90)):
        path.write_bytes(b"o")
        _aged(path, days)

    cache = compile_cache.CompiledGemms()
    key = _small_key()
    assert cache.get(key, kernel_cache) is not None
    assert not unused.exists() and not loose_old.exists()
    kept = (recent / "kda_gemm_a.o", other / "kda_gemm_a.o", elsewhere / "kda_gemm_a.o", loose_new, notes)
    assert all(path.exists() for path in kept)
    assert (current / f"kda_gemm_{compile_cache.fingerprint(key)}.o").exists()
    assert kda_log.messages() == []

    _aged(recent, 31)
    cache.get(key, kernel_cache)  # once per folder and process
    assert recent.exists()
    compile_cache.CompiledGemms().get(key, kernel_cache)  # as in a new process
    assert not recent.exists() and current.exists()


def test_a_process_that_only_loads_kernels_marks_its_version_used(kernel_cache, monkeypatch):
    """A process whose kernels all load from the folder (writing nothing there) still marks its version used; a
    version folder it makes takes the kernel folder's permission bits (a group-writable cache stays so)."""
    from kda_backend.kernels import compile_cache

    kernel_cache.mkdir(parents=True)
    os.chmod(kernel_cache, 0o775)
    key = _small_key()
    compile_cache.CompiledGemms().get(key, kernel_cache)
    current = kernel_cache / compile_cache.CODE_VERSION
    assert stat.S_IMODE(current.stat().st_mode) == 0o775
    _aged(current, 40)
    monkeypatch.setattr(compile_cache, "compile_gemm", lambda key: pytest.fail("a kernel on disk was compiled"))
    compile_cache.CompiledGemms().get(key, kernel_cache)
    assert time.time() - current.stat().st_mtime < 60


def test_code_version_that_cannot_be_removed_warns_once_and_serves(kernel_cache, kda_log):
    """A version folder holding a file that is not ours loses its object files, stays, and warns once naming it."""
    from kda_backend.cache_files import remove_unused_versions

    folder = _version_folder(kernel_cache, "0123456789abcdef", days=31, files=("kda_gemm_a.o", "keep.txt"))
    _aged(folder, 31)
    for _ in range(2):
        remove_unused_versions(kernel_cache, "ffffffffffffffff", "[0-9a-f]{16}", ("kda_gemm_*.o",))
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]
    [message] = kda_log.messages()
    assert message.startswith("cannot remove files of code versions unused for 30 days: "
                              f"{folder}: [Errno {errno.ENOTEMPTY}]")
    assert message.endswith("; remove them by hand")


def test_code_version_removed_by_another_process_meanwhile_is_no_failure(kernel_cache, kda_log, monkeypatch):
    """Every rank of a serve starts at once: where another process removes an unused version between this one's age
    check and its removal, nothing is said."""
    import shutil

    from kda_backend import cache_files

    folder = _version_folder(kernel_cache, "0123456789abcdef", days=31)
    older = cache_files._older

    def removed_meanwhile(entry, cutoff):
        answer = older(entry, cutoff)
        shutil.rmtree(entry.path)
        return answer

    monkeypatch.setattr(cache_files, "_older", removed_meanwhile)
    cache_files.remove_unused_versions(kernel_cache, "ffffffffffffffff", "[0-9a-f]{16}", ("kda_gemm_*.o",))
    assert not folder.exists() and kda_log.messages() == []


@pytest.mark.parametrize("unwritable", ["kernel folder", "version folder"])
def test_folders_this_process_may_not_write_are_left_alone(unwritable, kernel_cache, kda_log, monkeypatch):
    """A cache another user filled, or another user's version folder in a shared one (neither writable here), loses
    nothing, and nothing is said (other processes of that user remove it)."""
    from kda_backend import cache_files

    folder = _version_folder(kernel_cache, "0123456789abcdef", days=31)
    refused = str(kernel_cache if unwritable == "kernel folder" else folder)
    access = os.access
    monkeypatch.setattr(cache_files.os, "access", lambda path, mode: str(path) != refused and access(path, mode))
    cache_files.remove_unused_versions(kernel_cache, "ffffffffffffffff", "[0-9a-f]{16}", ("kda_gemm_*.o",))
    assert (folder / "kda_gemm_a.o").exists() and kda_log.messages() == []


def test_code_version_stored_into_meanwhile_stays_without_a_word(kernel_cache, kda_log, monkeypatch):
    """A process of an unused version that stores a kernel into its folder while another removes it keeps the
    folder (in use again), and nothing is said."""
    from kda_backend import cache_files

    folder = _version_folder(kernel_cache, "0123456789abcdef", days=31)
    rmdir = Path.rmdir

    def stored_meanwhile(path):
        (path / "kda_gemm_new.o").write_bytes(b"o")
        return rmdir(path)

    monkeypatch.setattr(Path, "rmdir", stored_meanwhile)
    cache_files.remove_unused_versions(kernel_cache, "ffffffffffffffff", "[0-9a-f]{16}", ("kda_gemm_*.o", ".tmp-*"))
    assert [p.name for p in folder.iterdir()] == ["kda_gemm_new.o"] and kda_log.messages() == []


def _stage_calls(tp=8, row_multiple=16):
    return {role: _call(role=role, n=n, k=k, x_row_stride=xs, w_row_stride=k)
            for role, (n, k, xs) in _roles(tp, row_multiple).items()}


def _waiting_fb_key(tp, arch, row_multiple=16):
    """F_B behind the signaling F_A/beta on one stream, reading f_a at F_A/beta's row stride."""
    n, k, xs = _roles(tp, row_multiple)["fb"]
    return KernelKey(default_tactic(n, k, 4).with_activations_from_l2(), n, k, xs, k, arch, Link(waits=True))


@pytest.mark.parametrize(
    "link, tactic, match",
    [
        (Link(signals=True, waits=True), Tactic(16, 256, 16, 4, x_via_l1=False), "either waits or signals"),
        (Link(waits=True, x_ready=True), Tactic(16, 128, 16, 2, x_via_l1=False), "not a waiting one"),
        (Link(waits=True), Tactic(16, 128, 16, 3, x_via_l1=False, split_k=2), "cannot split K"),
        (Link(waits=True), Tactic(16, 128, 16, 2, x_via_l1=True), "loads x from L2 only"),
        (Link(waits=True), Tactic(16, 128, 16, 2, x_via_l1=False, x_tma=True), "loads x from L2 only"),
        (Link(waits=True), Tactic(16, 128, 16, 2, x_via_l1=False, x_bulk=True), "loads x from L2 only"),
        (Link(signals=True, x_ready=True), Tactic(16, 128, 16, 3, split_k=14), "x_via_l1 is not allowed"),
    ],
)
def test_validate_link_reasons(link, tactic, match):
    assert match in validate_link(link, tactic)


def test_trailing_tactics_are_the_side_chains_with_activations_from_l2():
    """The trailing side chain computes what the forked one does, bit for bit: the same tactics, only the
    activation path differs (which changes where loads come from, not the arithmetic)."""
    p = CuteDslProvider()
    fab_tuned, fb_tuned = Tactic(16, 128, 16, 3, split_k=14), Tactic(16, 128, 16, 2, x_via_l1=False, x_tma=True)

    def tuned_calls(tuned):
        return {role: dataclasses.replace(call, tuned=tuned.get(role)) for role, call in _stage_calls().items()}

    calls = tuned_calls({"fab": fab_tuned, "fb": fb_tuned})
    fab, fb = p.trailing_tactics(calls)
    assert fab == dataclasses.replace(fab_tuned, x_via_l1=False) and fb == dataclasses.replace(fb_tuned, x_tma=False)
    assert p.why_not_trailing(calls) is None
    split_fb = Tactic(16, 64, 16, 2, split_k=2)  # F_B's K is 128
    assert "cannot split K" in p.why_not_trailing(tuned_calls({"fab": fab_tuned, "fb": split_fb}))
    assert p.why_not_trailing(calls | {"qkvg": _call(capability=(8, 0))}).startswith("qkvg: compute")


@pytest.mark.parametrize("arch", ARCHS)
def test_trailing_side_chain_kernels_order_their_signal_and_wait(arch, tmp_path):
    """F_A/beta behind QKVG releases the next launch at once, never waits for QKVG before loading x, counts each
    reduced tile in after storing and fencing it, and waits for QKVG to complete only at its end. F_B behind it
    releases the next kernel first, then polls the count (relaxed loads: an acquire load per poll would invalidate
    the L1 that QKVG's CTAs beside it share), fences once, loads f_a, counts itself out, and only then waits for
    F_A/beta to complete."""
    n, k, xs = _roles(8)["fab"]
    key = KernelKey(Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14), n, k, xs, k, arch,
                    Link(signals=True, x_ready=True))
    (tmp_path / "signaling").mkdir()
    (tmp_path / "waiting").mkdir()
    text = _compile_and_dump(key, tmp_path / "signaling")
    release = text.index("griddepcontrol.launch_dependents")
    reduce = text.index("atom.global.acq_rel.add")  # the split-K arrival
    signal = text.index("atom.global.release.add")
    final_wait = text.index("griddepcontrol.wait")
    assert release < reduce < signal < final_wait
    assert text.rindex("fence.acq_rel.gpu", 0, signal) > reduce and text.count("griddepcontrol.wait") == 1
    waiting = _compile_and_dump(_waiting_fb_key(8, arch), tmp_path / "waiting")
    release = waiting.index("griddepcontrol.launch_dependents")
    poll = waiting.index("ld.relaxed.gpu.global")
    fence = waiting.index("fence.acq_rel.gpu", poll)
    count_out = waiting.index("atom.global.add", fence)
    final_wait = waiting.index("griddepcontrol.wait")
    assert release < poll < fence < count_out < final_wait
    assert "cp.async" in waiting[fence:count_out] and "ld.acquire" not in waiting


def test_side_chain_runs_as_one_launch_where_its_tactics_allow():
    """F_A/beta and F_B trail QKVG as one launch where their tactics run one thread count, both launch
    programmatically and load activations by cp.async; the defaults and the tuned H200 tactics at M <= 16 do."""
    fab, fb = Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14), Tactic(16, 128, 16, 2, x_via_l1=False)
    assert why_not_one_launch(fab, fb) is None
    assert "runs 64 threads" in why_not_one_launch(Tactic(48, 128, 16, 4, x_via_l1=False, split_k=4), fb)
    assert "programmatic launch" in why_not_one_launch(dataclasses.replace(fab, pdl=False), fb)
    assert "cp.async only" in why_not_one_launch(dataclasses.replace(fab, x_tma=True), fb)
    assert "loads x from L2 only" in why_not_one_launch(fab, dataclasses.replace(fb, x_via_l1=True))
    assert "B of shared memory" in why_not_one_launch(fab, Tactic(16, 512, 64, 12, x_via_l1=False))
    p = CuteDslProvider()
    for tp in (4, 8, 16):
        for m in (1, 16, 64):
            calls = {role: dataclasses.replace(call, m=m) for role, call in _stage_calls(tp, row_multiple=8).items()}
            assert why_not_one_launch(*p.trailing_tactics(calls)) is None, (tp, m)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [8, 16], ids=lambda t: f"tp{t}")
def test_side_chain_in_one_launch_draws_tickets_waits_and_counts_out(arch, tp, tmp_path):
    """The trailing side chain as one launch (SGLang's partial F_A/beta at TP16 too): each CTA draws its ticket
    before any load; F_A/beta's tiles release the next launch and count each stored tile in; F_B's poll the count
    with relaxed loads and fence once before loading f_a; every CTA then counts out (acquire-release), the last
    resets the three chain counters, and only then does the launch wait for QKVG's to complete."""
    roles = _roles(tp, row_multiple=8)
    n, k, xs = roles["fab"]
    fb_n, d, fb_xs = roles["fb"]
    assert fb_xs == n
    calls = _stage_calls(tp, row_multiple=8)
    fab, fb = CuteDslProvider().trailing_tactics(calls)
    text = _compile_and_dump(SideChainKey(KernelKey(fab, n, k, xs, k, arch), fb, fb_n, d, d), tmp_path)
    ticket = text.index("atom.global.add.u32")
    assert ticket < text.index("cp.async") and ticket < text.index("griddepcontrol.launch_dependents")
    assert text.count("griddepcontrol.launch_dependents") == 2 and text.count("griddepcontrol.wait") == 1
    signal = text.index("atom.global.release.add")
    poll = text.index("ld.relaxed.gpu.global")
    assert "cp.async" in text[text.index("fence.acq_rel.gpu", poll):] and "ld.acquire" not in text
    count_out = text.rindex("atom.global.acq_rel.add")
    final_wait = text.index("griddepcontrol.wait")
    assert max(signal, poll) < count_out < final_wait
    resets = re.findall(r"st\.global\.b32\s+\[(%rd\d+)(?:\+(\d+))?\], 0;", text[count_out:final_wait])
    assert len({reg for reg, _ in resets}) == 1 and sorted(int(off or 0) for _, off in resets) == [0, 4, 8]


def test_eager_stage_runs_as_one_launch_with_the_plans_qkvg_order():
    """An eager call's whole stage is one launch where QKVG runs the mma.sync kernel unsplit over one token tile:
    the plan's tactic, in 16-row CTAs where its thread count differs from the side chain's (48-row CTAs run two
    warps), with activations by cp.async; a wgmma or split-K QKVG keeps its launches (its sums run in another
    order), and so does M > 16 (the one launch is slower on the GPU there)."""
    p = CuteDslProvider()

    def with_qkvg(tactic, m=16):
        calls = {role: dataclasses.replace(call, m=m) for role, call in _stage_calls(8).items()}
        return calls | {"qkvg": dataclasses.replace(calls["qkvg"], tuned=tactic)}

    tuned = Tactic(48, 256, 16, 4, x_via_l1=False)
    assert p.stage_tactic(with_qkvg(tuned)) == Tactic(16, 256, 16, 4, x_via_l1=False)
    assert p.stage_tactic(with_qkvg(Tactic(16, 256, 16, 4, x_via_l1=False, x_bulk=True), m=1)) == Tactic(
        16, 256, 16, 4, x_via_l1=False)
    assert p.why_not_stage(with_qkvg(tuned)) is None
    for tp in (4, 8, 16):
        for m in (1, 16, 32):
            calls = {role: dataclasses.replace(call, m=m) for role, call in _stage_calls(tp, row_multiple=8).items()}
            assert (p.why_not_stage(calls) is None) == (m <= 16), (tp, m)
    assert p.stage_tactic(with_qkvg(WgmmaTactic(64, 64, 64, 12), m=64)) is None
    assert p.stage_tactic(with_qkvg(Tactic(16, 128, 16, 4, split_k=2))) is None
    fab, fb = p.trailing_tactics(_stage_calls(8))
    assert "runs 64 threads" in why_not_one_launch_stage(tuned, fab, fb)
    assert "must be programmatic" in why_not_one_launch_stage(Tactic(16, 256, 16, 4, pdl=False), fab, fb)
    assert "B of shared memory" in why_not_one_launch_stage(Tactic(16, 512, 64, 6), fab, fb)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [8, 16], ids=lambda t: f"tp{t}")
def test_stage_in_one_launch_waits_before_its_tickets(arch, tp, tmp_path):
    """The whole stage as one launch: every CTA waits for the launch before it, then draws its ticket (a stage
    launched before on the stream has reset the counters by then, and x is complete); QKVG's program waits and
    releases as its own kernel does, F_A/beta's releases at once, F_B's polls; the last CTA resets the counters."""
    roles = _roles(tp, row_multiple=8)
    n, k, xs = roles["fab"]
    fb_n, d, _ = roles["fb"]
    qkvg_n = roles["qkvg"][0]
    calls = _stage_calls(tp, row_multiple=8)
    p = CuteDslProvider()
    fab, fb = p.trailing_tactics(calls)
    key = StageKey(SideChainKey(KernelKey(fab, n, k, xs, k, arch), fb, fb_n, d, d), p.stage_tactic(calls), qkvg_n, k)
    text = _compile_and_dump(key, tmp_path)
    first_wait, ticket = text.index("griddepcontrol.wait"), text.index("atom.global.add.u32")
    assert first_wait < ticket < text.index("cp.async") and ticket < text.index("griddepcontrol.launch_dependents")
    # Releases: F_A/beta's, QKVG's (after its own wait) and F_B's; waits: before the ticket, QKVG's, the last.
    assert text.count("griddepcontrol.launch_dependents") == 3 and text.count("griddepcontrol.wait") == 3
    count_out = text.rindex("atom.global.acq_rel.add")
    resets = re.findall(r"st\.global\.b32\s+\[(%rd\d+)(?:\+(\d+))?\], 0;", text[count_out:])
    assert sorted(int(off or 0) for _, off in resets) == [0, 4, 8]
    assert text.rindex("griddepcontrol.wait") > count_out


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tp", [4, 16], ids=lambda t: f"tp{t}")
def test_partial_row_block_kernels_compile_on_cpu(arch, tp):
    """SGLang's F_A/beta (N % 16 == 8) by every path: the default split-K tactic of each token tile, wider CTAs
    (the last one partial by more than 8 rows) with activations by TMA and bulk copies, no split; F_B reading f_a at
    that row stride, waiting behind the trailing side chain's signaling split-K F_A/beta, which is compiled too."""
    roles = _roles(tp, row_multiple=8)
    n, k, xs = roles["fab"]
    assert n % 16 == 8
    wide = 48 if (n + 8) % 48 == 0 else 32
    tactics = [default_tactic(n, k, m) for m in (1, 32, 64)] + [
        Tactic(wide, 128, 16, 4, x_via_l1=False, x_tma=True, split_k=4),
        Tactic(wide, 128, 64, 4, x_via_l1=False, x_bulk=True, split_k=4),
        Tactic(16, 256, 16, 4),
    ]
    keys = [KernelKey(tactic, n, k, xs, k, arch) for tactic in tactics]
    fb_n, fb_k, fb_xs = roles["fb"]
    keys.append(KernelKey(default_tactic(fb_n, fb_k, 16), fb_n, fb_k, fb_xs, fb_k, arch))
    keys.append(_waiting_fb_key(tp, arch, row_multiple=8))
    keys.append(KernelKey(Tactic(16, 128, 16, 3, x_via_l1=False, split_k=14), n, k, xs, k, arch,
                          Link(signals=True, x_ready=True)))
    for key in keys:
        assert validate_tactic(key.tactic, key.n, key.k, key.x_row_stride) is None
        assert validate_link(key.link, key.tactic) is None
        assert compile_gemm(key) is not None


def _weight_copies_after_a_branch(ptx: str) -> tuple[int, int]:
    """(weight copies with a conditional branch since the previous one, weight copies without) in ``ptx``."""
    priority = {reg: p for p, reg in re.findall(r"createpolicy\.fractional\.L2::(\w+)\.b64 (%rd\d+)", ptx)}
    after_branch = back_to_back = 0
    branch = False
    for line in ptx.splitlines():
        if re.match(r"\s*@%p\d+ bra", line):
            branch = True
        elif line.strip().startswith("cp.async.cg") and any(
            priority.get(reg) == "evict_first" for reg in re.findall(r"%rd\d+", line)
        ):
            after_branch, back_to_back = after_branch + branch, back_to_back + (not branch)
            branch = False
    return after_branch, back_to_back


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("tactic", [Tactic(16, 128, 16, 3, split_k=14), Tactic(48, 256, 16, 4)], ids=lambda t: t.key())
def test_partial_row_block_predicates_weight_rows_only_where_needed(arch, tactic, tmp_path):
    """With N = 136 every weight copy has its own row predicate; with N = 144 the same tactic issues each K-tile's
    weight copies back to back (the only branch before one is the main loop's refill test)."""
    ptx = {}
    for n in (136, 144):
        (tmp_path / str(n)).mkdir()
        ptx[n] = _compile_and_dump(KernelKey(tactic, n, 7168, 7168, 7168, arch), tmp_path / str(n))
    predicated, unpredicated = _weight_copies_after_a_branch(ptx[136])
    assert predicated == tactic.block_n * tactic.block_k // 8 // tactic.threads * tactic.stages and unpredicated == 0
    assert _weight_copies_after_a_branch(ptx[144]) == (1, predicated - 1)


def test_wgmma_tactic_round_trips_and_runs_each_m_with_its_token_tile():
    """A plan's wgmma tactic survives JSON, serves every M of its bucket with the token tile covering that M, and
    an untuned QKVG call above 32 tokens gets the wgmma default on Hopper only."""
    tuned = WgmmaTactic(128, 64, 128, 7, pdl=False)
    plan = Plan(tactics={("qkvg", 6144, 7168, 128): tuned,
                         ("qkvg", 6144, 7168, 256): WgmmaTactic(64, 64, 256, 5, split_k=2)})
    again = Plan.from_document(json.loads(json.dumps(plan.to_document())))
    assert again.tactics == plan.tactics
    provider = CuteDslProvider()
    call = _call(m=96, tuned=again.tactic_for("qkvg", 6144, 7168, 96))
    assert provider.tactic(call) == dataclasses.replace(tuned, block_t=96) and provider.why_not(call) is None
    assert isinstance(provider.tactic(_call(m=48)), WgmmaTactic) and provider.why_not(_call(m=48)) is None
    # Above 64 tokens only a tuned wgmma tactic serves (its default was slower than cuBLAS there on H200).
    assert "M > 64 without a tuned wgmma tactic" in provider.why_not(_call(m=96))
    assert isinstance(provider.tactic(_call(m=32)), Tactic)
    assert isinstance(provider.tactic(_call(m=48, capability=(10, 0))), Tactic)
    assert isinstance(provider.tactic(_call(role="fab", n=144, m=48)), Tactic)


def test_f_b_runs_a_tuned_mma_sync_tactic_above_64_tokens_on_hopper_and_blackwell():
    """F_B (the side chain's one GEMM a sequential step runs after QKVG) takes a tactic a plan tuned above 64 tokens,
    in 64-token tiles along grid y; F_A/beta does not, tuned or not."""
    tuned = Tactic(16, 128, 64, 2, pdl=True)
    plan = Plan(tactics={("fb", 1536, 128, 128): tuned, ("fab", 144, 7168, 128): Tactic(16, 128, 64, 3, split_k=14)})
    provider = CuteDslProvider()
    for capability in ((9, 0), (10, 0), (10, 3)):
        fb = _call(role="fb", n=1536, k=128, x_row_stride=144, m=96, capability=capability,
                   tuned=plan.tactic_for("fb", 1536, 128, 96))
        assert provider.why_not(fb) is None and provider.tactic(fb) == tuned
        fab = _call(role="fab", n=144, m=96, capability=capability, tuned=plan.tactic_for("fab", 144, 7168, 96))
        assert provider.why_not(fab) == "M > 64"


def test_no_trailing_side_chain_where_qkvg_and_fab_both_count_tiles_in():
    """A trailing F_A/beta starts beside QKVG and counts its split-K tiles in on the stream's arrival counters: where
    QKVG counts tiles in too (the wgmma default splits K for TP16's 3072 rows at 40 tokens; a tuned split-K QKVG)
    the side chain does not trail."""
    provider = CuteDslProvider()
    for tp, refused in ((16, True), (8, False)):
        g = preset("kimi-k3", tp)
        calls = {role: _call(role=role, m=40, n=n, k=k, x_row_stride=xs) for role, (n, k, xs) in _roles(tp).items()}
        assert (provider.tactic(calls["qkvg"]).split_k > 1) == refused, g
        reason = provider.why_not_trailing(calls)
        assert (reason is not None and "both count tiles in" in reason) if refused else reason is None
    calls = {role: _call(role=role, m=40, n=n, k=k, x_row_stride=xs) for role, (n, k, xs) in _roles(8).items()}
    calls["qkvg"] = dataclasses.replace(calls["qkvg"], tuned=WgmmaTactic(64, 64, 48, 8, split_k=2))
    assert "both count tiles in" in provider.why_not_trailing(calls)
