"""A projection plan: per token count M, overlapped or sequential, and which provider serves each GEMM.

A plan covers M = 1..``max_m``; beyond it (or for an M it has no step for) the safe default applies: sequential,
providers chosen automatically by :mod:`kda_backend.dispatch`. ``"auto"`` as a provider name means the same.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kda_backend.providers.base import ROLES

AUTO = "auto"


@dataclasses.dataclass(frozen=True)
class Step:
    """What the projection does for one M."""

    overlap: bool = False
    qkvg: str = AUTO
    fab: str = AUTO
    fb: str = AUTO

    def provider(self, role: str) -> str:
        return getattr(self, role)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Step:
        unknown = set(data) - {"overlap", *ROLES}
        if unknown:
            raise ValueError(f"plan step has unknown fields {sorted(unknown)}")
        return cls(
            overlap=bool(data.get("overlap", False)),
            **{r: str(data.get(r, AUTO)) for r in ROLES},
        )


DEFAULT_STEP = Step()


@dataclasses.dataclass(frozen=True)
class Plan:
    """``steps[m]`` for the M values the plan was made for; :meth:`step` answers for any M."""

    steps: dict[int, Step] = dataclasses.field(default_factory=dict)
    source: str = "default"

    def step(self, m: int) -> Step:
        return self.steps.get(m, DEFAULT_STEP)

    @property
    def max_m(self) -> int:
        return max(self.steps, default=0)

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "steps": {str(m): s.to_json() for m, s in sorted(self.steps.items())}}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Plan:
        steps = {int(m): Step.from_json(s) for m, s in data["steps"].items()}
        if any(m <= 0 for m in steps):
            raise ValueError("plan steps must be for M >= 1")
        return cls(steps=steps, source=str(data.get("source", "file")))

    @classmethod
    def uniform(cls, max_m: int, step: Step, source: str = "forced") -> Plan:
        return cls(steps={m: step for m in range(1, max_m + 1)}, source=source)
