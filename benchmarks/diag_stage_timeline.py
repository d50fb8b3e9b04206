"""Diagnostic: when each CTA of QKVG, F_A/beta and F_B starts, passes its PDL wait and ends, alone and in the
overlapped stage (TP8, default side-chain tactics).

The kernels timed here are built from a copy of ``skinny_gemm.py`` patched in memory so that thread 0 of each CTA
writes ``%globaltimer`` (low word) at entry, after ``griddepcontrol.wait`` and at exit, and its SM id into a
per-layer buffer passed as the arrival-counter argument (after split-K's own counters). Times are
relative to the release of the layer's first QKVG PDL wait, summarised over the middle layers of one graph replay
of 24 layers; with ``OUT`` set, the raw records are saved there too.

Usage (GPU machine): python benchmarks/diag_stage_timeline.py 1,16 [QKVG [F_A/beta [F_B]]] (tactic keys, e.g. n48k256s5p)
"""

import importlib.util
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels import compile_cache, skinny_gemm
from kda_backend.kernels.skinny_gemm import default_tactic
from kda_backend.overlap import OverlapScheduler
from kda_backend.timing import graph_time_per_layer
from stage_operands import LAYERS, StageOperands, parse_tactic

WORDS = 4  # int32 words per CTA: start, after PDL wait, end, SM id
PATCHES = [
    (
        "        k_first = bidz * k_tiles  # this CTA's K-tiles: [k_first, k_first + k_tiles)\n",
        "        t_start = cute.arch.globaltimer_lo()\n",
    ),
    ("            cute.arch.griddepcontrol_launch_dependents()\n", "        t_wait = cute.arch.globaltimer_lo()\n"),
    (
        "        else:\n            self._store_tile(acc, thr_mma, s_o, g_o, c_o, m_tokens, tidx)\n",
        # after the split-K arrival counters (one per output tile), which live in the same buffer
        (
            "        if tidx == 0:\n"
            "            gx, gy, _ = cute.arch.grid_dim()\n"
            f"            base = gx * gy * (1 if t.split_k > 1 else 0) + ((bidz * gy + bidy) * gx + bidx) * {WORDS}\n"
            "            m_arrivals[base] = t_start\n"
            "            m_arrivals[base + 1] = t_wait\n"
            "            m_arrivals[base + 2] = cute.arch.globaltimer_lo()\n"
            "            m_arrivals[base + 3] = cute.arch.smid()\n"
        ),
    ),
]


