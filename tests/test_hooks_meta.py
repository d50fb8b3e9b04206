"""Keeps the hook specification honest: every hook documented with its exact signature and tested."""

import inspect
import re
from pathlib import Path

from kda_backend import hookspecs

ROOT = Path(__file__).resolve().parents[1]


def _hook_names():
    """Every function the spec module marks as a hook specification, whatever its name."""
    return sorted(n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), "kda_backend_spec", None) is not None)


def _signature_text(name):
    sig = inspect.signature(getattr(hookspecs, name))
    return f"{name}{sig}".replace("'", "")


def test_hooks_exist_and_carry_prefix():
    names = _hook_names()
    assert names, "no hooks found"
    for name in names:
        assert name.startswith("kda_"), name


def test_every_hook_documented_with_exact_signature():
    doc = (ROOT / "docs" / "hooks.md").read_text().replace("\\|", "|")
    for name in _hook_names():
        assert f"`{_signature_text(name)}`" in doc, f"docs/hooks.md lacks the exact signature of {name}"


def test_every_hook_has_docstring_with_params_and_returns():
    for name in _hook_names():
        fn = getattr(hookspecs, name)
        doc = inspect.getdoc(fn) or ""
        assert ":returns:" in doc, name
        for param in inspect.signature(fn).parameters:
            assert f":param {param}:" in doc, f"{name} does not document {param}"


def test_every_hook_has_a_test():
    tests = "".join(p.read_text() for p in (ROOT / "tests").glob("test_*.py") if p.name != Path(__file__).name)
    for name in _hook_names():
        assert re.search(rf"def test_{name}\w*\(", tests), f"no test named test_{name}*"
