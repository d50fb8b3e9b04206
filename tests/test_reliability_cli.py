"""Reliability, the command line: every user error exits with status 2 and one line on stderr naming the input, the
value and what is accepted (never a traceback), and arguments are checked before any GPU work; ``doctor`` reports a
misconfigured machine instead of failing. The README's reliability table lists these cases.
"""

import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch

from kda_backend.cli import main

ACCEPTED_RESULTS = "accepted: a bench.json written by kda-backend bench"
GOOD_RESULTS = {"device": "X", "geometry": {"tp_size": 8}, "rows": [{"m": 1, "floor": 21.3, "ours": 21.5}]}


def _one_line_exit_2(argv, capsys):
    """Run the CLI; assert exit status 2, nothing on stdout, exactly one line on stderr, and return that line."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    lines = err.splitlines()
    assert len(lines) == 1, err
    return lines[0]


PLOT_CASES = {
    "missing": (None, "{p}: no such file; " + ACCEPTED_RESULTS),
    "empty": ("", "{p}: empty file; " + ACCEPTED_RESULTS),
    "malformed": ('{"rows": [', "{p}: not JSON (Expecting value: line 1 column 11 (char 10)); " + ACCEPTED_RESULTS),
    "a-list": ("[]", "{p}: not an object; " + ACCEPTED_RESULTS),
    "no-rows": (json.dumps({**GOOD_RESULTS, "rows": []}), "{p}: no non-empty 'rows' list; " + ACCEPTED_RESULTS),
    "row-without-m": (json.dumps({**GOOD_RESULTS, "rows": [{"floor": 1.0}]}),
                      "{p}: rows[0] has no positive integer 'm' and number 'floor'; " + ACCEPTED_RESULTS),
    "no-geometry": (json.dumps({k: v for k, v in GOOD_RESULTS.items() if k != "geometry"}),
                    "{p}: no 'geometry' with an integer 'tp_size'; " + ACCEPTED_RESULTS),
}


@pytest.mark.parametrize("case", list(PLOT_CASES), ids=[f"cli-plot-{c}" for c in PLOT_CASES])
def test_plot_refuses_a_bad_results_file_in_one_line(case, tmp_path, capsys):
    content, message = PLOT_CASES[case]
    path = tmp_path / "bench.json"
    if content is not None:
        path.write_text(content)
    assert _one_line_exit_2(["plot", str(path)], capsys) == f"kda-backend plot: {message.format(p=path)}"


def test_plot_into_a_target_that_cannot_be_written_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(GOOD_RESULTS))
    (tmp_path / "bench.png").mkdir()
    line = _one_line_exit_2(["plot", str(path)], capsys)
    assert line == f"kda-backend plot: cannot write {tmp_path / 'bench.png'}: Is a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_plot_into_a_read_only_folder_is_one_line(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(GOOD_RESULTS))
    tmp_path.chmod(0o555)
    try:
        line = _one_line_exit_2(["plot", str(path)], capsys)
    finally:
        tmp_path.chmod(0o755)
    assert line == f"kda-backend plot: cannot write {tmp_path / 'bench.png'}: Permission denied"


def test_plot_refused_by_the_file_system_is_one_line(tmp_path, capsys, monkeypatch):
    """What a read-only folder gives the plot, also where the tests run as root (who may write anywhere)."""
    from kda_backend import bench

    def refused(results, path):
        raise PermissionError(13, "Permission denied", str(path))

    path = tmp_path / "bench.json"
    path.write_text(json.dumps(GOOD_RESULTS))
    monkeypatch.setattr(bench, "write_plot", refused)
    line = _one_line_exit_2(["plot", str(path)], capsys)
    assert line == f"kda-backend plot: cannot write {tmp_path / 'bench.png'}: Permission denied"


def test_plot_without_matplotlib_is_one_line(tmp_path, capsys, monkeypatch):
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(GOOD_RESULTS))
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert _one_line_exit_2(["plot", str(path)], capsys) == (
        "kda-backend plot: matplotlib is not installed; accepted: `pip install matplotlib` first")


@pytest.fixture
def gpu_machine(monkeypatch):
    """A machine that says it has CUDA, where any measurement fails the test: arguments must be refused first."""

    def no_gpu_work(*args, **kwargs):
        raise AssertionError("GPU work started before the arguments were checked")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr("kda_backend.bench.run_bench", no_gpu_work)
    monkeypatch.setattr("kda_backend.autotune.autotune", no_gpu_work)


TP7 = ("--tp 7: tp_size=7 does not divide num_heads=96; valid tp sizes: [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96]")


@pytest.mark.parametrize("command", ["bench", "autotune"], ids=lambda c: f"cli-{c}-tp7")
def test_tp_that_does_not_divide_the_heads_is_refused_before_gpu_work(command, gpu_machine, capsys):
    assert _one_line_exit_2([command, "--tp", "7"], capsys) == f"kda-backend {command}: {TP7}"


ARGUMENT_CASES = {
    "bench-ms-zero": (["bench", "--ms", "0"], "kda-backend bench: error: argument --ms: '0': accepted: "
                                              "comma-separated integers >= 1"),
    "bench-ms-word": (["bench", "--ms", "1,x"], "kda-backend bench: error: argument --ms: '1,x': accepted: "
                                                "comma-separated integers >= 1"),
    "bench-ms-empty": (["bench", "--ms", ","], "kda-backend bench: error: argument --ms: ',': accepted: "
                                               "comma-separated integers >= 1"),
    "bench-tp-zero": (["bench", "--tp", "0"], "kda-backend bench: error: argument --tp: '0': accepted: an integer "
                                              ">= 1"),
    "autotune-tp-word": (["autotune", "--tp", "x"], "kda-backend autotune: error: argument --tp: 'x': accepted: an "
                                                    "integer >= 1"),
    "autotune-max-m-zero": (["autotune", "--max-m", "0"], "kda-backend autotune: error: argument --max-m: '0': "
                                                          "accepted: an integer >= 1"),
    "autotune-max-m-above": (["autotune", "--max-m", "300"], "kda-backend autotune: error: argument --max-m: '300': "
                                                             "accepted: an integer from 1 to 256 (the largest M a "
                                                             "plan tunes)"),
    "bench-preset": (["bench", "--preset", "kimi-k4"], "kda-backend bench: error: argument --preset: invalid choice: "
                                                       "'kimi-k4' (choose from 'kimi-k3')"),
    "autotune-engine": (["autotune", "--engine", "trt"], "kda-backend autotune: error: argument --engine: invalid "
                                                         "choice: 'trt' (choose from 'vllm', 'sglang', 'all')"),
    "unknown-command": (["tune"], "kda-backend: error: argument command: invalid choice: 'tune' (choose from "
                                  "'doctor', 'autotune', 'bench', 'plot')"),
    "no-command": ([], "kda-backend: error: the following arguments are required: command"),
}


@pytest.mark.parametrize("case", list(ARGUMENT_CASES), ids=[f"cli-{c}" for c in ARGUMENT_CASES])
def test_bad_arguments_are_one_line(case, gpu_machine, capsys):
    argv, line = ARGUMENT_CASES[case]
    assert _one_line_exit_2(argv, capsys) == line


def test_bench_out_that_is_a_file_is_refused_before_gpu_work(tmp_path, gpu_machine, capsys):
    out = tmp_path / "results"
    out.write_text("")
    assert _one_line_exit_2(["bench", "--out", str(out)], capsys) == (
        f"kda-backend bench: --out {out}: not a folder; accepted: a folder (created if missing)")


def test_autotune_with_a_cache_folder_that_cannot_be_one_is_refused_before_tuning(tmp_path, gpu_machine, capsys,
                                                                                 monkeypatch):
    cache = tmp_path / "cache"
    cache.symlink_to(tmp_path / "nowhere")
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(cache))
    assert _one_line_exit_2(["autotune"], capsys) == (
        f"kda-backend autotune: cache folder {cache} from KDA_BACKEND_CACHE_DIR={str(cache)!r}: {cache} is a "
        f"symbolic link to {str(tmp_path / 'nowhere')!r}, which does not exist; accepted: a folder, or a path where "
        "one can be created")


def test_console_script_prints_no_traceback():
    """The installed entry point end to end, in a fresh process."""
    proc = subprocess.run([sys.executable, "-m", "kda_backend", "bench", "--tp", "7"], capture_output=True, text=True)
    assert (proc.returncode, proc.stdout, proc.stderr) == (2, "", f"kda-backend bench: {TP7}\n")


def test_doctor_reports_engines_and_providers_truthfully(capsys):
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for engine, info in report["engines"].items():
        installed = importlib.util.find_spec(engine) is not None and info["version"] is not None
        ours = any(ep.name == "kda_backend" for ep in md.entry_points(group=info["entry_point_group"]))
        assert info["plugin_discoverable"] is (installed and ours), engine
    flashinfer = importlib.util.find_spec("flashinfer") is not None
    assert ("flashinfer" in report["providers"]) is flashinfer
    assert report["providers_unavailable"] == ({} if flashinfer else {"flashinfer": "flashinfer-python is not "
                                                                                    "installed"})
    assert main(["doctor"]) == 0
    table = capsys.readouterr().out
    for engine, info in report["engines"].items():
        if info["version"] is None:
            assert re.search(rf"^{engine} +not installed$", table, re.M), engine


def test_doctor_on_a_misconfigured_machine_reports_instead_of_failing(tmp_path, capsys, monkeypatch):
    cache = tmp_path / "cache"
    cache.write_text("")
    plan = tmp_path / "missing.json"
    for name, value in (("KDA_BACKEND_CACHE_DIR", str(cache)), ("KDA_BACKEND_AUTOTUNE", "2"),
                        ("KDA_BACKEND_PROVIDER", "cute,torch"), ("KDA_BACKEND_PROVIDERS", "torch"),
                        ("KDA_BACKEND_PLAN", str(plan))):
        monkeypatch.setenv(name, value)
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cache"]["error"] == (f"cache folder {cache} from KDA_BACKEND_CACHE_DIR={str(cache)!r}: {cache} is "
                                        "not a folder; accepted: a folder, or a path where one can be created")
    assert sorted(report["environment"]) == ["KDA_BACKEND_AUTOTUNE", "KDA_BACKEND_PLAN", "KDA_BACKEND_PROVIDER",
                                             "KDA_BACKEND_PROVIDERS"]
    assert report["environment"]["KDA_BACKEND_PLAN"] == (
        f"KDA_BACKEND_PLAN={str(plan)!r}: no such file; accepted: 'sequential', 'overlap' or the path of a plan file "
        "written by `kda-backend autotune`")
    assert report["environment"]["KDA_BACKEND_AUTOTUNE"] == (
        "KDA_BACKEND_AUTOTUNE='2': not a boolean; accepted: 1, true, yes, on or 0, false, no, off (any case)")
