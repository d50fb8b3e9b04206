"""A projection plan: per token count M, fused, overlapped or sequential, and which provider serves each GEMM.

A plan has steps for the M values it was tuned for. An M between two tuned ones borrows the step of the next larger
tuned M: its kernels were tuned for at least as many tokens (the CuTe tactics come in buckets of M that the larger
M's bucket covers), and both engines pad a batch up to the next captured size anyway, so that step is the one that
runs. Above the largest tuned M the plan's ``fallback`` step serves a standalone projection (by default sequential
with providers chosen automatically by :mod:`kda_backend.dispatch`; ``"auto"`` as a provider name means the same);
an engine adapter keeps the engine's own path there (:meth:`Plan.covers`).

Plans arrive from files, from the environment and from other ranks (``kda_share_plan``), so :meth:`Plan.from_json`
and :meth:`Step.from_json` read a typed schema: an unknown field, a value of the wrong JSON type (``"false"`` for a
bool, ``5`` for a provider name), an M that is not a positive integer, or (given the registered names) a provider
that is not registered raises :class:`PlanError` naming the field, the value and what is accepted.

A plan carries the CuTe tactics it was tuned with (:data:`TacticTable`); the projection hands each GEMM call its
tactic (:meth:`Plan.tactic_for`), so two plans in one process never share tuning state. In JSON the tactics are a
list beside the plan object (:meth:`Plan.to_document`).
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections.abc import Collection
from typing import Any

from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.kernels.tactics import BUCKETS, SINGLE_TOKEN_BUCKET, AnyTactic, tactic_bucket, validate_any
from kda_backend.kernels.wgmma_gemm import WgmmaTactic
from kda_backend.providers.base import ROLES

AUTO = "auto"
STEP_FIELDS = ("overlap", *ROLES, "fused")
PLAN_FIELDS = ("source", "fallback", "steps")
_M_KEY = re.compile(r"[1-9][0-9]*")
TACTIC_ROW_FIELDS = ("role", "n", "k", "bucket", "tactic")
# A tactic's JSON object names its kernel family in this field ("mma": the skinny kernel's Tactic, the default).
KERNEL_FIELD = "kernel"
TACTIC_CLASSES = {"mma": Tactic, "wgmma": WgmmaTactic}
# Family -> field -> JSON type, from the dataclass defaults (every field is an int or a bool).
TACTIC_FIELDS = {
    family: {f.name: type(f.default) for f in dataclasses.fields(cls)} for family, cls in TACTIC_CLASSES.items()
}
# (role, n, k, bucket) -> tactic; ``bucket`` is :func:`~kda_backend.kernels.tactics.tactic_bucket`.
TacticTable = dict[tuple[str, int, int, int], AnyTactic]


class PlanError(ValueError):
    """Plan data that does not follow the schema; the message names the field, the value and what is accepted."""


def json_type(value: Any) -> str:
    """The JSON name of ``value``'s type, for messages."""
    names = {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def require_object(where: str, data: Any, fields: Collection[str]) -> dict[str, Any]:
    """``data`` as an object whose keys are all in ``fields``, else :class:`PlanError`."""
    if not isinstance(data, dict):
        raise PlanError(f"{where}: {json_type(data)}; accepted: an object with fields {', '.join(fields)}")
    unknown = sorted(str(k) for k in data if k not in fields)
    if unknown:
        raise PlanError(f"{where}: unknown fields {unknown}; accepted: {', '.join(fields)}")
    return data


def tactic_to_json(tactic: AnyTactic) -> dict[str, Any]:
    """The tactic's fields; a ``wgmma`` tactic also names its family."""
    data = dataclasses.asdict(tactic)
    return {KERNEL_FIELD: "wgmma", **data} if isinstance(tactic, WgmmaTactic) else data


def tactics_to_json(tactics: TacticTable) -> list[dict[str, Any]]:
    return [
        {"role": r, "n": n, "k": k, "bucket": bucket, "tactic": tactic_to_json(t)}
        for (r, n, k, bucket), t in sorted(tactics.items(), key=lambda item: item[0])
    ]


def _positive_int(where: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise PlanError(f"{where}: {value!r} is {json_type(value)}; accepted: a positive integer")
    return value


def tactic_from_json(data: Any, n: int, k: int, where: str = "tactic") -> AnyTactic:
    """A tactic from its JSON object: ``kernel`` (``"mma"``, the default, or ``"wgmma"``), then integer and bool
    fields of that family's tactic class (missing ones take their defaults), which the kernel accepts for an
    ``[n, k]`` weight.

    :raises PlanError: an unknown family, an unknown or ill-typed field, or a tactic the kernel cannot run.
    """
    family = data.get(KERNEL_FIELD, "mma") if isinstance(data, dict) else "mma"
    if not isinstance(family, str) or family not in TACTIC_CLASSES:
        raise PlanError(f"{where}.{KERNEL_FIELD}: {family!r}; accepted: {', '.join(map(repr, TACTIC_CLASSES))}")
    fields = TACTIC_FIELDS[family]
    data = dict(require_object(where, data, (KERNEL_FIELD, *fields)))
    data.pop(KERNEL_FIELD, None)
    for field, value in data.items():
        kind = fields[field]
        if type(value) is not kind:
            accepted = "true or false" if kind is bool else "an integer"
            raise PlanError(f"{where}.{field}: {value!r} is {json_type(value)}; accepted: {accepted}")
    tactic = TACTIC_CLASSES[family](**data)
    reason = validate_any(tactic, n, k, k)
    if reason is not None:
        raise PlanError(f"{where}: {reason}")
    return tactic


def tactics_from_json(rows: Any, where: str = "tactics") -> TacticTable:
    """The tactic table from :func:`tactics_to_json`'s rows.

    :raises PlanError: a row that is not an object of the fields below, or an invalid tactic.
    """
    if not isinstance(rows, list):
        raise PlanError(f"{where}: {json_type(rows)}; accepted: a list of objects")
    table: TacticTable = {}
    for i, row in enumerate(rows):
        at = f"{where}[{i}]"
        row = require_object(at, row, TACTIC_ROW_FIELDS)
        role = row.get("role")
        if role not in ROLES:
            raise PlanError(f"{at}.role: {role!r}; accepted: {', '.join(ROLES)}")
        n, k = _positive_int(f"{at}.n", row.get("n")), _positive_int(f"{at}.k", row.get("k"))
        bucket = row.get("bucket")
        if isinstance(bucket, bool) or bucket not in BUCKETS:
            raise PlanError(f"{at}.bucket: {bucket!r}; accepted: {', '.join(map(str, BUCKETS))}")
        table[(role, n, k, bucket)] = tactic_from_json(row.get("tactic"), n, k, f"{at}.tactic")
    return table


@dataclasses.dataclass(frozen=True)
class Step:
    """What the projection does for one M.

    :param overlap: run the F_A/beta -> F_B chain beside QKVG: forked onto an aux stream where the host allows a
        fork, else trailing QKVG's launch on its stream where the provider can (the same bits either way); else the
        three GEMMs run one after another.
    :param fused: run the whole stage as one launch of the provider that serves all three GEMMs
        (:meth:`~kda_backend.providers.base.GemmProvider.fused_launcher`), with or without a fork; where it cannot
        (one warning) the step runs as ``overlap`` says.
    """

    overlap: bool = False
    qkvg: str = AUTO
    fab: str = AUTO
    fb: str = AUTO
    fused: bool = False

    @property
    def mode(self) -> str:
        return "fused" if self.fused else "overlap" if self.overlap else "sequential"

    def provider(self, role: str) -> str:
        return getattr(self, role)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any, providers: Collection[str] | None = None, where: str = "step") -> Step:
        """A step from its JSON object: ``overlap`` and ``fused`` JSON bools, each role a provider name (missing
        fields take their defaults).

        :param providers: the registered provider names; ``None`` accepts any non-empty name.
        :param where: how messages name this step (e.g. ``steps['4']``).
        :raises PlanError: an unknown or ill-typed field, or a provider that is not registered.
        """
        data = require_object(where, data, STEP_FIELDS)
        flags = {}
        for flag in ("overlap", "fused"):
            value = flags[flag] = data.get(flag, False)
            if not isinstance(value, bool):
                raise PlanError(f"{where}.{flag}: {value!r} is {json_type(value)}; accepted: true or false")
        names = {}
        for role in ROLES:
            name = data.get(role, AUTO)
            named = f" ({', '.join(sorted(providers))})" if providers else ""
            accepted = f"{AUTO!r} or a registered provider{named}"
            if not isinstance(name, str) or not name:
                raise PlanError(f"{where}.{role}: {name!r} is {json_type(name)}; accepted: {accepted}")
            if providers is not None and name != AUTO and name not in providers:
                raise PlanError(f"{where}.{role}: provider {name!r} is not registered; accepted: {accepted}")
            names[role] = name
        return cls(**flags, **names)


DEFAULT_STEP = Step()
# What a standalone projection runs when no tuned plan exists (an engine adapter keeps the engine's own path there,
# see Plan.covers): sequential cuBLAS.
SEQUENTIAL_TORCH = Step(overlap=False, qkvg="torch", fab="torch", fb="torch")


@dataclasses.dataclass(frozen=True)
class Plan:
    """``steps[m]`` for the M values the plan was made for; :meth:`step` answers for any M. ``tactics``: the CuTe
    tactics tuned with it (empty: the kernel's defaults)."""

    steps: dict[int, Step] = dataclasses.field(default_factory=dict)
    source: str = "default"
    fallback: Step = DEFAULT_STEP
    tactics: TacticTable = dataclasses.field(default_factory=dict)

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

    def covers(self, m: int) -> bool:
        """Whether a step of the plan serves ``m`` tokens (tuned for it, or borrowed from a larger tuned M), not the
        fallback: where none does (no tuned plan, or M above the largest tuned one) an engine adapter keeps the
        engine's own path for the call, whose speed the plan was never measured against there."""
        return m <= self.max_m

    def tactic_for(self, role: str, n: int, k: int, m: int) -> AnyTactic | None:
        """The tuned tactic of ``role``'s ``[n, k]`` GEMM at ``m`` tokens: its bucket's, else (no single-token
        tactic tuned) the 16-token bucket's; ``None``: the kernel's default."""
        for bucket in (SINGLE_TOKEN_BUCKET, 16) if m == 1 else (tactic_bucket(m),):
            tuned = self.tactics.get((role, n, k, bucket))
            if tuned is not None:
                return tuned
        return None

    def to_document(self) -> dict[str, Any]:
        """``{"plan": to_json(), "tactics": rows}``: what plan files and ranks carry (see :meth:`from_document`)."""
        return {"plan": self.to_json(), "tactics": tactics_to_json(self.tactics)}

    @classmethod
    def from_document(cls, data: dict[str, Any], providers: Collection[str] | None = None) -> Plan:
        """A plan from :meth:`to_document`'s fields (missing tactics: none).

        :raises PlanError: either field outside the schema.
        """
        plan = cls.from_json(data.get("plan"), providers)
        return dataclasses.replace(plan, tactics=tactics_from_json(data.get("tactics", [])))

    def to_json(self) -> dict[str, Any]:
        """The steps (the tactics travel beside them, see :meth:`to_document`)."""
        return {
            "source": self.source,
            "fallback": self.fallback.to_json(),
            "steps": {str(m): s.to_json() for m, s in sorted(self.steps.items())},
        }

    @classmethod
    def from_json(cls, data: Any, providers: Collection[str] | None = None, where: str = "plan") -> Plan:
        """A plan from :meth:`to_json`'s data: ``steps`` an object keyed by M (positive integers, as JSON object
        keys), ``fallback`` a step, ``source`` a string.

        :param providers: the registered provider names; ``None`` accepts any non-empty name.
        :param where: how messages name this plan.
        :raises PlanError: an unknown, missing or ill-typed field.
        """
        data = require_object(where, data, PLAN_FIELDS)
        if "steps" not in data:
            raise PlanError(f"{where}: no 'steps'; accepted: an object with fields {', '.join(PLAN_FIELDS)}")
        raw = data["steps"]
        if not isinstance(raw, dict):
            raise PlanError(f"{where}.steps: {json_type(raw)}; accepted: an object keyed by M (\"1\", \"2\", ...)")
        steps = {}
        for m, step in raw.items():
            if not (isinstance(m, int) and not isinstance(m, bool) and m > 0) and not (
                isinstance(m, str) and _M_KEY.fullmatch(m)
            ):
                raise PlanError(f"{where}.steps: key {m!r} is not an M; accepted: positive integers (\"1\", \"16\")")
            steps[int(m)] = Step.from_json(step, providers, f"{where}.steps[{str(m)!r}]")
        fallback = (Step.from_json(data["fallback"], providers, f"{where}.fallback") if "fallback" in data
                    else DEFAULT_STEP)
        source = data.get("source", "file")
        if not isinstance(source, str):
            raise PlanError(f"{where}.source: {source!r} is {json_type(source)}; accepted: a string")
        return cls(steps=steps, source=source, fallback=fallback)

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


# The plan of sequential cuBLAS at every M: the engines' own eager path, which a tuned step must beat.
SEQUENTIAL_CUBLAS = Plan(fallback=SEQUENTIAL_TORCH)


def _describe_run(ms: list[int], step: Step) -> str:
    label = "fallback" if not ms else (f"M {ms[0]}" if len(ms) == 1 else f"M {ms[0]}-{ms[-1]}")
    return f"{label:>10}: {step.mode:<10} qkvg={step.qkvg} fab={step.fab} fb={step.fb}"
