"""A projection plan: per token count M, overlapped or sequential, and which provider serves each GEMM.

A plan has steps for the M values it was tuned for. An M between two tuned ones borrows the step of the next larger
tuned M: its kernels were tuned for at least as many tokens (the CuTe tactics come in buckets of M that the larger
M's bucket covers), and both engines pad a batch up to the next captured size anyway, so that step is the one that
runs. Above the largest tuned M the plan's ``fallback`` step serves (by default sequential with providers chosen
automatically by :mod:`kda_backend.dispatch`; ``"auto"`` as a provider name means the same).
"""

from __future__ import annotations

import bisect
import dataclasses
from typing import Any

from kda_backend.providers.base import ROLES

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Step:
    """What the projection does for one M.

    :param overlap: run the F_A/beta -> F_B chain beside QKVG: forked onto an aux stream where the host allows a
        fork, else trailing QKVG's launch on its stream where the provider can (the same bits either way); else the
        three GEMMs run one after another.
    """

    overlap: bool = False
    qkvg: str = AUTO
    fab: str = AUTO
    fb: str = AUTO

    @property
    def mode(self) -> str:
        return "overlap" if self.overlap else "sequential"

    def provider(self, role: str) -> str:
        return getattr(self, role)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        unknown = set(data) - {"overlap", *ROLES}
        if unknown:
            raise ValueError(f"plan step has unknown fields {sorted(unknown)}")
        return cls(overlap=bool(data.get("overlap", False)), **{r: str(data.get(r, AUTO)) for r in ROLES})


DEFAULT_STEP = Step()
# What serves when no tuned plan exists: the engines' own sequential cuBLAS path.
SEQUENTIAL_TORCH = Step(overlap=False, qkvg="torch", fab="torch", fb="torch")


@dataclasses.dataclass(frozen=True)
class Plan:
    """``steps[m]`` for the M values the plan was made for; :meth:`step` answers for any M."""

    steps: dict[int, Step] = dataclasses.field(default_factory=dict)
    source: str = "default"
    fallback: Step = DEFAULT_STEP

    def step(self, m: int) -> Step:
        """The step for ``m`` tokens: tuned, else the next larger tuned M's, else the fallback."""
        found = self.steps.get(m)
        if found is not None:
            return found
        tuned = sorted(self.steps)
        i = bisect.bisect_right(tuned, m)
        return self.steps[tuned[i]] if i < len(tuned) else self.fallback

    def tuned(self, m: int) -> bool:
        """Whether the plan has a step tuned for exactly ``m`` tokens."""
        return m in self.steps

    @property
    def max_m(self) -> int:
        return max(self.steps, default=0)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "fallback": self.fallback.to_json(),
            "steps": {str(m): s.to_json() for m, s in sorted(self.steps.items())},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        steps = {int(m): Step.from_json(s) for m, s in data["steps"].items()}
        if any(m <= 0 for m in steps):
            raise ValueError("plan steps must be for M >= 1")
        fallback = Step.from_json(data["fallback"]) if "fallback" in data else DEFAULT_STEP
        return cls(steps=steps, source=str(data.get("source", "file")), fallback=fallback)

    @classmethod
    def uniform(cls, max_m: int, step: Step, source: str = "forced") -> Plan:
        return cls(steps={m: step for m in range(1, max_m + 1)}, source=source)

    def describe(self) -> str:
        """One line per run of equal steps, e.g. ``M 1-16: overlap    qkvg=cute fab=cute fb=cute``."""
        lines, run = [], []
        for m in sorted(self.steps):
            if run and (self.steps[m] != self.steps[run[-1]] or m != run[-1] + 1):
                lines.append(_describe_run(run, self.steps[run[-1]]))
                run = []
            run.append(m)
        if run:
            lines.append(_describe_run(run, self.steps[run[-1]]))
        if self.steps:
            lines.append(f"{'other M':>10}: the next larger tuned M's step; above M {self.max_m}: the fallback")
        lines.append(_describe_run([], self.fallback))
        return "\n".join(lines)


def _describe_run(ms: list[int], step: Step) -> str:
    label = "fallback" if not ms else (f"M {ms[0]}" if len(ms) == 1 else f"M {ms[0]}-{ms[-1]}")
    return f"{label:>10}: {step.mode:<10} qkvg={step.qkvg} fab={step.fab} fb={step.fb}"
