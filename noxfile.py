"""Test environments. `nox` runs them all; CI runs exactly that (see README.md and .ci/run)."""

import sys

import nox

nox.options.sessions = ["core", "vllm", "sglang", "parity"]
nox.options.reuse_venv = "yes"

# Every session runs on the interpreter that runs nox (the project needs Python >= 3.11): a machine without a
# particular minor version must still run the tests, and an older interpreter must fail, never skip.
if sys.version_info < (3, 11):
    raise SystemExit(f"kda-backend's tests need Python >= 3.11; nox runs on {sys.version.split()[0]}")

# The CPU build of torch: the engines pin their own torch in their sessions; the core only needs a floor.
CORE_TORCH = "torch==2.13.0"


@nox.session
def core(session: nox.Session) -> None:
    """The core package on the CPU: geometry, hooks, reference, dispatch, CLI, CuTe DSL compile checks."""
    session.install(CORE_TORCH)
    session.install("-e", ".[test,bench]")
    session.run("pytest", *session.posargs)


@nox.session
def vllm(session: nox.Session) -> None:
    """The vLLM adapter against the real vllm==0.33 on the CPU, in its own environment (vLLM pins torch)."""
    session.install("vllm==0.33.0")
    session.install("-e", ".[test]")
    session.run("pytest", "tests/engines/test_vllm_adapter.py", "tests/engines/test_tp_processes.py",
                *session.posargs)


@nox.session
def sglang(session: nox.Session) -> None:
    """The SGLang adapter against the real sglang==0.5.23 on the CPU, in its own environment (SGLang pins torch)."""
    session.install("sglang==0.5.23")
    session.install("-e", ".[test]")
    session.run(
        "pytest", "tests/engines/test_sglang_adapter.py", "tests/engines/test_tp_processes.py", *session.posargs
    )


@nox.session
def parity(session: nox.Session) -> None:
    """Cross-engine parity: compares what the `vllm` and `sglang` sessions wrote with the core (run them first)."""
    session.install(CORE_TORCH)
    session.install("-e", ".[test]")
    session.run("pytest", "tests/engines/test_cross_engine_parity.py", "-s", *session.posargs)
