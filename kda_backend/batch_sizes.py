"""The decode batch sizes (tokens per step, M) each engine captures in CUDA graphs by default: what plans are
tuned for and what ``kda-backend bench`` measures. Data only; an adapter passes its engine's actual list.

- vLLM 0.33: ``[1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16)``.
- SGLang 0.5.23: ``[1, 2, 4, 8, 12] + range(16, 257, 8) + range(272, max + 1, 16)``; with speculative decoding
  ``1..8, 10..32 step 2, 40..64 step 4, 72..256 step 8``.
"""

from __future__ import annotations

from collections.abc import Iterable

# Plans are tuned up to here; larger batches run the plan's fallback (sequential cuBLAS, the engines' own path).
MAX_TUNED_M = 256

VLLM = (1, 2, 4, *range(8, 256, 8), *range(256, MAX_TUNED_M + 1, 16))
SGLANG = (1, 2, 4, 8, 12, *range(16, MAX_TUNED_M + 1, 8))
SGLANG_SPECULATIVE = (*range(1, 9), *range(10, 33, 2), *range(40, 65, 4), *range(72, MAX_TUNED_M + 1, 8))

ENGINES = {"vllm": VLLM, "sglang": (*SGLANG, *SGLANG_SPECULATIVE)}


def engine_batch_sizes(engine: str, max_m: int = MAX_TUNED_M) -> tuple[int, ...]:
    """The sorted default batch sizes of ``engine`` (``vllm``, ``sglang`` or ``all``) up to ``max_m``.

    :raises ValueError: an unknown engine name.
    """
    if engine == "all":
        sizes = {m for ms in ENGINES.values() for m in ms}
    elif engine in ENGINES:
        sizes = set(ENGINES[engine])
    else:
        raise ValueError(f"engine {engine!r}: not one of {sorted([*ENGINES, 'all'])}")
    return tuple(sorted(m for m in sizes if m <= max_m))


def spans(ms: Iterable[int]) -> str:
    """Sorted integers with consecutive runs joined: ``[1, 2, 3, 5]`` -> ``"1-3, 5"``."""
    runs: list[list[int]] = []
    for m in ms:
        if runs and m == runs[-1][-1] + 1:
            runs[-1].append(m)
        else:
            runs.append([m])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)
