"""CTA by CTA: when each CTA of QKVG, F_A/beta and F_B starts, passes its PDL wait and ends (Kimi-K3, TP8).

Times QKVG alone and the overlapped stage (QKVG on the main stream, F_A/beta -> F_B forked onto an aux stream) with
kernels built from a copy of ``kda_backend/kernels/skinny_gemm.py`` patched in memory: thread 0 of each CTA writes
``%globaltimer`` (low word) at entry, after its PDL wait and at exit, and its SM id, into a per-layer buffer passed
as the arrival-counter argument (after split-K's own counters). Prints the time per layer, then per variant the
medians over the middle 12 layers of one replay of a 24-layer CUDA graph, in us after the release of the layer's
first QKVG PDL wait: QKVG CTA starts and ends (percentiles), the side chain's first start and last end, QKVG CTAs
on SMs that also ran an F_B CTA against the others, and the release of the next layer. With ``--out`` the raw
records are saved there too (``torch.save``), for reading offline.

Example (GPU): python benchmarks/tools/stage_timeline.py 2,8,16 n48k256s4p n16k128s3x14p n16k128s3pL
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from stage_operands import LAYERS, TACTIC_HELP, StageOperands, kimi_k3, tactic_or_default, token_counts

from kda_backend.kernels import compile_cache, skinny_gemm
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.overlap import OverlapScheduler
from kda_backend.timing import graph_time_per_layer

WORDS = 4  # int32 words per CTA: start, after PDL wait, end, SM id
# (anchor in skinny_gemm.py, addition, True to insert after the anchor / False before it)
PATCHES = [
    (
        "        k_first = bidz * k_tiles  # this CTA's K-tiles: [k_first, k_first + k_tiles)\n",
        "        t_start = cute.arch.globaltimer_lo()\n",
        True,
    ),
    (  # the first activation load, past the PDL wait
        "        for s in cutlass.range_constexpr(t.stages - 1):\n"
        "            if s < k_tiles:\n"
        "                self._load_x(",
        "        t_wait = cute.arch.globaltimer_lo()\n",
        False,
    ),
    (  # after the output is stored
        "        if cutlass.const_expr(own_exit and link.waits):\n            self._count_out(m_chain, tidx)\n",
        (
            "        if tidx == 0:\n"
            "            gx, gy, _ = cute.arch.grid_dim()\n"
            "            cta = (bidz * gy + bidy) * gx + bidx\n"
            # after the split-K arrival counters (one per output tile), which share the buffer
            f"            base = gx * gy * (1 if t.split_k > 1 else 0) + cta * {WORDS}\n"
            "            m_arrivals[base] = t_start\n"
            "            m_arrivals[base + 1] = t_wait\n"
            "            m_arrivals[base + 2] = cute.arch.globaltimer_lo()\n"
            "            m_arrivals[base + 3] = cute.arch.smid()\n"
        ),
        False,
    ),
]


def patched_source() -> str:
    """``skinny_gemm.py`` with the timeline records added; exits naming the anchor that no longer matches once."""
    source = Path(skinny_gemm.__file__).read_text()
    for anchor, addition, after in PATCHES:
        if source.count(anchor) != 1:
            raise SystemExit(f"skinny_gemm.py changed: anchor not found once: {anchor!r}")
        source = source.replace(anchor, anchor + addition if after else addition + anchor)
    return source


def patched_module():
    """The patched copy imported from a temporary folder, which the module holds (the DSL reads a kernel's source
    when it compiles) and which is removed at exit."""
    folder = tempfile.TemporaryDirectory(prefix="kda-timeline-")
    path = Path(folder.name) / "skinny_timeline.py"
    path.write_text(patched_source())
    spec = importlib.util.spec_from_file_location("skinny_timeline", path)
    module = importlib.util.module_from_spec(spec)
    module.source_folder = folder
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def compile_timed(module, tactic, n, k, x_row_stride, arch=None):
    """The patched kernel, ``f(x, w, out, work, records)``: the records buffer in the arrival-counter slot (after
    split-K's own counters; a kernel without split-K takes it there too and only writes records), the workspace
    ``None`` without split-K; for ``arch`` (default: the current device's, or ``CUTE_DSL_ARCH``)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    gemm = module.SkinnyGemm(tactic, n, k, x_row_stride, k)
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, k), (x_row_stride, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (n, k), (k, 1), assumed_align=16)
    out = make_fake_tensor(cutlass.BFloat16, (m, n), (n, 1), assumed_align=16)
    work = None
    if tactic.split_k > 1:
        work = make_fake_tensor(cutlass.Float32, (tactic.split_k, m, n), (cute.sym_int64(), n, 1), assumed_align=16)
    timeline = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="words"),), (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    arch = arch or compile_cache.target_arch(torch.device("cuda"))
    with compile_cache._launches_prefer_max_smem():
        kernel = cute.compile(gemm, x, w, out, work, timeline, None, None, stream,
                              options=f"--enable-tvm-ffi --gpu-arch {arch}")
    return lambda x, w, out, work, records: kernel(x, w, out, work, records, None, None)


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
        self.work = torch.empty(tactic.split_k, m, n, device="cuda") if tactic.split_k > 1 else None

    def __call__(self, i, x, w, out):
        self.kernel(x, w, out, self.work, self.buffers[i])

    def records(self, i):
        return self.buffers[i][self.words:].view(-1, WORDS)


def timeline_at(m, tactics, g, weights, module, aux, out):
    """Both variants at ``m`` tokens: per-layer time, the summary, and with ``out`` the raw records."""
    t_q, t_fab, t_fb = tactics
    ops = StageOperands(weights, m)
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
        if out:
            raw = {role: [gemm.records(i).cpu() for i in range(LAYERS)] for role, gemm in
                   (("qkvg", qkvg), ("fab", fab), ("fb", fb))}
            torch.save(raw, Path(out) / f"timeline_M{m}_{t_q.key()}_{name}.pt")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,16")
    ap.add_argument("qkvg", nargs="?", help=f"QKVG's tactic (default: its default tactic); {TACTIC_HELP}")
    ap.add_argument("fab", nargs="?", help="F_A/beta's tactic (default: its default tactic)")
    ap.add_argument("fb", nargs="?", help="F_B's tactic (default: its default tactic)")
    ap.add_argument("--out", type=Path, help="folder to save the raw records in")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    g, weights, aux = kimi_k3()
    module = patched_module()
    for m in args.ms:
        tactics = tuple(tactic_or_default(getattr(args, role), role, g, m) for role in ("qkvg", "fab", "fb"))
        if any(isinstance(t, WgmmaTactic) for t in tactics):
            raise SystemExit("stage_timeline patches the mma.sync kernel: give its tactics (n...), not wgmma ones")
        timeline_at(m, tactics, g, weights, module, aux, args.out)


if __name__ == "__main__":
    main()
