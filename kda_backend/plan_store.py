"""Persisted autotune state: one JSON file per key, written atomically under a file lock.

The key says everything that changes the answer: device name and compute capability, per-rank geometry, dtype,
and the versions of kda-backend, torch and the CuTe DSL. A file whose key differs, or that is corrupt or
truncated, is ignored with one warning (never a crash). Writers take an exclusive ``fcntl`` lock on a sibling
``.lock`` file and replace the JSON with ``os.replace``, so concurrent ranks never leave a torn file; readers take
no lock and write nothing.

File content::

    {"format": 1, "key": {...}, "plan": Plan.to_json(), "tactics": [{"role", "n", "k", "bucket", "tactic"}]}

``bucket`` is :func:`~kda_backend.kernels.skinny_gemm.tactic_bucket`; files written before the single-token bucket
existed call it ``block_t`` (the same values) and still load.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

import kda_backend
from kda_backend.geometry import KDAGeometry
from kda_backend.kernels.skinny_gemm import Tactic
from kda_backend.log import warn_once
from kda_backend.plan import Plan
from kda_backend.plugins import hooks

FORMAT = 1
TacticTable = dict[tuple[str, int, int, int], Tactic]


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def plan_key(geometry: KDAGeometry, device_name: str, capability: tuple[int, int], dtype: torch.dtype) -> dict[str, Any]:
    """Everything that changes a tuned plan."""
    return {
        "device": device_name,
        "capability": list(capability),
        "geometry": geometry.describe(),
        "dtype": str(dtype),
        "kda_backend": kda_backend.__version__,
        "torch": torch.__version__.split("+")[0],
        "cutlass_dsl": _dist_version("nvidia-cutlass-dsl"),
    }


def device_key(geometry: KDAGeometry, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    return plan_key(geometry, torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), dtype)


def plan_path(key: dict[str, Any], folder: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    g = key["geometry"]
    name = f"plan-{key['device'].replace(' ', '_')}-tp{g['tp_size']}-{digest}.json"
    return (folder or hooks.cache_dir()) / name


@contextlib.contextmanager
def _locked(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def tactics_to_json(tactics: TacticTable) -> list[dict[str, Any]]:
    return [
        {"role": r, "n": n, "k": k, "bucket": bucket, "tactic": dataclasses.asdict(t)}
        for (r, n, k, bucket), t in sorted(tactics.items())
    ]


def tactics_from_json(rows: list[dict[str, Any]]) -> TacticTable:
    def bucket(row: dict[str, Any]) -> int:
        return int(row["bucket"] if "bucket" in row else row["block_t"])

    return {(r["role"], int(r["n"]), int(r["k"]), bucket(r)): Tactic(**r["tactic"]) for r in rows}


def save(key: dict[str, Any], plan: Plan, tactics: TacticTable, folder: Path | None = None) -> Path:
    """Write the plan for ``key`` atomically; returns the file path."""
    path = plan_path(key, folder)
    data = {"format": FORMAT, "key": key, "plan": plan.to_json(), "tactics": tactics_to_json(tactics)}
    with _locked(path):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def load_file(path: Path, key: dict[str, Any] | None = None) -> tuple[Plan, TacticTable] | None:
    """Read a plan file; ``None`` (with one warning) if it is unreadable, corrupt or made for another key."""
    try:
        # Writers replace the file atomically, so a reader sees a whole old or a whole new file without the lock
        # (and never writes: a read-only cache folder serves its plans).
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ValueError(f"not a plan file of format {FORMAT}")
        if key is not None and data.get("key") != key:
            mismatched = sorted(k for k in key if data.get("key", {}).get(k) != key[k])
            warn_once(f"plan-mismatch-{path}", f"ignoring plan {path}: made for another {', '.join(mismatched)}")
            return None
        return Plan.from_json(data["plan"]), tactics_from_json(data.get("tactics", []))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        warn_once(f"plan-corrupt-{path}", f"ignoring unreadable plan {path}: {type(exc).__name__}: {exc}")
        return None


def load(key: dict[str, Any], folder: Path | None = None) -> tuple[Plan, TacticTable] | None:
    """The stored plan for ``key`` or ``None``."""
    return load_file(plan_path(key, folder), key)
