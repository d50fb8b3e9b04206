"""cuBLAS QKVG (packed-weight view) forked with the CuTe side chain at M > 64."""
import json, os, statistics, sys
import torch
from stage_operands import StageOperands, parse_tactic, LAYERS
from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.providers.cute_provider import launch
from kda_backend.timing import graph_time_per_layer, copy_bandwidth

def main():
    tp = int(sys.argv[1]); ms = [int(v) for v in sys.argv[2].split(",")]
    fabs = sys.argv[3].split(","); fbs = sys.argv[4].split(",")
    out = os.environ.get("OUT", "/tmp")
    bw = copy_bandwidth()
    g = preset("kimi-k3", tp)
    ws = make_weight_copies(g, torch.device("cuda"))
    wb = sum(t.numel() * 2 for t in (ws[0].packed, ws[0].w_fb))
    print(f"TP {tp} copy bandwidth {bw/1e12:.3f} TB/s, floor {wb/bw*1e6:.2f} us, QKVG alone floor {ws[0].w_qkvg.numel()*2/bw*1e6:.2f}", flush=True)
    aux = torch.cuda.Stream()
    for m in ms:
        ops = StageOperands(ws, m); n = len(ws)
        packed_out = [torch.empty(m, g.packed_rows, device="cuda", dtype=torch.bfloat16) for _ in ws]
        def seq(i):
            j = i % n
            torch.mm(ops.xs[j], ws[j].packed.t(), out=packed_out[j])
            torch.mm(packed_out[j][:, g.qkvg_rows:g.qkvg_rows + g.head_dim], ws[j].w_fb.t(), out=ops.g1[j])
        def qkvg(i):
            j = i % n
            torch.mm(ops.xs[j], ws[j].w_qkvg.t(), out=ops.qkvg[j])
        def side_fn(ft, bt):
            def side(i):
                j = i % n
                launch(ft, ops.xs[j], ws[j].w_fab, ops.fab[j])
                launch(bt, ops.fab[j][:, : g.head_dim], ws[j].w_fb, ops.g1[j])
            return side
        evs = [(torch.cuda.Event(), torch.cuda.Event()) for _ in range(LAYERS)]
        def forked(side, side_first):
            def layer(i):
                fork, join = evs[i]
                cur = torch.cuda.current_stream()
                fork.record(cur)
                if not side_first:
                    qkvg(i)
                with torch.cuda.stream(aux):
                    aux.wait_event(fork); side(i); join.record(aux)
                if side_first:
                    qkvg(i)
                cur.wait_event(join)
            return layer
        rows = {}
        def t(name, fn):
            rows.setdefault(name, []).append(graph_time_per_layer(fn) * 1e6)
        sides = {f"{a}+{b}": side_fn(parse_tactic(a, m), parse_tactic(b, m)) for a in fabs for b in fbs}
        # correctness of one side chain against torch
        for name, side in list(sides.items())[:1]:
            ops.g1[0].fill_(float("nan")); ops.fab[0].fill_(float("nan"))
            side(0); torch.cuda.synchronize()
            ref_fab = (ops.xs[0].float() @ ws[0].w_fab.float().t())
            ref_g1 = ops.fab[0][:, :g.head_dim].float() @ ws[0].w_fb.float().t()
            e1 = ((ops.fab[0].float() - ref_fab).norm() / ref_fab.norm()).item()
            e2 = ((ops.g1[0].float() - ref_g1).norm() / ref_g1.norm()).item()
            print(f"  M={m} {name}: rel err fab {e1:.2e} g1 {e2:.2e} nan {bool(ops.g1[0].isnan().any() or ops.fab[0].isnan().any())}", flush=True)
        for rnd in range(3):
            t("seq packed cuBLAS", seq)
            t("qkvg cuBLAS alone", qkvg)
            for name, side in sides.items():
                t(f"side {name} alone", side)
                t(f"forked {name}", forked(side, False))
                t(f"forked {name} side-first", forked(side, True))
        print(f"TP {tp} M={m}:", flush=True)
        for k, v in rows.items():
            print(f"   {k:<48} {statistics.median(v):7.2f}  (x floor {statistics.median(v)/(wb/bw*1e6):.3f})", flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            qkvg(0); torch.cuda.synchronize()
        p = f"{out}/logs/t.json"; prof.export_chrome_trace(p)
        for e in json.load(open(p))["traceEvents"]:
            if e.get("cat") == "kernel":
                print(f"   qkvg kernel {e['name'][:60]} grid={e['args'].get('grid')}", flush=True)
        os.remove(p)

main()
