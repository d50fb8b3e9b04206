"""The README's Python example runs as written (on the CPU here; on a GPU with the GPU suite) and its outputs match
the fp32 reference it computes."""

import re
from pathlib import Path

import torch
from numerics import assert_close

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_example_runs_and_matches_its_reference():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) == 1, "the README has one Python example"
    scope: dict = {}
    exec(compile(blocks[0], str(README), "exec"), scope)
    for name in ("qkvg", "g1", "beta_raw"):
        assert_close(scope[name], scope[f"ref_{name.split('_')[0]}"], name)
    assert scope["qkvg"].shape == (4, 6144) and scope["beta_raw"].shape == (4, 12)
    assert scope["g1"].dtype == torch.bfloat16
