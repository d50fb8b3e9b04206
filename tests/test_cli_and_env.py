import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kda_backend import env
from kda_backend.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]


def test_doctor_json_reports_machine(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    (tmp_path / "plan-x.json").write_text("{}")
    for version, size in (("0123456789abcdef", 300_000), ("fedcba9876543210", 200_000)):
        (tmp_path / "kernels" / version).mkdir(parents=True)
        (tmp_path / "kernels" / version / "kda_gemm_a.o").write_bytes(bytes(size))
    (tmp_path / "kernels" / "kda_gemm_b.o").write_bytes(bytes(100_000))
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["python"] == sys.version.split()[0]
    assert report["cuda"]["available"] is False or report["cuda"]["devices"]
    assert set(report["packages"]) == {"cute_dsl", "fla", "flashinfer"}
    assert set(report["engines"]) == {"vllm", "sglang"}
    assert report["engines"]["vllm"]["entry_point_group"] == "vllm.general_plugins"
    assert "torch" in report["providers"]
    assert report["cache"] == {"dir": str(tmp_path), "exists": True, "plans": ["plan-x.json"],
                               "kernels": {"versions": 2, "loose": 1, "mb": 0.6}}


def test_doctor_table(capsys):
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for label in ("kda-backend", "torch", "gpu", "cute_dsl", "vllm", "sglang", "providers", "cache", "kernels"):
        assert re.search(rf"^{label}\s", out, re.M), label


def test_console_script_runs_in_subprocess():
    proc = subprocess.run([sys.executable, "-m", "kda_backend", "doctor", "--json"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["kda_backend"]


def test_cli_requires_a_command(capsys):
    with pytest.raises(SystemExit) as caught:
        main([])
    assert caught.value.code == 2 and "the following arguments are required: command" in capsys.readouterr().err


def test_core_imports_no_engine():
    code = (
        "import sys, kda_backend, kda_backend.cli, kda_backend.doctor, kda_backend.reference;"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('vllm', 'sglang')]; print(bad); assert not bad"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_env_table_in_readme_matches_env_module():
    readme = (ROOT / "README.md").read_text()
    assert re.findall(r"^\| `KDA_BACKEND_.*$", readme, re.M) == env.markdown_rows()


def test_every_env_var_read_in_source_is_documented():
    names = {v.name for v in env.ENV_VARS}
    for path in list((ROOT / "kda_backend").rglob("*.py")) + list((ROOT / "adapters").rglob("*.py")):
        for used in re.findall(r"KDA_BACKEND_[A-Z_]+", path.read_text()):
            assert used in names, f"{path.name} uses undocumented {used}"


def test_env_helpers(monkeypatch):
    monkeypatch.setenv("KDA_BACKEND_DISABLE", "Yes")
    assert env.flag("KDA_BACKEND_DISABLE")
    monkeypatch.setenv("KDA_BACKEND_DISABLE", "0")
    assert not env.flag("KDA_BACKEND_DISABLE")
    monkeypatch.setenv("KDA_BACKEND_BLOCK_PLUGINS", " a, ,b ")
    assert env.name_list("KDA_BACKEND_BLOCK_PLUGINS") == ["a", "b"]
    with pytest.raises(KeyError, match="not a documented"):
        env.get("KDA_BACKEND_NOPE")


@pytest.mark.parametrize("command", ["autotune", "bench"])
def test_measuring_commands_fail_clearly_without_cuda(command, capsys, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([command, "--tp", "8"]) == 2
    assert "CUDA is not available" in capsys.readouterr().err


def test_bad_ms_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--ms", "1,x"])
    assert "argument --ms: '1,x': accepted: comma-separated integers >= 1" in capsys.readouterr().err


def test_plot_from_results(tmp_path):
    pytest.importorskip("matplotlib")
    from kda_backend.bench import render_table

    rows = [
        {"m": m, "floor": 21.8, "qkvg_floor": 21.0, "plan": {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute"},
         "seq_cublas": 29.0, "peers": 25.5, "ours": 22.5, "qkvg_cublas": 24.5, "qkvg_cute": 21.9, "qkvg_ctas": 384,
         "fab_cute": 3.0, "fab_ctas": 9, "fb_cute": 2.0, "fb_ctas": 96}
        for m in (1, 2, 4)
    ]
    results = {"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "geometry": {"tp_size": 8}, "rows": rows}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(results))
    assert main(["plot", str(path)]) == 0
    assert (tmp_path / "bench.png").stat().st_size > 1000
    table = render_table(results)
    assert "1.289" in table and "1.119" in table  # seq/ours and cuBLAS/cute
    assert "seq_cuBLAS's own step" not in table


def test_bench_table_names_the_ms_where_ours_is_the_sequential_baseline():
    from kda_backend.bench import render_table
    from kda_backend.plan import SEQUENTIAL_TORCH, Step

    overlap = Step(overlap=True, qkvg="cute", fab="cute", fb="cute")
    rows = [
        {"m": m, "floor": 21.8, "plan": step.to_json(), "seq_cublas": 40.0, "peers": 46.0, "ours": 41.0}
        for m, step in ((16, overlap), (128, SEQUENTIAL_TORCH), (256, SEQUENTIAL_TORCH))
    ]
    table = render_table({"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "rows": rows})
    assert "M = 128, 256: ours runs seq_cuBLAS's own step" in table


def test_bench_table_lists_the_tactics_per_m():
    from kda_backend.bench import render_table

    def row(m, qkvg, fab, fb):
        return {"m": m, "floor": 21.8, "qkvg_floor": 21.0, "seq_cublas": 29.0, "peers": 25.5, "ours": 22.5,
                "plan": {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute"}, "qkvg_cublas": 24.5,
                "qkvg_cute": 21.9, "fab_cute": 3.0, "fb_cute": 2.0, "qkvg_ctas": 128, "fab_ctas": 126, "fb_ctas": 96,
                "qkvg_tactic": qkvg, "fab_tactic": fab, "fb_tactic": fb}

    single, low = ("q1", "f1", "b1"), ("q16", "f16", "b16")
    rows = [row(1, *single)] + [row(m, *low) for m in (2, 3, 4, 16)] + [row(24, "q32", "f32", "b32")]
    table = render_table({"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "rows": rows})
    assert "CuTe tactics (qkvg / fab / fb):\n  M = 1: q1 / f1 / b1\n  M = 2-4, 16: q16 / f16 / b16\n" in table
    assert "  M = 24: q32 / f32 / b32" in table


def test_bench_table_names_the_fused_stage_and_its_qkvg_tactic():
    from kda_backend.bench import render_table

    fused = {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute", "fused": True}
    rows = [{"m": m, "floor": 21.5, "seq_cublas": 29.0, "peers": 27.0, "ours": 22.0, "plan": fused,
             "fused_qkvg_tactic": key} for m, key in ((17, "w48k64t24s10mp"), (24, "w48k64t24s10mp"),
                                                      (64, "w48k64t64s8mp"))]
    table = render_table({"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "rows": rows})
    assert "fused cute/cute/cute" in table
    assert ("fused stage, QKVG's tactic (the side chain on the SMs it leaves):\n  M = 17, 24: w48k64t24s10mp\n"
            "  M = 64: w48k64t64s8mp") in table


def test_adapter_gate(monkeypatch, kda_log):
    from kda_backend.engine_gate import adapter_enabled

    assert adapter_enabled("pluggy", "1.")
    assert not adapter_enabled("pluggy", "0.0.")
    assert any("untested" in m for m in kda_log.messages())
    monkeypatch.setenv("KDA_BACKEND_FORCE_ENGINE_VERSION", "1")
    assert adapter_enabled("pluggy", "0.0.")
    monkeypatch.setenv("KDA_BACKEND_DISABLE", "1")
    assert not adapter_enabled("pluggy", "1.")


def test_broadcast_from_rank0():
    from types import SimpleNamespace

    from kda_backend.engine_gate import broadcast_from_rank0

    plan = {"plan": 1}
    off = SimpleNamespace(model_parallel_is_initialized=lambda: False)
    assert broadcast_from_rank0(off, plan) is None
    group = SimpleNamespace(world_size=4, broadcast_object=lambda obj, src: {"from": src, **obj})
    on = SimpleNamespace(model_parallel_is_initialized=lambda: True, get_tp_group=lambda: group)
    assert broadcast_from_rank0(on, plan) == {"from": 0, "plan": 1}


def test_bench_table_compares_ours_with_each_engines_own_stage_and_reports_eager_calls():
    from kda_backend.bench import render_table

    rows = [
        {"m": 20, "floor": 21.8, "plan": {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute"},
         "seq_cublas": 35.1, "peers": 26.9, "ours": 25.0, "vllm_native": 35.1, "sglang_native": 26.9},
        {"m": 4, "floor": 21.8, "plan": {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute"},
         "seq_cublas": 29.0, "peers": 25.5, "ours": 22.0, "vllm_native": 24.0, "sglang_native": 25.5,
         "eager_ours": 44.0, "eager_seq_cublas": 40.0, "host_ours": 20.0, "host_seq_cublas": 15.0},
    ]
    table = render_table({"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "rows": rows})
    assert " 0.929 " in table  # 25.0 / min(35.1, 26.9)
    assert " 0.917 " in table  # 22.0 / 24.0
    assert "vllm_native: vLLM 0.33's decision per M" in table
    assert "   4    44.00      40.00    1.100     20.00    15.00" in table


def test_bench_table_sets_the_decode_step_beside_sequential_cublas():
    from kda_backend.bench import render_table

    rows = [{"m": 1, "floor": 21.5, "plan": {"overlap": True, "qkvg": "cute", "fab": "cute", "fb": "cute"},
             "seq_cublas": 28.7, "peers": 27.0, "ours": 21.2}]
    layer_rows = [{"m": 1, "layer": 65.22, "layer_seq_cublas": 69.42, "projection": 21.2, "share": 21.2 / 65.22},
                  {"m": 4, "layer": 76.43, "projection": 21.3, "share": 21.3 / 76.43}]  # written before seq_cuBLAS
    table = render_table({"device": "X", "copy_bandwidth_tbs": 4.2, "plan_source": "test", "rows": rows,
                          "layer_rows": layer_rows})
    assert "   1    65.22      69.42    1.064      21.20  32.5%" in table
    assert "   4    76.43          -        -      21.30  27.9%" in table


def test_engine_batch_sizes_and_native_decisions():
    from kda_backend import native
    from kda_backend.batch_sizes import engine_batch_sizes, spans
    from kda_backend.geometry import preset
    from kda_backend.plan import SEQUENTIAL_TORCH

    vllm, sglang = engine_batch_sizes("vllm"), engine_batch_sizes("sglang")
    assert vllm[:5] == (1, 2, 4, 8, 16) and vllm[-2:] == (248, 256)
    assert {10, 12, 14, 44, 60, 272 - 16} <= set(sglang) and 20 not in vllm
    assert set(engine_batch_sizes("all")) == set(vllm) | set(sglang) and max(engine_batch_sizes("all", 64)) == 64
    with pytest.raises(ValueError, match="engine 'trt': not one of"):
        engine_batch_sizes("trt")
    assert spans([1, 2, 3, 5, 8, 9]) == "1-3, 5, 8-9"
    tp8, tp4 = preset("kimi-k3", 8), preset("kimi-k3", 4)
    assert native.vllm_step(tp8, 14, (9, 0)) == native.Step(True, "torch", "cute", "cute")
    assert native.vllm_step(tp8, 16, (9, 0)) == native.vllm_step(tp4, 4, (9, 0)) == SEQUENTIAL_TORCH
    assert native.sglang_step(64, (9, 0)).overlap and not native.sglang_step(72, (9, 0)).overlap
    assert native.sglang_step(128, (10, 0)).overlap


def test_autotune_takes_an_engine(monkeypatch):
    args = build_parser().parse_args(["autotune", "--engine", "sglang", "--max-m", "64"])
    assert args.engine == "sglang" and args.max_m == 64 and args.ms is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["autotune", "--engine", "trt"])


def test_autotune_prints_each_progress_line_after_the_seconds_so_far(tmp_path, monkeypatch, capsys):
    """On a GPU (faked: the tuner reports two lines and answers a one-step plan), every progress line starts with
    the seconds since tuning began, then the plan and where it was stored."""
    import torch

    from kda_backend import autotune
    from kda_backend.plan import Plan, Step

    def tune(geometry, device, ms, progress):
        progress("tactic fab t1: n16k128t16s3x14p")
        progress("M=1: ovl:cute/cute 21.56 us")
        return Plan(steps={1: Step(overlap=True)}, source="autotune")

    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(autotune, "autotune", tune)
    assert main(["autotune", "--tp", "8", "--ms", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [re.sub(r"^\[ *\d+\.\d s\] ", "", line) for line in lines[:2]] == [
        "tactic fab t1: n16k128t16s3x14p", "M=1: ovl:cute/cute 21.56 us"]
    assert all(re.match(r"^\[ *\d+\.\d s\] ", line) for line in lines[:2])
    assert lines[-1].startswith(f"plan stored in {tmp_path}")
