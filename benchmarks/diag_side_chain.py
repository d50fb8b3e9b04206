"""Diagnostic: the F_A/beta tactic inside the overlapped stage (TP8), beside the default 64 KB QKVG tactic or another.

The autotuner picks F_A/beta's tactic by timing it alone, where split-K (many small CTAs, then a reduction) wins;
beside QKVG what matters is how much the side chain slows QKVG down. Prints, per F_A/beta tactic and M, the
overlapped stage, F_A/beta alone and its CTA count.

Usage (GPU machine): python benchmarks/diag_side_chain.py 1,16 split,whole-k,fine-split,n48k64s3x14p [F_B keys [QKVG]]
(groups of F_A/beta tactics below, or keys as in ``stage_operands.parse_tactic``; every F_B key, by default F_B's
default tactic, is timed with every F_A/beta tactic; QKVG, by default its default tactic, is one key)
"""

import sys

import torch
from stage_operands import parse_tactic

from kda_backend import dispatch
from kda_backend.autotune import OVERLAP_CUTE, make_weight_copies, time_step, time_tactic
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic, default_tactic

g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
cute = dispatch.provider_by_name("cute")
ms = [int(v) for v in sys.argv[1].split(",")]
FAB_TACTICS = {
    "split": [Tactic(16, 128, 16, 2, split_k=s) for s in (14, 7, 4, 2)],
    "whole-k": [Tactic(16, 256, 16, 4), Tactic(16, 128, 16, 4), Tactic(16, 256, 16, 6), Tactic(16, 128, 16, 8)],
    "fine-split": [Tactic(16, 128, 16, 2, split_k=28), Tactic(16, 64, 16, 2, split_k=14),
                   Tactic(16, 64, 16, 2, split_k=28), Tactic(16, 64, 16, 2, split_k=56),
                   Tactic(16, 64, 16, 3, split_k=28), Tactic(16, 128, 16, 2, split_k=14)],
    # 48-row CTAs per split: each reads x for three times the rows of a 16-row CTA, so x is read a third as often.
    "wide-split": [Tactic(48, 64, 16, s, x_via_l1=False, split_k=k) for s, k in ((3, 7), (3, 14), (3, 28), (2, 28),
                                                                              (2, 56))],
}
FAB_TACTICS = [t for spec in sys.argv[2].split(",")
               for t in (FAB_TACTICS[spec] if spec in FAB_TACTICS else [parse_tactic(spec, 16)])]
FB_TACTICS = ([parse_tactic(spec, 16) for spec in sys.argv[3].split(",")] if len(sys.argv) > 3
              else [default_tactic(g.local_width, g.head_dim, 16)])
if len(sys.argv) > 4:
    cute.add_tactics({("qkvg", g.qkvg_rows, g.hidden_size, 16): parse_tactic(sys.argv[4], 16)})
for tactic, fb in ((t, f) for t in FAB_TACTICS for f in FB_TACTICS):
    cute.add_tactics({("fab", g.fab_rows, g.hidden_size, 16): tactic, ("fb", g.local_width, g.head_dim, 16): fb})
    ctas = g.fab_rows // tactic.block_n * tactic.split_k
    for m in ms:
        try:
            ovl = time_step(weights, OVERLAP_CUTE, m) * 1e6
            alone = time_tactic(weights, "fab", tactic, m) * 1e6
            print(f"fab={tactic.key():18} CTAs={ctas:3} fb={fb.key():16} M={m:2}: overlapped stage {ovl:6.2f} us, "
                  f"F_A/beta alone {alone:6.2f} us", flush=True)
        except Exception as exc:
            print(f"fab={tactic.key()} fb={fb.key()} M={m}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
