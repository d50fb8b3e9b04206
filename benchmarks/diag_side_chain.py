"""Diagnostic: the F_A/beta tactic inside the overlapped stage (TP8), with the default 64 KB QKVG tactic.

The autotuner picks F_A/beta's tactic by timing it alone, where split-K (many small CTAs, then a reduction) wins;
beside QKVG what matters is how much the side chain slows QKVG down. Prints, per F_A/beta tactic and M, the
overlapped stage, F_A/beta alone and its CTA count.

Usage (GPU machine): python benchmarks/diag_side_chain.py 1,16 split,whole-k,fine-split
"""

import sys

import torch

from kda_backend import dispatch
from kda_backend.autotune import OVERLAP_CUTE, make_weight_copies, time_step, time_tactic
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic

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
}
FAB_TACTICS = [t for group in sys.argv[2].split(",") for t in FAB_TACTICS[group]]
for tactic in FAB_TACTICS:
    cute.add_tactics({("fab", g.fab_rows, g.hidden_size, 16): tactic})
    ctas = g.fab_rows // tactic.block_n * tactic.split_k
    for m in ms:
        try:
            ovl = time_step(weights, OVERLAP_CUTE, m) * 1e6
            alone = time_tactic(weights, "fab", tactic, m) * 1e6
            print(f"fab={tactic.key():18} CTAs={ctas:3} M={m:2}: overlapped stage {ovl:6.2f} us, "
                  f"F_A/beta alone {alone:6.2f} us", flush=True)
        except Exception as exc:
            print(f"fab={tactic.key()} M={m}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
