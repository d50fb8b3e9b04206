"""Bound: QKVG and F_A/beta as one GEMM over [W_qkvg; W_fab] (as vLLM packs them), F_B trailing on the stream.

Usage (GPU): python benchmarks/tools/packed_stage_bound.py MS PACKED_TACTICS REFERENCE FB_TACTICS [PAD_ROWS]
"""
import sys
import torch
sys.path.insert(0, "benchmarks/tools")
from stage_operands import kimi_k3_tp8, parse_tactic, StageOperands, overlapped_time, LAYERS
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import copy_bandwidth, graph_time_per_layer

ms = [int(v) for v in sys.argv[1].split(",")]
fused_specs = sys.argv[2].split(",")
ref_spec = sys.argv[3]  # plan-like pairing "qkvg/fab/fb" or "torch"
fb_specs = sys.argv[4].split(",")
pad = int(sys.argv[5]) if len(sys.argv) > 5 else 0
g, weights, aux = kimi_k3_tp8()
bw = copy_bandwidth()
stage_bytes = sum(w.numel() * 2 for w in (weights[0].w_qkvg, weights[0].w_fab, weights[0].w_fb))
floor = stage_bytes / bw * 1e6
print(f"copy bandwidth {bw/1e12:.3f} TB/s, stage floor {floor:.2f} us", flush=True)
nq, nf, d = g.qkvg_rows, g.fab_rows, g.head_dim
combs = []
for w in weights:
    c = torch.zeros(nq + nf + pad, g.hidden_size, device="cuda", dtype=torch.bfloat16)
    c[:nq] = w.w_qkvg
    c[nq:nq + nf] = w.w_fab
    combs.append(c)
for m in ms:
    ops = StageOperands(weights, m)
    outs = [torch.empty(m, nq + nf + pad, device="cuda", dtype=torch.bfloat16) for _ in weights]
    C = len(weights)
    if ref_spec == "torch":
        def ref(i):
            j = i % C
            torch.mm(ops.xs[j], weights[j].w_qkvg.t(), out=ops.qkvg[j])
            torch.mm(ops.xs[j], weights[j].w_fab.t(), out=ops.fab[j])
            torch.mm(ops.fab[j][:, :d], weights[j].w_fb.t(), out=ops.g1[j])
        for i in range(C):
            ref(i)
        t_ref = graph_time_per_layer(ref) * 1e6
    else:
        tq, tf, tb = (parse_tactic(s, m) for s in ref_spec.split("/"))
        def side(i):
            ops.fab_gemm(tf, i); ops.fb_gemm(tb, i)
        def main(i):
            ops.qkvg_gemm(tq, i)
        for i in range(C):
            main(i); side(i)
        t_ref = overlapped_time(main, side, aux) * 1e6
    print(f"M={m:3} reference {ref_spec}: stage {t_ref:6.2f} us ({t_ref/floor:.3f}x)", flush=True)
    x0 = ops.xs[0].float()
    want = x0 @ combs[0][: nq + nf].float().t()
    for spec in fused_specs:
        for fb_spec in fb_specs:
            tq = None if spec == "torch" else parse_tactic(spec, m)
            tb = None if fb_spec == "torch" else parse_tactic(fb_spec, m)
            def gemm(i):
                j = i % C
                if tq is None:
                    torch.mm(ops.xs[j], combs[j].t(), out=outs[j])
                else:
                    launch(tq, ops.xs[j], combs[j], outs[j])
            def fb(i):
                j = i % C
                fa = outs[j][:, nq:nq + d]
                if tb is None:
                    torch.mm(fa, weights[j].w_fb.t(), out=ops.g1[j])
                else:
                    launch(tb, fa, weights[j].w_fb, ops.g1[j])
            def both(i):
                gemm(i); fb(i)
            for i in range(C):
                both(i)
            outs[0].fill_(float("nan")); ops.g1[0].fill_(float("nan"))
            both(0); torch.cuda.synchronize()
            got = outs[0][:, : nq + nf].float()
            err = ((got - want).norm() / want.norm()).item()
            g1_ref = outs[0][:, nq:nq + d].float() @ weights[0].w_fb.float().t()
            err_b = ((ops.g1[0].float() - g1_ref).norm() / g1_ref.norm()).item()
            nan = bool(torch.isnan(outs[0][:, : nq + nf]).any() or torch.isnan(ops.g1[0]).any())
            alone = graph_time_per_layer(gemm) * 1e6
            t = graph_time_per_layer(both) * 1e6
            print(f"M={m:3} fused {tq.key() if tq else 'torch':22} + F_B {tb.key() if tb else 'torch':18} err {err:.1e}/{err_b:.1e} nan {nan} "
                  f"gemm {alone:6.2f} stage {t:6.2f} us ({t/floor:.3f}x, {t - t_ref:+.2f} vs ref)", flush=True)
