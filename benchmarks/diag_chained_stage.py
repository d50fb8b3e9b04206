"""Diagnostic: the chained stage against the overlapped stage and QKVG alone (TP8).

Chained: F_A/beta rides in QKVG's launch (its row blocks after QKVG's), and F_B, launched programmatically on the
same stream, starts as soon as F_A/beta's tiles are stored (``skinny_gemm.Link``). Overlapped: the default side
chain forked beside QKVG. Sequential: the overlapped kernels one after another on one stream. Trailing: the same
kernels on one stream, the side chain launched programmatically right behind QKVG and running beside it (what an
overlapped plan runs where the host does not allow a fork); its outputs must equal the sequential ones bit for bit.
Each variant's outputs are checked against fp32 after its timing (outputs poisoned first), and the chain counters
must be zero again.

Usage (GPU machine): python benchmarks/diag_chained_stage.py 1,8,16 [joint QKVG keys [F_B keys [F_A/beta F_B]]]
(keys as in ``stage_operands.parse_tactic``; defaults: the QKVG default, and F_B ``n16k128s2p`` for the chained
stage; the last two: the side chain of the overlapped, sequential and trailing variants, by default the defaults)
"""

import dataclasses
import sys

import torch

from kda_backend.autotune import make_weight_copies
from kda_backend.geometry import preset
from kda_backend.kernels.arrival_counters import arrival_counters
from kda_backend.kernels.compile_cache import compiled_gemms, kernel_key
from kda_backend.kernels.skinny_gemm import Link, default_tactic
from kda_backend.providers.cute_provider import launch_chained, launch_trailing
from kda_backend.timing import copy_bandwidth, graph_time_per_layer
from stage_operands import StageOperands, overlapped_time, parse_tactic

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
aux = torch.cuda.Stream()
bandwidth = copy_bandwidth()
stage_bytes = sum(t.numel() * 2 for t in (weights[0].w_qkvg, weights[0].w_fab, weights[0].w_fb))
floor = stage_bytes / bandwidth * 1e6
print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s, stage floor {floor:.2f} us", flush=True)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not out.isnan().any(), "NaN in output"
    return ((out.float() - ref).norm() / ref.norm()).item()


