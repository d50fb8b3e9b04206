"""Diagnostic: when each CTA of QKVG, F_A/beta and F_B starts, passes its PDL wait and ends: QKVG alone, the
overlapped stage and the chained stage (TP8, default side-chain tactics).

The kernels timed here are built from a copy of ``skinny_gemm.py`` patched in memory so that thread 0 of each CTA
writes ``%globaltimer`` (low word) at entry, after its wait (``griddepcontrol.wait``, or a chained F_B's wait for
F_A/beta's tiles) and at exit, and its SM id into a per-layer buffer passed as the arrival-counter argument (after
split-K's own counters, or the chain's two, which the joint and waiting launches share). Times are
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
# (anchor, addition, True to insert after the anchor / False before it)
PATCHES = [
    (
        "        k_first = bidz * k_tiles  # this CTA's K-tiles: [k_first, k_first + k_tiles)\n",
        "        t_start = cute.arch.globaltimer_lo()\n",
        True,
    ),
    (  # the first activation load: past the PDL wait, or a chained launch's wait for its joint tiles
        "        for s in cutlass.range_constexpr(t.stages - 1):\n            if s < k_tiles:\n                self._load_x(",
        "        t_wait = cute.arch.globaltimer_lo()\n",
        False,
    ),
    (  # after the output is stored, before a waiting launch's exit (which waits for the joint launch to complete)
        "        if cutlass.const_expr(link.waits):\n            self._count_out(m_chain, tidx)\n",
        (
            "        if tidx == 0:\n"
            "            gx, gy, _ = cute.arch.grid_dim()\n"
            "            cta = (bidz * gy + bidy) * gx + bidx\n"
            # after the split-K arrival counters (one per output tile) or the chain's two, which share the buffer;
            # a waiting launch fills the buffer of its joint launch from the end
            f"            base = gx * gy * (1 if t.split_k > 1 else 0) + cta * {WORDS}\n"
            "            if cutlass.const_expr(link.joint_rows > 0):\n"
            f"                base = 2 + cta * {WORDS}\n"
            "            if cutlass.const_expr(link.waits):\n"
            f"                base = m_arrivals.shape[0] - (cta + 1) * {WORDS}\n"
            "            m_arrivals[base] = t_start\n"
            "            m_arrivals[base + 1] = t_wait\n"
            "            m_arrivals[base + 2] = cute.arch.globaltimer_lo()\n"
            "            m_arrivals[base + 3] = cute.arch.smid()\n"
        ),
        False,
    ),
]


def patched_module():
    source = Path(skinny_gemm.__file__).read_text()
    for anchor, addition, after in PATCHES:
        if source.count(anchor) != 1:
            raise SystemExit(f"skinny_gemm.py changed: anchor not found once: {anchor!r}")
        source = source.replace(anchor, anchor + addition if after else addition + anchor)
    path = Path(tempfile.mkdtemp()) / "skinny_timeline.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("skinny_timeline", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def compile_timed(module, tactic, n, k, x_row_stride, link=None):
    """The patched kernel; its split-K entry (counters and records in one buffer), or with ``link`` the joint
    or waiting entry (the chain's two counters and both launches' records in one buffer)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_stream, make_fake_tensor

    gemm = module.SkinnyGemm(tactic, n, k, x_row_stride, k, link or module.Link())
    m = cute.sym_int32(symbol="M")
    x = make_fake_tensor(cutlass.BFloat16, (m, k), (x_row_stride, 1), assumed_align=16)
    w = make_fake_tensor(cutlass.BFloat16, (n, k), (k, 1), assumed_align=16)
    out_t = make_fake_tensor(cutlass.BFloat16, (n, m), (1, n), assumed_align=16)
    work = make_fake_tensor(cutlass.Float32, (n, m, tactic.split_k), (1, n, cute.sym_int64()), assumed_align=16)
    timeline = make_fake_tensor(cutlass.Int32, (cute.sym_int32(symbol="words"),), (1,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    options = f"--enable-tvm-ffi --gpu-arch {compile_cache.target_arch(torch.device('cuda'))}"
    with compile_cache._launches_prefer_max_smem():
        if link is not None and link.joint_rows:
            rows = link.joint_rows
            w2 = make_fake_tensor(cutlass.BFloat16, (rows, k), (k, 1), assumed_align=16)
            out2_t = make_fake_tensor(cutlass.BFloat16, (rows, m), (1, rows), assumed_align=16)
            return cute.compile(gemm.joint_call, x, w, out_t, w2, out2_t, timeline, stream, options=options)
        if link is not None and link.waits:
            return cute.compile(gemm.waiting_call, x, w, out_t, timeline, cutlass.Int32(0), stream, options=options)
        return cute.compile(gemm.split_k_call, x, w, out_t, work, timeline, stream, options=options)


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


def chained_summary(chain, layers):
    """As :func:`summary` for the chained stage: QKVG's and F_A/beta's CTAs of the joint launch, then F_B's."""
    rows = []
    for layer in layers:
        j, f = chain.records(layer)
        origin = int(j[0, 1])
        origin += int(rel(j[:, 1], origin).min())
        j_start, j_end = (rel(j[:, c], origin).float() / 1e3 for c in (0, 2))
        f_start, f_wait, f_end = (rel(f[:, c], origin).float() / 1e3 for c in range(3))
        q_end, a_end = j_end[chain.fab_ctas :], j_end[: chain.fab_ctas]
        rows.append({
            "q start p50": j_start[chain.fab_ctas :].median().item(),
            "fab start max": j_start[: chain.fab_ctas].max().item(),
            "q end p10": q_end.quantile(0.1).item(),
            "q end p50": q_end.median().item(),
            "q end max": q_end.max().item(),
            "fab end min": a_end.min().item(),
            "fab end max": a_end.max().item(),
            "fb start min": f_start.min().item(),
            "fb start max": f_start.max().item(),
            "fb wait max": f_wait.max().item(),
            "fb end max": f_end.max().item(),
            "next q wait min": rel(chain.records(layer + 1)[0][:, 1], origin).float().min().item() / 1e3,
        })
    print(f"  chained: median over layers {layers[0]}..{layers[-1]} (us after the layer's joint wait first released)")
    for key in rows[0]:
        print(f"    {key:16} {statistics.median(r[key] for r in rows):7.2f}", flush=True)


class TimedChain:
    """The chained stage's patched pair with one zeroed buffer per layer: the chain's two counters, the joint
    launch's records from word 2 (F_A/beta's row blocks first), the waiting launch's from the end."""

    def __init__(self, module, t_joint, t_waiting, g, m):
        self.joint = compile_timed(module, t_joint, g.qkvg_rows, g.hidden_size, g.hidden_size,
                                   module.Link(joint_rows=g.fab_rows))
        self.waiting = compile_timed(module, t_waiting, g.local_width, g.head_dim, g.fab_rows, module.Link(waits=True))
        self.joint_ctas = (g.qkvg_rows + g.fab_rows) // t_joint.block_n
        self.fab_ctas = g.fab_rows // t_joint.block_n
        self.waiting_ctas = g.local_width // t_waiting.block_n
        self.expected = module.output_tiles(t_joint, g.fab_rows, m)
        words = 2 + (self.joint_ctas + self.waiting_ctas) * WORDS
        self.buffers = [torch.zeros(words, dtype=torch.int32, device="cuda") for _ in range(LAYERS)]
        self.head_dim = g.head_dim

    def __call__(self, i, x, w, out, w2, out2, w3, out3):
        self.joint(x, w, out.t(), w2, out2.t(), self.buffers[i])
        self.waiting(out2[:, : self.head_dim], w3, out3.t(), self.buffers[i], self.expected)

    def records(self, i):
        """Joint CTAs' records (F_A/beta's first), then the waiting launch's (in CTA order)."""
        words = self.buffers[i][2:].view(-1, WORDS)
        return words[: self.joint_ctas], words[self.joint_ctas :].flip(0)


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
    t_waiting = t_fb.with_activations_from_l2()
    chain = TimedChain(module, t_q, t_waiting, g, m)

    def chained(i):
        w = weights[i % c]
        chain(i, ops.xs[i % c], w.w_qkvg, ops.qkvg[i % c], w.w_fab, ops.fab[i % c], w.w_fb, ops.g1[i % c])

    per_layer = graph_time_per_layer(chained, layers=LAYERS) * 1e6
    ref = ops.fab[0][:, : g.head_dim].float() @ weights[0].w_fb.float().t()
    err = ((ops.g1[0].float() - ref).norm() / ref.norm()).item()
    print(f"M={m} chained ({t_q.key()} joint, F_B {t_waiting.key()}): {per_layer:.2f} us per layer, g1 rel.err "
          f"{err:.1e}", flush=True)
    chained_summary(chain, list(range(6, LAYERS - 6)))
    if dump:
        torch.save([[r.cpu() for r in chain.records(i)] for i in range(LAYERS)],
                   Path(dump) / f"timeline_M{m}_{t_q.key()}_chained.pt")


def main():
    g = preset("kimi-k3", 8)
    weights = make_weight_copies(g, torch.device("cuda"))
    module = patched_module()
    aux = torch.cuda.Stream()
    dump = os.environ.get("OUT")  # raw records land there too (torch.save), for reading offline
    for m in [int(v) for v in sys.argv[1].split(",")]:
        timeline_at(m, g, weights, module, aux, dump)


main()
