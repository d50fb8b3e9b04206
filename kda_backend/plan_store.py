"""Persisted autotune state: one JSON file per key, written atomically under a file lock.

The key says everything that changes the answer: device name and compute capability, per-rank geometry, dtype,
and the versions of kda-backend, torch and the CuTe DSL. A file whose key differs, or that is corrupt, truncated or
outside the schema, is ignored with one warning naming the file and the problem (never a crash). Writers take an
exclusive ``fcntl`` lock on a sibling ``.lock`` file (waiting at most :data:`LOCK_TIMEOUT_S`, then a clear error)
and replace the JSON with ``os.replace``, so concurrent ranks never leave a torn file; a writer also removes temp
files that writers killed mid-save left behind. Readers take no lock and write nothing, so a read-only cache folder
serves its plans and a stalled writer never blocks a reader.

File content (every field typed and checked on reading, see :func:`parse`)::

    {"format": 1, "key": {...}, "plan": Plan.to_json(), "tactics": [{"role", "n", "k", "bucket", "tactic"}]}

(``"plan"`` and ``"tactics"`` are :meth:`~kda_backend.plan.Plan.to_document`.)
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata as md
import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import kda_backend
from kda_backend.cache_files import publish, remove_stale_temps
from kda_backend.geometry import KDAGeometry
from kda_backend.log import warn_once
from kda_backend.plan import Plan, PlanError, json_type, require_object
from kda_backend.plugins import folder_problem, hooks, prove_writable

FORMAT = 1
FILE_FIELDS = ("format", "key", "plan", "tactics")
# A writer holds the lock for one small JSON write (milliseconds); one held this long belongs to a stalled process.
LOCK_TIMEOUT_S = 30.0


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def plan_key(
    geometry: KDAGeometry, device_name: str, capability: tuple[int, int], dtype: torch.dtype
) -> dict[str, Any]:
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
    device = re.sub(r"[^A-Za-z0-9_.-]", "_", key["device"])
    return (folder or hooks.cache_dir()) / f"plan-{device}-tp{g['tp_size']}-{digest}.json"


def key_differences(found: dict[str, Any], expected: dict[str, Any], exact: bool = True) -> list[str]:
    """``field: file X, here Y`` for each field ``found`` has otherwise than ``expected`` (nested fields dotted,
    e.g. ``geometry.tp_size``; a missing one is ``None``). ``exact=False`` compares only ``expected``'s fields."""
    fields = list(expected) + ([f for f in found if f not in expected] if exact else [])
    differences = []
    for field in fields:
        value, other = expected.get(field), found.get(field)
        if isinstance(value, dict) and isinstance(other, dict):
            differences += [f"{field}.{d}" for d in key_differences(other, value, exact)]
        elif other != value:
            differences.append(f"{field}: file {other!r}, here {value!r}")
    return differences


@contextlib.contextmanager
def _locked(path: Path, timeout: float):
    """Hold the exclusive lock of ``path``'s writers, waiting at most ``timeout`` seconds."""
    lock_path = path.with_suffix(".lock")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT, 0o644)
    except OSError as exc:
        raise type(exc)(f"cannot store plans in {path.parent}: {exc.strerror}; accepted: a folder this "
                      "process may write (KDA_BACKEND_CACHE_DIR)") from exc
    try:
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"plan store: waited {timeout:g} s for {lock_path}, which another writer holds (a stalled "
                        "process?); the plan was not stored"
                    ) from None
                time.sleep(0.05)
        yield
    finally:
        os.close(fd)  # releases the lock


def provider_names() -> set[str]:
    """Names of the registered GEMM providers (what a plan may name)."""
    return {p.name for p in hooks.gemm_providers()}


def parse(data: Any) -> tuple[dict[str, Any], Plan]:
    """A plan file's content as (key, plan).

    :raises PlanError: any field outside the schema (see the module docstring), a provider that is not registered.
    """
    data = require_object("file", data, FILE_FIELDS)
    if data.get("format") != FORMAT:
        raise PlanError(f"format: {data.get('format')!r}; accepted: {FORMAT}")
    key = data.get("key")
    if not isinstance(key, dict):
        raise PlanError(f"key: {json_type(key)}; accepted: an object (what the plan was tuned for)")
    return key, Plan.from_document(data, provider_names())