def patched_module():
    source = Path(skinny_gemm.__file__).read_text()
    for anchor, addition in PATCHES:
        if source.count(anchor) != 1:
            raise SystemExit(f"skinny_gemm.py changed: anchor not found once: {anchor!r}")
        source = source.replace(anchor, anchor + addition)
    path = Path(tempfile.mkdtemp()) / "skinny_timeline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("skinny_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def compile_timed(module, tactic, n, k, x_row_stride):
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    gemm = module.SkinnyGemm(tactic, n, k, x_row_stride, k)
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, k), (x_row_stride, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (n, k), (k, 1), assumed_align=16)
    out_t = make_fake_tensor(cutlass.BFloat16, (n, m), (1, n), assumed_align=16)
    work = make_fake_tensor(cutlass.Float32, (n, m, tactic.split_k), (1, n, cute.sym_int64()), assumed_align=16)
    timeline = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="words"),), (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    with compile_cache._launches_prefer_max_smem():
        return cute.compile(gemm.split_k_call, x, w, out_t, work, timeline, stream,
                            options=f"--enable-tvm-ffi --gpu-arch {compile_cache.target_arch(torch.device('cuda'))}")


def rel(values: torch.Tensor, origin: int) -> torch.Tensor:
    """int32 globaltimer_lo values as signed ns after ``origin`` (wrap-safe)."""
    return ((values.long() - origin + 2**31) % 2**32) - 2**31


def summary(name, qkvg, side, layers):
    """Per layer, times relative to the first release of the layer's QKVG PDL wait (its CTAs may be resident
    earlier, prefetching weights while the previous kernel drains); medians over ``layers``."""
    rows = []
    for layer in layers:
        q = qkvg.records(layer)
        origin = int(q[0, 1])
        origin += int(rel(q[:, 1], origin).min())
        q_start, q_wait, q_end = (rel(q[:, j], origin).float() / 1e3 for j in range(3))
        next_wait = rel(qkvg.records(layer + 1)[:, 1], origin).float().min().item() / 1e3
        row = {
            "q start p50": q_start.median().item(),
            "q start max": q_start.max().item(),
            "q wait max": q_wait.max().item(),
            "q end min": q_end.min().item(),
            "q end p10": q_end.quantile(0.1).item(),
            "q end p50": q_end.median().item(),
            "q end p90": q_end.quantile(0.9).item(),
            "q end max": q_end.max().item(),
            "next q wait min": next_wait,
        }
        if side is not None:
            a, f = side[0].records(layer), side[1].records(layer)
            a_start, a_end = (rel(a[:, j], origin).float() / 1e3 for j in (0, 2))
            f_start, f_wait, f_end = (rel(f[:, j], origin).float() / 1e3 for j in range(3))
            shared = torch.isin(q[:, 3], f[:, 3])  # QKVG CTAs on an SM that also ran an F_B CTA
            row |= {"fab start min": a_start.min().item(), "fab end max": a_end.max().item(),
                    "fb start min": f_start.min().item(), "fb start max": f_start.max().item(),
                    "fb wait min": f_wait.min().item(), "fb end max": f_end.max().item(),
                    "q end p50, F_B SM": q_end[shared].median().item(),
                    "q end p50, other": q_end[~shared].median().item()}
        rows.append(row)
    print(f"  {name}: median over layers {layers[0]}..{layers[-1]} (us after the layer's QKVG wait first released)")
    for key in rows[0]:
        print(f"    {key:16} {statistics.median(r[key] for r in rows):7.2f}", flush=True)


class TimedGemm:
    """One role's patched kernel with a zeroed per-layer buffer: its split-K counters, then ``WORDS`` per CTA."""

    def __init__(self, module, tactic, n, k, x_row_stride, m):
        self.kernel = compile_timed(module, tactic, n, k, x_row_stride)
        self.words = n // tactic.block_n if tactic.split_k > 1 else 0  # split-K counters: one token tile at M <= 16
        ctas = n // tactic.block_n * tactic.split_k
        self.buffers = [torch.zeros(self.words + ctas * WORDS, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
        self.work = torch.empty(tactic.split_k, m, n, device="cuda").permute(2, 1, 0)

    def __call__(self, i, x, w, out):
        self.kernel(x, w, out.t(), self.work, self.buffers[i])

    def records(self, i):
        return self.buffers[i][self.words:].view(-1, WORDS)


def timeline_at(m, g, weights, module, aux, dump):
    """Both variants at ``m`` tokens: per-layer time, the summary, and with ``dump`` the raw records."""
    ops = StageOperands(weights, m)
    t_q = parse_tactic(sys.argv[2], m) if len(sys.argv) > 2 else default_tactic(g.qkvg_rows, g.hidden_size, m)
    t_fab = parse_tactic(sys.argv[3], m) if len(sys.argv) > 3 else default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = parse_tactic(sys.argv[4], m) if len(sys.argv) > 4 else default_tactic(g.local_width, g.head_dim, m)
    qkvg = TimedGemm(module, t_q, g.qkvg_rows, g.hidden_size, g.hidden_size, m)
    fab = TimedGemm(module, t_fab, g.fab_rows, g.hidden_size, g.hidden_size, m)
    fb = TimedGemm(module, t_fb, g.local_width, g.head_dim, g.fab_rows, m)
    c = ops.copies

    def main_gemm(i):
        qkvg(i, ops.xs[i % c], weights[i % c].w_qkvg, ops.qkvg[i % c])

    def side(i):
        fab(i, ops.xs[i % c], weights[i % c].w_fab, ops.fab[i % c])
        fb(i, ops.fab[i % c][:, : g.head_dim], weights[i % c].w_fb, ops.g1[i % c])

    schedulers = [OverlapScheduler() for _ in range(LAYERS)]
    variants = {
        "alone": main_gemm,
        "stage": lambda i: schedulers[i].run(lambda: main_gemm(i), lambda: side(i), aux),
    }
    for name, layer in variants.items():
        per_layer = graph_time_per_layer(layer, layers=LAYERS) * 1e6  # the records are the last replay's
        ref = ops.xs[0].float() @ weights[0].w_qkvg.float().t()
        err = ((ops.qkvg[0].float() - ref).norm() / ref.norm()).item()
        print(f"M={m} {name} ({t_q.key()}, F_A/beta {t_fab.key()}, F_B {t_fb.key()}): {per_layer:.2f} us per layer, "
              f"rel.err {err:.1e}", flush=True)
        summary(name, qkvg, (fab, fb) if name == "stage" else None, list(range(6, LAYERS - 6)))
        if dump:
            raw = {role: [gemm.records(i).cpu() for i in range(LAYERS)] for role, gemm in
                   (("qkvg", qkvg), ("fab", fab), ("fb", fb))}
            torch.save(raw, Path(dump) / f"timeline_M{m}_{t_q.key()}_{name}.pt")


def main():
    g = preset("kimi-k3", 8)
    weights = make_weight_copies(g, torch.device("cuda"))
    module = patched_module()
    aux = torch.cuda.Stream()
    dump = os.environ.get("OUT")  # raw records land there too (torch.save), for reading offline
    for m in [int(v) for v in sys.argv[1].split(",")]:
        timeline_at(m, g, weights, module, aux, dump)


main()
