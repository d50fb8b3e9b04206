"""Diagnostic behind the QKVG default tactic and ``compile_cache.SMEM_CARVEOUT_PERCENT``: shared memory per QKVG
CTA vs the overlapped stage (TP8), QKVG alone, and the same kernels in sequence.

Without a carveout preference the driver sizes each SM's L1/shared split for the first kernel's occupancy, so some
QKVG CTA sizes leave no room for the side chain's CTAs and the overlap serializes. Every launch now carries the
maximum carveout; the "before" rows in benchmarks/RESULTS.md (2026-11-30) were measured at commit d610c6e, before
that attribute. ``prefer-shared`` sets the process-wide preference instead (the probe that confirmed the cause).

Usage (GPU machine): python benchmarks/diag_qkvg_smem.py 1,16 one-warp,wide,probe [prefer-shared]
"""

import sys

import torch

from kda_backend import dispatch
from kda_backend.autotune import OVERLAP_CUTE, make_weight_copies, time_step, time_tactic
from kda_backend.geometry import preset
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.plan import Step

if len(sys.argv) > 3 and sys.argv[3] == "prefer-shared":
    # Context-wide L1/shared preference (a probe of the carveout explanation, not something the package does).
    from cuda.bindings import runtime as cudart

    torch.cuda.init()
    print("cudaDeviceSetCacheConfig(PreferShared):", cudart.cudaDeviceSetCacheConfig(
        cudart.cudaFuncCache.cudaFuncCachePreferShared))
g = preset("kimi-k3", 8)
weights = make_weight_copies(g, torch.device("cuda"))
cute = dispatch.provider_by_name("cute")
sequential = Step(overlap=False, qkvg="cute", fab="cute", fb="cute")
seq_torch = Step(overlap=False, qkvg="torch", fab="torch", fb="torch")
ms = [int(v) for v in sys.argv[1].split(",")]
for m in ms:
    print(f"M={m:2}: sequential cuBLAS {time_step(weights, seq_torch, m) * 1e6:6.2f} us", flush=True)
TACTICS = {
    "one-warp": [Tactic(16, 256, 16, 4), Tactic(16, 128, 16, 4), Tactic(16, 128, 16, 6), Tactic(16, 128, 16, 7),
                 Tactic(16, 64, 16, 14)],
    "probe": [Tactic(16, 256, 16, 4), Tactic(16, 128, 16, 4), Tactic(16, 128, 16, 6)],
    "wide": [Tactic(32, 256, 16, 3), Tactic(32, 128, 16, 6), Tactic(32, 256, 16, 2), Tactic(64, 256, 16, 2),
             Tactic(32, 512, 16, 2), Tactic(64, 128, 16, 4)],
}
tactics = [t for group in sys.argv[2].split(",") for t in TACTICS[group]]
for tactic in tactics:
    cute.add_tactics({("qkvg", g.qkvg_rows, g.hidden_size, 16): tactic})
    for m in ms:
        try:
            ovl = time_step(weights, OVERLAP_CUTE, m) * 1e6
            seq = time_step(weights, sequential, m) * 1e6
            alone = time_tactic(weights, "qkvg", tactic, m) * 1e6
            print(f"qkvg={tactic.key():14} smem={tactic.smem_bytes() // 1024:3} KB M={m:2}: overlapped {ovl:6.2f} "
                  f"sequential {seq:6.2f} qkvg alone {alone:6.2f} us", flush=True)
        except Exception as exc:
            print(f"{tactic.key()} M={m}: FAILED {type(exc).__name__}: {exc}"[:300], flush=True)
