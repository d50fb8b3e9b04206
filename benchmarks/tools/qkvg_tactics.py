"""QKVG tactics against the default tactic, alone and inside the overlapped projection stage (Kimi-K3, TP 8 or
``--tp``).

For each M, cuBLAS's QKVG alone (``torch.mm``) first; then for each QKVG tactic (the default first), prints the
tactic's shared memory, its relative error against fp32 (output poisoned with NaN first), QKVG alone in us per layer
and as a multiple of its own HBM floor (QKVG weight bytes / copy bandwidth measured in the same process), and the
overlapped stage: QKVG on the main stream, F_A/beta -> F_B forked onto an aux stream, with the excess over QKVG alone.
Per M a line first names the side chain's tactics and checks its outputs the same way (either tactic may be of either
kernel family). For each wgmma tactic the fused stage takes (tokens on M, or swap-AB with fewer than 64 rows) the
fused stage with it as QKVG's tactic (``kda_backend.kernels.wgmma_stage``) follows, its outputs checked the same way.
Times are medians of 50 replays of a CUDA graph of 24 layers whose weights rotate over 6 copies. This is the A/B tool
behind most lever measurements in benchmarks/RESULTS.md: run it once per build, builds alternated.

Example (GPU): python benchmarks/tools/qkvg_tactics.py 1,8,16 n48k256s4p,n64k256s4p n16k128s3x14p n16k128s3pL
               python benchmarks/tools/qkvg_tactics.py --tp 4 72,96 w96k64s8mp
"""

from __future__ import annotations

import argparse

import torch
from stage_operands import (
    TACTIC_HELP,
    StageOperands,
    kimi_k3,
    overlapped_time,
    parse_tactic,
    tactic_or_default,
    token_counts,
)