for m in [int(v) for v in sys.argv[1].split(",")]:
    ops = StageOperands(weights, m)
    t_qkvg = default_tactic(g.qkvg_rows, g.hidden_size, m)
    t_fab = parse_tactic(sys.argv[4], m) if len(sys.argv) > 4 else default_tactic(g.fab_rows, g.hidden_size, m)
    t_fb = parse_tactic(sys.argv[5], m) if len(sys.argv) > 5 else default_tactic(g.local_width, g.head_dim, m)
    joints = [parse_tactic(k, m) for k in sys.argv[2].split(",")] if len(sys.argv) > 2 else [t_qkvg]
    waitings = [parse_tactic(k, m) for k in (sys.argv[3] if len(sys.argv) > 3 else "n16k128s2p").split(",")]

    def qkvg(i):
        ops.qkvg_gemm(t_qkvg, i)

    def side(i):
        ops.fab_gemm(t_fab, i)
        ops.fb_gemm(t_fb, i)

    t_fab_l2 = dataclasses.replace(t_fab, x_via_l1=False)
    t_fb_l2 = t_fb.with_activations_from_l2()

    def trailing(i):
        j = i % ops.copies
        qkvg(i)
        launch_trailing(t_fab_l2, t_fb_l2, ops.xs[j], weights[j].w_fab, ops.fab[j], weights[j].w_fb, ops.g1[j])

    def chained(i, joint, waiting):
        j = i % ops.copies
        w = weights[j]
        launch_chained(joint, waiting, ops.xs[j], w.w_qkvg, ops.qkvg[j], w.w_fab, ops.fab[j], w.w_fb, ops.g1[j])

    scratch_chain = torch.zeros(2, dtype=torch.int32, device="cuda")  # counts up, never waited on

    def joint_only(i, joint):
        j = i % ops.copies
        w = weights[j]
        key = kernel_key(joint, g.qkvg_rows, g.hidden_size, g.hidden_size, g.hidden_size, w.device, Link(g.fab_rows))
        compiled_gemms.get(key)(ops.xs[j], w.w_qkvg, ops.qkvg[j].t(), w.w_fab, ops.fab[j].t(), scratch_chain)

    def check(label):
        torch.cuda.synchronize()
        chain = arrival_counters.chain_for_stream(torch.cuda.current_stream())
        assert not chain.any(), f"{label}: chain counters left at {chain.tolist()}"
        errs = []
        for j, w in enumerate(weights):
            x = ops.xs[j].float()
            fab_ref = x @ w.w_fab.float().t()
            errs.append(max(rel_err(ops.qkvg[j], x @ w.w_qkvg.float().t()), rel_err(ops.fab[j], fab_ref),
                            rel_err(ops.g1[j], ops.fab[j][:, : g.head_dim].float() @ w.w_fb.float().t())))
        return max(errs)

    def poison():
        for bufs in (ops.qkvg, ops.fab, ops.g1):
            for b in bufs:
                b.fill_(float("nan"))

    unchained = {  # the overlapped kernels: (timed per layer, run once eagerly for the checks)
        "overlapped": (lambda: overlapped_time(qkvg, side, aux), lambda i: (qkvg(i), side(i))),
        "sequential": (lambda: graph_time_per_layer(lambda i: (qkvg(i), side(i))), lambda i: (qkvg(i), side(i))),
        "trailing": (lambda: graph_time_per_layer(trailing), trailing),
    }
    pairs = {f"chained {j.key()} -> {w.key()}": (j, w) for j in joints for w in waitings}
    for i in range(ops.copies):  # compile everything before capture
        qkvg(i)
        side(i)
        trailing(i)
        for pair in pairs.values():
            chained(i, *pair)
            joint_only(i, pair[0])
    for rnd in range(2):
        alone = graph_time_per_layer(qkvg) * 1e6
        print(f"M={m:2} round {rnd} QKVG alone {alone:6.2f} us", flush=True)
        for joint in joints:
            t = graph_time_per_layer(lambda i, joint=joint: joint_only(i, joint)) * 1e6
            print(f"M={m:2} round {rnd} joint QKVG + F_A/beta alone {joint.key():20} {t:6.2f} us "
                  f"(+{t - alone:5.2f} over QKVG alone)", flush=True)
        results, sequential_bits = [], None
        for label, (timed, eager) in unchained.items():
            t = timed() * 1e6
            poison()
            for i in range(ops.copies):
                eager(i)
            results.append((label, t, check(label)))
            bits = [b.clone() for bufs in (ops.qkvg, ops.fab, ops.g1) for b in bufs]
            if sequential_bits is None:
                sequential_bits = bits
            assert all(torch.equal(a, b) for a, b in zip(bits, sequential_bits)), f"{label}: other bits"
        for label, pair in pairs.items():
            t = graph_time_per_layer(lambda i, pair=pair: chained(i, *pair)) * 1e6
            # Replay with fresh inputs into poisoned outputs: a counter left over would let F_B read poison.
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for i in range(ops.copies):
                    chained(i, *pair)
            for x in ops.xs:
                x.normal_()
            poison()
            graph.replay()
            graph.replay()
            err = check(label + " (replay)")
            poison()
            for i in range(ops.copies):
                chained(i, *pair)
            results.append((label, t, max(err, check(label))))
        for label, t, err in results:
            print(f"M={m:2} round {rnd} {label:40} {t:6.2f} us ({t / floor:.3f}x floor, +{t - alone:5.2f} over "
                  f"QKVG alone) max rel.err {err:.1e}", flush=True)
