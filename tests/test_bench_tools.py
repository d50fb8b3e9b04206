"""The measuring tools in ``benchmarks/tools/`` on the CPU: each imports, answers ``--help`` (in process and as a
script), refuses to measure without a GPU, and the timeline tool's patched kernel still compiles."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TOOLS_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "tools"
TOOLS = [
    "decode_step_plans", "eager_host_profile", "kernel_sweep", "l2_ingress", "qkvg_profile", "qkvg_tactics",
    "side_chain", "stage_forms", "stage_in_context", "stage_timeline",
]


@pytest.fixture
def tools_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS_DIR))


def test_every_script_in_the_folder_is_covered():
    assert sorted(p.stem for p in TOOLS_DIR.glob("*.py")) == sorted(TOOLS + ["stage_operands"])


@pytest.mark.parametrize("name", TOOLS)
def test_help_in_process(name, tools_on_path, capsys):
    module = importlib.import_module(name)
    assert module.__doc__ and "Example (GPU)" in module.__doc__
    with pytest.raises(SystemExit) as exit_info:
        module.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage:") and module.__doc__.splitlines()[0] in out


@pytest.mark.parametrize("name", TOOLS)
def test_help_as_a_script(name):
    proc = subprocess.run([sys.executable, str(TOOLS_DIR / f"{name}.py"), "--help"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage:")


@pytest.mark.parametrize(
    ("name", "argv"),
    [
        ("decode_step_plans", ["1,16", "plan.json"]),
        ("eager_host_profile", ["1,16"]),
        ("kernel_sweep", ["--skip-check"]),
        ("l2_ingress", ["--grids", "16,132"]),
        ("qkvg_profile", ["64,128", "w48k64s9p"]),
        ("qkvg_tactics", ["1,16", "n48k256s4p"]),
        ("side_chain", ["1,16", "split"]),
        ("stage_forms", ["1,16"]),
        ("stage_in_context", ["1,16", "plan.json"]),
        ("stage_timeline", ["1,16"]),
    ],
)
def test_exit_2_without_cuda(name, argv, tools_on_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    module = importlib.import_module(name)
    with pytest.raises(SystemExit) as exit_info:
        module.main(argv)
    assert exit_info.value.code == 2
    assert "CUDA is not available" in capsys.readouterr().err


@pytest.mark.parametrize(("argv", "reason"), [(["--grids", "16,x"], "--grids must be"),
                                             (["--grids", "0,132"], "--grids must be"),
                                             (["--warps", "3"], "--warps must be a power of 2"),
                                             (["--own-mb", "0"], "--own-mb must be positive")])
def test_l2_ingress_refuses_what_it_cannot_launch(argv, reason, tools_on_path, capsys):
    import l2_ingress

    with pytest.raises(SystemExit) as exit_info:
        l2_ingress.main(argv)
    assert exit_info.value.code == 2 and reason in capsys.readouterr().err


def test_qkvg_profile_names_a_key_that_does_not_parse_before_the_gpu(tools_on_path, monkeypatch):
    import qkvg_profile

    monkeypatch.setattr(qkvg_profile, "kimi_k3", lambda tp: pytest.fail("reached the GPU"))
    with pytest.raises(SystemExit, match="'bogus' does not read as"):
        qkvg_profile.main(["128", "w48k64s9p,bogus"])


def test_stage_forms_names_an_unreadable_plan_file(tools_on_path, tmp_path):
    import stage_forms

    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exit_info:
            stage_forms.main(["16", "--plan", str(path)])
        assert str(exit_info.value.code).startswith(f"--plan {path}: ")


def test_stage_in_context_names_an_unreadable_plan_file(tools_on_path, tmp_path, monkeypatch):
    import stage_in_context

    monkeypatch.setattr(stage_in_context, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    bad = tmp_path / "plan.json"
    bad.write_text("{not json")
    for path in (bad, tmp_path / "missing.json"):
        with pytest.raises(SystemExit) as exit_info:
            stage_in_context.main(["16", str(path)])
        assert str(exit_info.value.code).startswith(f"plan {path}: ")


def test_decode_step_plans_names_an_unreadable_plan_file(tools_on_path, tmp_path, monkeypatch):
    import decode_step_plans

    monkeypatch.setattr(decode_step_plans, "require_cuda", lambda: None)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    path = tmp_path / "plan.json"
    path.write_text("{not json")
    with pytest.raises(SystemExit) as exit_info:
        decode_step_plans.main(["16", "cublas", str(path)])
    assert str(exit_info.value.code).startswith(f"plan {path}: ")


def test_stage_in_context_names_a_qkvg_key_that_does_not_parse(tools_on_path):
    import stage_in_context

    with pytest.raises(SystemExit) as exit_info:
        stage_in_context.main(["16", "plan.json", "--qkvg", "w48k64s10m,bogus"])
    assert str(exit_info.value.code).startswith("tactic 'bogus' does not read as")


def test_tactic_keys(tools_on_path):
    from stage_operands import parse_tactic, token_counts

    t = parse_tactic("n16k128s3x14pL", 1)
    assert (t.block_n, t.block_k, t.block_t, t.stages, t.split_k, t.pdl, t.x_via_l1) == (16, 128, 16, 3, 14, True, True)
    assert parse_tactic("n48k256s4p", 24).block_t == 32
    assert parse_tactic("n16k256s4pB", 1).x_bulk and parse_tactic("n48k128s4x4pT", 16).x_tma
    assert t.key() == "n16k128t16s3x14pL"
    assert parse_tactic("w64k64s9p", 100).key() == "w64k64t104s9p"
    assert parse_tactic("w128k64s4x2", 40).key() == "w128k64t40s4x2"
    assert parse_tactic("w48k64s9p", 72).key() == "w48k64t72s9p" and parse_tactic("w48k64s9p", 72).padded_rows
    assert parse_tactic("w96k64t64s8mp", 128).key() == "w96k64t64s8mp"  # a fixed token tile stays below M
    assert token_counts("1,8,16") == [1, 8, 16]
    with pytest.raises(SystemExit):
        parse_tactic("n16k128", 1)
    with pytest.raises(SystemExit):
        token_counts("1,x")


def test_side_chain_groups_follow_m(tools_on_path):
    from side_chain import FAB_GROUPS, fab_tactics

    tactics = fab_tactics("split,n16k128s3x14p", 24)
    assert len(tactics) == len(FAB_GROUPS["split"]) + 1
    assert {t.block_t for t in tactics} == {32}


def test_timeline_patch_compiles_for_sm90a(tools_on_path, monkeypatch):
    """The timeline tool patches skinny_gemm.py's source by anchors: each must still match once, and the patched
    kernels must compile: a split-K F_A/beta (records after its arrival counters) and F_B without split-K (records
    alone in the arrival-counter slot)."""
    from stage_timeline import compile_timed, patched_module, patched_source

    from kda_backend.geometry import preset
    from kda_backend.kernels.skinny_gemm import default_tactic

    assert patched_source().count("globaltimer_lo()") == 3
    module = patched_module()
    g = preset("kimi-k3", 8)
    fab = default_tactic(g.fab_rows, g.hidden_size, 1)
    fb = default_tactic(g.local_width, g.head_dim, 1)
    assert fab.split_k > 1 and fb.split_k == 1
    for tactic, n, k, x_row_stride in ((fab, g.fab_rows, g.hidden_size, g.hidden_size),
                                       (fb, g.local_width, g.head_dim, g.fab_rows)):
        assert compile_timed(module, module.Tactic(**vars(tactic)), n, k, x_row_stride, arch="sm_90a") is not None


def test_qkvg_tactics_checks_the_side_chain_it_times(tools_on_path):
    """The side chain's outputs are poisoned, computed once and compared with fp32: a right one reads ok, one
    that leaves g1 unwritten or gets F_A/beta wrong is named."""
    from types import SimpleNamespace

    from qkvg_tactics import side_chain_errors

    from kda_backend.geometry import KDAGeometry
    from kda_backend.reference import KDALayerWeights
    from kda_backend.weights import ProjectionWeights

    g = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16, tp_size=1)
    layer = KDALayerWeights.random(g, torch.Generator().manual_seed(0))
    w = ProjectionWeights.from_split(layer.w_qkvg, layer.w_fab, layer.w_fb, g)
    ops = SimpleNamespace(xs=[torch.randn(3, g.hidden_size).bfloat16()], fab=[torch.empty(3, g.fab_rows).bfloat16()],
                          g1=[torch.empty(3, g.local_width).bfloat16()], head_dim=g.head_dim)

    def side(i, scale=1, fb=True):
        torch.mm(ops.xs[i], w.w_fab.t(), out=ops.fab[i]).mul_(scale)
        if fb:
            torch.mm(ops.fab[i][:, : g.head_dim], w.w_fb.t(), out=ops.g1[i])

    assert side_chain_errors(ops, w, side) == "fab ok, g1 ok"
    assert side_chain_errors(ops, w, lambda i: side(i, fb=False)) == "fab ok, g1 NaN in its output"
    assert side_chain_errors(ops, w, lambda i: side(i, scale=2)).startswith("fab relative error")