from kda_backend.accuracy import output_error
from kda_backend.kernels.tactics import validate_any
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.kernels.wgmma_stage import STAGE_COUNTERS, WgmmaStage, compile_stage, validate_stage
from kda_backend.timing import copy_bandwidth, graph_time_per_layer
from kda_backend.weights import ProjectionWeights


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ms", type=token_counts, help="comma-separated token counts M, e.g. 1,8,16")
    ap.add_argument("qkvg", help=f"comma-separated QKVG tactics timed after the default; {TACTIC_HELP}")
    ap.add_argument("fab", nargs="?", help="F_A/beta's tactic in the side chain (default: its default tactic)")
    ap.add_argument("fb", nargs="?", help="F_B's tactic in the side chain (default: its default tactic)")
    ap.add_argument("--tp", type=int, default=8, help="tensor-parallel size of the Kimi-K3 shapes (default 8)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    g, weights, aux = kimi_k3(args.tp)
    bandwidth = copy_bandwidth()
    qkvg_floor = weights[0].w_qkvg.numel() * 2 / bandwidth * 1e6
    print(f"TP {args.tp}: copy bandwidth {bandwidth / 1e12:.3f} TB/s, QKVG floor {qkvg_floor:.2f} us", flush=True)
    for m in args.ms:
        t_fab, t_fb = tactic_or_default(args.fab, "fab", g, m), tactic_or_default(args.fb, "fb", g, m)
        ops = StageOperands(weights, m)

        alone = graph_time_per_layer(ops.qkvg_cublas) * 1e6
        print(f"M={m:2} {'cuBLAS (torch.mm)':20} alone {alone:6.2f} us ({alone / qkvg_floor:.3f}x)", flush=True)

        def side(i):
            ops.fab_gemm(t_fab, i)
            ops.fb_gemm(t_fb, i)

        print(f"M={m:2} side chain {t_fab.key()} / {t_fb.key()}: {side_chain_errors(ops, weights[0], side)}",
              flush=True)

        tactics = [tactic_or_default(None, "qkvg", g, m)]
        tactics += [parse_tactic(spec, m) for spec in args.qkvg.split(",")]
        for t_qkvg in tactics:
            reason = validate_any(t_qkvg, g.qkvg_rows, g.hidden_size, g.hidden_size)
            if reason is not None:
                print(f"M={m:2} {t_qkvg.key():20} skipped: {reason}", flush=True)
                continue

            def qkvg(i, t_qkvg=t_qkvg):
                ops.qkvg_gemm(t_qkvg, i)

            for i in range(len(weights)):  # compile everything before capture
                qkvg(i)
                side(i)
            ops.qkvg[0].fill_(float("nan"))
            qkvg(0)
            ref = ops.xs[0].float() @ weights[0].w_qkvg.float().t()
            err = ((ops.qkvg[0].float() - ref).norm() / ref.norm()).item()
            alone = graph_time_per_layer(qkvg) * 1e6
            stage = overlapped_time(qkvg, side, aux) * 1e6
            print(f"M={m:2} {t_qkvg.key():20} smem {t_qkvg.smem_bytes() // 1024:3} KB rel.err {err:.1e} "
                  f"alone {alone:6.2f} us ({alone / qkvg_floor:.3f}x) stage {stage:6.2f} us (+{stage - alone:4.2f})",
                  flush=True)
            shapes = (g.qkvg_rows, g.fab_rows, g.local_width, g.hidden_size, g.head_dim)
            # The fused stage runs one token tile (a weight cluster's tiles in one cluster): a tactic with a fixed
            # tile below M has none.
            one_tile = isinstance(t_qkvg, WgmmaTactic) and t_qkvg.block_t * t_qkvg.weight_cluster >= m
            if one_tile and validate_stage(t_qkvg, *shapes) is None:
                seconds, errors = fused_stage(ops, weights, WgmmaStage(t_qkvg, *shapes))
                print(f"M={m:2} {t_qkvg.key():20} fused stage {seconds * 1e6:6.2f} us "
                      f"({seconds * 1e6 - stage:+.2f} against the stage above): {errors}", flush=True)


def fused_stage(ops: StageOperands, weights: list[ProjectionWeights], stage: WgmmaStage) -> tuple[float, str]:
    """Seconds per layer of ``stage`` in one launch over the rotating operands (outputs written into ``ops``), and
    its relative errors against fp32 for the first weight copy, from a first run into NaN-poisoned outputs (F_B's
    reference takes the kernel's bf16 F_A/beta output)."""
    kernel = compile_stage(stage, "sm_90a")
    chain = torch.zeros(STAGE_COUNTERS, device="cuda", dtype=torch.int32)

    def layer(i):
        j = i % ops.copies
        w = weights[j]
        kernel(ops.xs[j], w.w_qkvg, ops.qkvg[j], w.w_fab, ops.fab[j], w.w_fb, ops.g1[j], chain)

    outs = (ops.qkvg[0], ops.fab[0], ops.g1[0])
    for out in outs:
        out.fill_(float("nan"))
    layer(0)
    torch.cuda.synchronize()
    if chain.tolist() != [0] * STAGE_COUNTERS:
        raise SystemExit(f"the fused stage left its counters at {chain.tolist()}")
    w, x, d = weights[0], ops.xs[0].float(), ops.head_dim
    refs = (x @ w.w_qkvg.float().t(), x @ w.w_fab.float().t(), outs[1][:, :d].float() @ w.w_fb.float().t())
    errors = []
    for name, out, ref in zip(("qkvg", "fab", "g1"), outs, refs):
        reason = output_error(out, ref)
        errors.append(f"{name} {'ok' if reason is None else reason}")
    return graph_time_per_layer(layer), ", ".join(errors)


def side_chain_errors(ops: StageOperands, w: ProjectionWeights, side) -> str:
    """F_A/beta's and F_B's relative errors against fp32 for the first weight copy, outputs poisoned with NaN
    before the side chain runs (F_B's reference takes F_A/beta's bf16 output, as the kernel does)."""
    fab, g1 = ops.fab[0], ops.g1[0]
    fab.fill_(float("nan"))
    g1.fill_(float("nan"))
    side(0)
    x, d = ops.xs[0].float(), ops.head_dim
    errors = []
    for name, out, ref in (("fab", fab, x @ w.w_fab.float().t()), ("g1", g1, fab[:, :d].float() @ w.w_fb.float().t())):
        reason = output_error(out, ref)
        errors.append(f"{name} {'ok' if reason is None else reason}")
    return ", ".join(errors)


if __name__ == "__main__":
    main()