def shared_from_json(data: Any) -> Plan:
    """A plan as :func:`~kda_backend.planning.share` passes it between ranks: ``{"plan": ..., "tactics": ...}``.

    :raises PlanError: a missing, unknown or ill-typed field.
    """
    data = require_object("shared plan", data, ("plan", "tactics"))
    if set(data) != {"plan", "tactics"}:
        raise PlanError(f"shared plan: fields {sorted(data)}; accepted: plan and tactics")
    return Plan.from_document(data, provider_names())


def read_file(path: Path) -> tuple[dict[str, Any], Plan]:
    """A plan file as (key, plan), without taking the lock or writing anything: writers replace the file
    atomically, so a reader sees a whole old or a whole new file.

    :raises OSError: the file cannot be read (``FileNotFoundError`` when it does not exist).
    :raises PlanError: it is empty, not JSON or outside the schema.
    """
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise PlanError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise PlanError("empty file")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"not JSON ({exc})") from None
    except RecursionError:
        raise PlanError("JSON nested too deeply to be a plan") from None
    return parse(data)


def check_writable() -> Path:
    """The plan folder (the cache folder), created if missing, after proving a file can be written in it: what a
    caller checks before minutes of tuning whose result it will store.

    :raises ValueError: the folder is a file, a dangling symbolic link or a link loop.
    :raises OSError: it cannot be created or written.
    """
    folder = hooks.cache_dir()
    problem = folder_problem(folder)
    if problem is not None:
        raise ValueError(f"cannot store plans in {folder}: {problem}")
    try:
        prove_writable(folder)
    except OSError as exc:
        raise type(exc)(f"cannot store plans in {folder}: {exc.strerror}; accepted: a folder this "
                      "process may write (KDA_BACKEND_CACHE_DIR)") from exc
    return folder


def save(
    key: dict[str, Any], plan: Plan, folder: Path | None = None, lock_timeout: float = LOCK_TIMEOUT_S
) -> Path:
    """Write the plan (with its tactics) for ``key`` atomically; returns the file path.

    :raises ValueError: the folder is a file, a dangling symbolic link or a link loop.
    :raises OSError: the folder cannot be written; ``TimeoutError`` when another writer holds the lock longer
        than ``lock_timeout`` seconds.
    """
    path = plan_path(key, folder)
    problem = folder_problem(path.parent)
    if problem is not None:
        raise ValueError(f"cannot store plans in {path.parent}: {problem}")
    data = {"format": FORMAT, "key": key, **plan.to_document()}
    with _locked(path, lock_timeout):
        remove_stale_temps(path.parent, "plan-*.json*.tmp")  # of writers killed mid-save
        try:
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        except OSError as exc:
            raise type(exc)(f"cannot store plans in {path.parent}: {exc.strerror}; accepted: a folder this "
                            "process may write (KDA_BACKEND_CACHE_DIR)") from exc
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, sort_keys=True)
            publish(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
    return path


def load_file(path: Path, key: dict[str, Any]) -> Plan | None:
    """Read a plan file made for ``key``; ``None`` (with one warning naming the file and the problem) if it is
    unreadable, outside the schema or made for another key; ``None`` without a warning if it does not exist."""
    try:
        found, plan = read_file(path)
    except FileNotFoundError:
        return None
    except (OSError, PlanError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        warn_once(f"plan-corrupt-{path}", f"ignoring unreadable plan {path}: {reason}")
        return None
    if found != key:
        differences = key_differences(found, key)
        fields = sorted({d.split(":")[0].split(".")[0] for d in differences})
        warn_once(f"plan-mismatch-{path}", f"ignoring plan {path}: made for another {', '.join(fields)} "
                  f"({'; '.join(differences)})")
        return None
    return plan


def load(key: dict[str, Any], folder: Path | None = None) -> Plan | None:
    """The stored plan for ``key`` or ``None``."""
    return load_file(plan_path(key, folder), key)
