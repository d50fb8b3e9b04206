"""cuBLAS SM carveout lever: QKVG torch.mm on fewer SMs, side chain torch.mm on the rest."""
import contextlib, json, statistics, sys, os
import torch
from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.overlap import OverlapScheduler
from kda_backend.timing import graph_time_per_layer, copy_bandwidth

SMS = torch.cuda.get_device_properties(0).multi_processor_count
print("carveout api:", hasattr(torch._C, "_set_sm_carveout_experimental"), "SMs", SMS, flush=True)

@contextlib.contextmanager
def carve(c):
    old = torch._C._get_sm_carveout_experimental()
    torch._C._set_sm_carveout_experimental(c)
    try:
        yield
    finally:
        torch._C._set_sm_carveout_experimental(old)

def main():
    tps = [int(v) for v in sys.argv[1].split(",")]
    ms = [int(v) for v in sys.argv[2].split(",")]
    cs = [int(v) for v in sys.argv[3].split(",")]
    out = os.environ.get("OUT", "/tmp")
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw/1e12:.3f} TB/s", flush=True)
    aux = torch.cuda.Stream()
    for tp in tps:
        g = preset("kimi-k3", tp)
        ws = make_weight_copies(g, torch.device("cuda"))
        wb = sum(t.numel() * 2 for t in (ws[0].w_qkvg, ws[0].w_fab, ws[0].w_fb))
        qb = ws[0].w_qkvg.numel() * 2
        print(f"TP {tp}: stage weight floor {wb/bw*1e6:.2f} us, QKVG alone {qb/bw*1e6:.2f} us", flush=True)
        for m in ms:
            xs = [torch.randn(m, g.hidden_size, device="cuda", dtype=torch.bfloat16) for _ in ws]
            qo = [torch.empty(m, g.qkvg_rows, device="cuda", dtype=torch.bfloat16) for _ in ws]
            fo = [torch.empty(m, g.fab_rows, device="cuda", dtype=torch.bfloat16) for _ in ws]
            go = [torch.empty(m, g.local_width, device="cuda", dtype=torch.bfloat16) for _ in ws]
            n = len(ws)
            def qkvg(i, c=None):
                j = i % n
                with carve(c):
                    torch.mm(xs[j], ws[j].w_qkvg.t(), out=qo[j])
            def side(i, c=None):
                j = i % n
                with carve(c):
                    torch.mm(xs[j], ws[j].w_fab.t(), out=fo[j])
                    torch.mm(fo[j][:, : g.head_dim], ws[j].w_fb.t(), out=go[j])
            scheds = [OverlapScheduler() for _ in range(24)]
            def forked(qc, sc, side_first=False):
                def layer(i):
                    s = scheds[i]
                    if side_first:
                        # side chain captured first: its launches precede QKVG's
                        cur = torch.cuda.current_stream()
                        if s._fork is None:
                            s._fork, s._join = torch.cuda.Event(), torch.cuda.Event()
                        s._fork.record(cur)
                        with torch.cuda.stream(aux):
                            aux.wait_event(s._fork)
                            side(i, sc)
                            s._join.record(aux)
                        qkvg(i, qc)
                        cur.wait_event(s._join)
                    else:
                        s.run(lambda: qkvg(i, qc), lambda: side(i, sc), aux)
                return layer
            rows = {}
            def t(name, fn):
                rows.setdefault(name, []).append(graph_time_per_layer(fn) * 1e6)
            for rnd in range(3):
                t(f"seq", lambda i: (qkvg(i), side(i)))
                for c in [None] + cs:
                    t(f"qkvg c={c}", lambda i, c=c: qkvg(i, c))
                t("side", lambda i: side(i))
                for c in cs:
                    t(f"side on {c} SMs", lambda i, c=c: side(i, SMS - c))
                t("forked none", forked(None, None))
                for c in cs:
                    t(f"forked c={c}", forked(c, SMS - c))
                    t(f"forked c={c} side-first", forked(c, SMS - c, True))
                    t(f"forked c={c} side uncarved", forked(c, None))
            # median of rounds was overwritten: re-run to get 2nd; keep last (warm)
            print(f"TP {tp} M={m}: " + "; ".join(f"{k} {statistics.median(v):.2f}" for k, v in rows.items()), flush=True)
            # kernel names / grids for qkvg with and without carveout
            for c in [None, cs[0]]:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    qkvg(0, c); side(0, SMS - cs[0] if c else None); torch.cuda.synchronize()
                p = f"{out}/logs/trace-tp{tp}-m{m}-c{c}.json"
                prof.export_chrome_trace(p)
                ev = [e for e in json.load(open(p))["traceEvents"] if e.get("cat") == "kernel"]
                for e in ev:
                    print(f"  c={c}: {e['name'][:90]} grid={e['args'].get('grid')} block={e['args'].get('block')} smem={e['args'].get('shared memory')} regs={e['args'].get('registers per thread')}", flush=True)
                os.remove(p)

main()
