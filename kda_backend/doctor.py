"""``kda-backend doctor``: what this machine has and whether each engine would find the plugin.

Nothing here imports an engine or a kernel library: versions come from package metadata, so the report is fast
and works on a machine without a GPU. It also works on a misconfigured one: a bad environment variable, a cache
folder that cannot be one, or a plugin that was dropped is reported as a row, never raised.
"""

from __future__ import annotations

import contextlib
import importlib.metadata as md
import importlib.util
import platform
import sys
from pathlib import Path
from typing import Any

import torch

import kda_backend
from kda_backend import env, plugins
from kda_backend.plugins import hooks, plugin_names

ENGINE_ENTRY_POINTS = {"vllm": "vllm.general_plugins", "sglang": "sglang.srt.plugins"}
OPTIONAL_PACKAGES = {
    "cute_dsl": ("nvidia-cutlass-dsl", "cutlass"),
    "fla": ("fla-core", "fla"),
    "flashinfer": ("flashinfer-python", "flashinfer"),
}
# Providers that serve only where an optional package is installed (key of OPTIONAL_PACKAGES).
PROVIDER_PACKAGES = {"cute": "cute_dsl", "flashinfer": "flashinfer"}


def _version(dist: str) -> str | None:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


def _package(dist: str, module: str) -> dict[str, Any]:
    return {"version": _version(dist), "importable": importlib.util.find_spec(module) is not None}


def _cuda() -> dict[str, Any]:
    info: dict[str, Any] = {"torch_cuda": torch.version.cuda, "available": torch.cuda.is_available()}
    if info["available"]:
        info["devices"] = [
            {
                "name": torch.cuda.get_device_name(i),
                "capability": "sm_%d%d" % torch.cuda.get_device_capability(i),
            }
            for i in range(torch.cuda.device_count())
        ]
    return info


def _engines() -> dict[str, Any]:
    engines = {}
    for engine, group in ENGINE_ENTRY_POINTS.items():
        ours = [ep for ep in md.entry_points(group=group) if ep.name == "kda_backend"]
        version = _version(engine)
        engines[engine] = {
            "version": version,
            "entry_point_group": group,
            # An engine that is not installed discovers nothing, whatever this package declares.
            "plugin_discoverable": bool(ours) and version is not None,
            "entry_point": ours[0].value if ours else None,
        }
    return engines


def _cache() -> dict[str, Any]:
    try:
        path = hooks.cache_dir()
    except ValueError as exc:
        return {"dir": None, "exists": False, "plans": [], "kernels": {"versions": 0, "loose": 0, "mb": 0.0},
                "error": str(exc)}
    files = sorted(p.name for p in path.glob("*.json")) if path.is_dir() else []
    return {"dir": str(path), "exists": path.is_dir(), "plans": files, "kernels": _kernels(path / "kernels")}


def _kernels(folder: Path) -> dict[str, Any]:
    """The compiled kernels' object files in ``folder``: how many code versions (subfolders) hold them, how many
    lie outside any (removed 30 days after they were written), and their megabytes (a version no process marked
    used for 30 days is removed at the next use)."""
    sizes: dict[Path, int] = {}
    try:
        paths = [*folder.glob("kda_gemm_*.o"), *folder.glob("*/kda_gemm_*.o")]
    except OSError:  # a folder this user may not read
        paths = []
    for path in paths:
        with contextlib.suppress(OSError):  # removed meanwhile
            sizes[path] = path.stat().st_size
    return {"versions": len({path.parent for path in sizes if path.parent != folder}),
            "loose": sum(path.parent == folder for path in sizes), "mb": round(sum(sizes.values()) / 1e6, 1)}


def _providers(packages: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """Registered providers that can serve on this installation, and why each other one cannot."""
    available, unavailable = [], {}
    for provider in hooks.gemm_providers():
        package = PROVIDER_PACKAGES.get(provider.name)
        if package is None or packages[package]["importable"]:
            available.append(provider.name)
        else:
            unavailable[provider.name] = f"{OPTIONAL_PACKAGES[package][0]} is not installed"
    return available, unavailable


def _environment() -> dict[str, str]:
    """Set ``KDA_BACKEND_*`` variables whose value is refused, with the message using them would give."""
    from kda_backend import dispatch, planning

    problems = env.problems()
    checks = (("KDA_BACKEND_PROVIDER", dispatch.forced_providers), ("KDA_BACKEND_PLAN", planning.forced_plan))
    for name, check in checks:
        try:
            check()
        except ValueError as exc:
            problems[name] = str(exc)
    return problems


def collect() -> dict[str, Any]:
    """The whole report as JSON-compatible data."""
    packages = {key: _package(dist, module) for key, (dist, module) in OPTIONAL_PACKAGES.items()}
    providers, unavailable = _providers(packages)
    return {
        "kda_backend": kda_backend.__version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": _cuda(),
        "packages": packages,
        "engines": _engines(),
        "plugins": plugin_names(),
        "plugins_dropped": plugins.dropped(),
        "providers": providers,
        "providers_unavailable": unavailable,
        "environment": _environment(),
        "cache": _cache(),
    }


def render(report: dict[str, Any]) -> str:
    """A human table of :func:`collect`'s report."""
    rows: list[tuple[str, str]] = [
        ("kda-backend", report["kda_backend"]),
        ("python", report["python"]),
        ("platform", report["platform"]),
        ("torch", f"{report['torch']} (CUDA {report['cuda']['torch_cuda']})"),
    ]
    cuda = report["cuda"]
    if cuda["available"]:
        rows += [(f"gpu {i}", f"{d['name']} {d['capability']}") for i, d in enumerate(cuda["devices"])]
    else:
        rows.append(("gpu", "none (CUDA not available)"))
    for key, pkg in report["packages"].items():
        rows.append((key, pkg["version"] or "not installed"))
    for engine, info in report["engines"].items():
        if info["version"] is None:
            rows.append((engine, "not installed"))
            continue
        found = "plugin discoverable" if info["plugin_discoverable"] else "plugin not registered"
        rows.append((engine, f"{info['version']}; {found} ({info['entry_point_group']})"))
    rows.append(("plugins", ", ".join(report["plugins"])))
    rows += [("plugin dropped", f"{name}: {why}") for name, why in report["plugins_dropped"].items()]
    rows.append(("providers", ", ".join(report["providers"])))
    rows += [("unavailable", f"{name}: {why}") for name, why in report["providers_unavailable"].items()]
    rows += [("env error", message) for message in report["environment"].values()]
    cache = report["cache"]
    plans = ", ".join(cache["plans"]) or "no plans"
    if "error" in cache:
        rows.append(("cache", cache["error"]))
    else:
        rows.append(("cache", f"{cache['dir']} ({plans})" if cache["exists"] else f"{cache['dir']} (absent)"))
        kernels = cache["kernels"]
        loose = f", {kernels['loose']} outside any version" if kernels["loose"] else ""
        rows.append(("kernels", f"{kernels['mb']} MB compiled for {kernels['versions']} code version(s){loose}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
