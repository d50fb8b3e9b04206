"""Reliability, plugins: a plugin that raises, answers outside its hook's contract or does not import is dropped with
one error naming it, and serving goes on with the others (the built-in ones last); a forced provider still fails
loudly. The README's reliability table lists these cases.
"""

import json

import pluggy
import pytest
import torch
from numerics import assert_close

from kda_backend import GemmProvider, KDAProjection, ProjectionWeights, hookimpl, hooks, plugins, register_plugin
from kda_backend.cli import main
from kda_backend.geometry import KDAGeometry
from kda_backend.plan import SEQUENTIAL_TORCH, Plan
from kda_backend.planning import share
from kda_backend.reference import KDALayerWeights, reference_projection

TINY = KDAGeometry(hidden_size=64, num_heads=4, head_dim=16)
BUILTIN_PROVIDERS = ["cute", "flashinfer", "torch"]


class _Provider(GemmProvider):
    def __init__(self, name="ext", priority=60, why_not=None):
        self.name, self.priority, self._why_not = name, priority, why_not

    def why_not(self, call):
        return self._why_not(call) if self._why_not else None

    def run(self, role, x, w, out):
        torch.mm(x, w.t(), out=out)

    def __repr__(self):
        return f"<provider {self.name}>"


class _Opaque:
    def __repr__(self):
        return "<opaque>"


def _raise(*_):
    raise RuntimeError("boom")


def _plugin(hook, answer):
    """A plugin object implementing ``hook`` with ``answer`` (a value, or a callable taking the hook's arguments)."""
    call = answer if callable(answer) else (lambda *_: answer)
    body = {
        "kda_gemm_providers": lambda self: call(),
        "kda_host_fork_allowed": lambda self, device: call(device),
        "kda_host_aux_stream": lambda self, device: call(device),
        "kda_autotune_cache_dir": lambda self: call(),
        "kda_share_plan": lambda self, plan: call(plan),
    }[hook]
    return type("Plugin", (), {hook: hookimpl(body)})()


def _run_projection(m=3):
    w = KDALayerWeights.random(TINY, torch.Generator().manual_seed(0))
    weights = ProjectionWeights.from_split(w.w_qkvg, w.w_fab, w.w_fb, TINY)
    x = torch.randn(m, TINY.hidden_size).bfloat16()
    for out, ref in zip(KDAProjection(weights)(x), reference_projection(x, w.w_qkvg, w.w_fab, w.w_fb, TINY)):
        assert_close(out, ref)


def _dropped(name, problem):
    return f"plugin {name!r} dropped: {problem}; the other plugins serve"


PROVIDER_HOOK_CASES = {
    "raises": (_raise, "kda_gemm_providers raised RuntimeError: boom"),
    "answers-a-string": ("cute", "kda_gemm_providers answered str 'cute'; accepted: a list of GemmProvider objects"),
    "answers-non-providers": ([_Opaque()], "kda_gemm_providers answered _Opaque <opaque> in its list; accepted: "
                                           "GemmProvider objects"),
    "provider-without-name": ([_Provider(name="")], "kda_gemm_providers answered a provider named ''; accepted: a "
                                                    "non-empty string, one per provider"),
    "provider-priority-string": ([_Provider(priority="high")], "kda_gemm_providers answered provider 'ext' with "
                                                               "priority 'high'; accepted: an integer"),
    "provider-named-torch": ([_Provider(name="torch")], "kda_gemm_providers answered providers named ['torch'], "
                                                        "which plugin 'builtin-providers' registers already; "
                                                        "accepted: new names"),
}


@pytest.mark.parametrize("case", list(PROVIDER_HOOK_CASES), ids=[f"plugin-providers-{c}" for c in PROVIDER_HOOK_CASES])
def test_provider_hook_that_fails_drops_its_plugin_and_serving_goes_on(case, kda_log):
    answer, problem = PROVIDER_HOOK_CASES[case]
    register_plugin(_plugin("kda_gemm_providers", answer), "bad")
    assert [p.name for p in hooks.gemm_providers()] == BUILTIN_PROVIDERS
    _run_projection()
    assert kda_log.messages() == [_dropped("bad", problem)]
    assert plugins.dropped() == {"bad": problem} and "bad" not in plugins.plugin_names()
    assert not register_plugin(_plugin("kda_gemm_providers", []), "bad")  # stays out for the process


def test_good_plugins_beside_a_bad_one_still_serve(kda_log):
    register_plugin(_plugin("kda_gemm_providers", [_Provider("good")]), "good")
    register_plugin(_plugin("kda_gemm_providers", _raise), "bad")
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "good", "flashinfer", "torch"]
    assert kda_log.messages() == [_dropped("bad", "kda_gemm_providers raised RuntimeError: boom")]


@pytest.mark.parametrize("answer,problem", [
    (_raise, "why_not raised RuntimeError: boom"),
    (lambda call: 5, "why_not answered int 5; accepted: None or a reason string"),
], ids=["plugin-why-not-raises", "plugin-why-not-answers-int"])
def test_provider_whose_why_not_fails_is_dropped_and_torch_serves(answer, problem, kda_log):
    register_plugin(_plugin("kda_gemm_providers", [_Provider("flaky", why_not=answer)]), "flaky-plugin")
    _run_projection()
    assert kda_log.messages() == [f"provider 'flaky' of plugin 'flaky-plugin' dropped: {problem}; the other "
                                  "providers serve"]


def test_forced_provider_whose_why_not_raises_fails_loudly(monkeypatch):
    register_plugin(_plugin("kda_gemm_providers", [_Provider("flaky", why_not=_raise)]), "flaky-plugin")
    monkeypatch.setenv("KDA_BACKEND_PROVIDER", "qkvg=flaky")
    with pytest.raises(ValueError) as caught:
        _run_projection(m=2)
    assert str(caught.value) == "forced provider 'flaky' cannot serve qkvg M=2: why_not raised RuntimeError: boom"


SHARE_CASES = {
    "answers-empty-object": ({}, "kda_share_plan answered a plan outside the schema: shared plan: fields []; "
                                 "accepted: plan and tactics"),
    "answers-a-string": ("garbage", "kda_share_plan answered str 'garbage'; accepted: a plan object"),
    "raises": (_raise, "kda_share_plan raised RuntimeError: boom"),
    "answers-string-bool": (lambda plan: {**plan, "plan": {**plan["plan"], "fallback": {"overlap": "false"}}},
                            "kda_share_plan answered a plan outside the schema: plan.fallback.overlap: 'false' is a "
                            "string; accepted: true or false"),
}


@pytest.mark.parametrize("case", list(SHARE_CASES), ids=[f"plugin-share-plan-{c}" for c in SHARE_CASES])
def test_share_plan_hook_that_fails_drops_its_plugin_and_the_plan_stays_local(case, kda_log):
    answer, problem = SHARE_CASES[case]
    register_plugin(_plugin("kda_share_plan", answer), "host")
    plan = Plan(fallback=SEQUENTIAL_TORCH, source="local")
    assert share(plan) == plan
    assert kda_log.messages() == [_dropped("host", problem)]


CACHE_CASES = {
    "answers-int": (123, "kda_autotune_cache_dir answered int 123; accepted: a folder path (str or Path) or None"),
    "answers-empty-string": ("", "kda_autotune_cache_dir answered str ''; accepted: a folder path (str or Path) or "
                                 "None"),
    "raises": (_raise, "kda_autotune_cache_dir raised RuntimeError: boom"),
}


@pytest.mark.parametrize("case", list(CACHE_CASES), ids=[f"plugin-cache-dir-{c}" for c in CACHE_CASES])
def test_cache_dir_hook_that_fails_drops_its_plugin_and_the_default_serves(case, monkeypatch, kda_log):
    monkeypatch.delenv("KDA_BACKEND_CACHE_DIR", raising=False)
    answer, problem = CACHE_CASES[case]
    register_plugin(_plugin("kda_autotune_cache_dir", answer), "host")
    assert hooks.cache_dir().parts[-2:] == (".cache", "kda_backend")
    assert kda_log.messages() == [_dropped("host", problem)]


def test_cache_dir_hook_answering_a_file_drops_its_plugin_and_the_default_serves(tmp_path, monkeypatch, kda_log):
    monkeypatch.delenv("KDA_BACKEND_CACHE_DIR", raising=False)
    file = tmp_path / "file"
    file.write_text("x")
    register_plugin(_plugin("kda_autotune_cache_dir", str(file / "cache")), "host")
    assert hooks.cache_dir().parts[-2:] == (".cache", "kda_backend")
    assert kda_log.messages() == [_dropped("host", f"kda_autotune_cache_dir answered {str(file / 'cache')!r}: {file} "
                                                   "is not a folder; accepted: a folder, or a path where one can be "
                                                   "created")]


def test_fork_hook_that_answers_garbage_drops_its_plugin(kda_log):
    register_plugin(_plugin("kda_host_fork_allowed", "yes"), "host")
    assert hooks.fork_allowed(torch.device("cpu")) is False
    assert kda_log.messages() == [_dropped("host", "kda_host_fork_allowed answered str 'yes'; accepted: True, False "
                                                   "or None")]


class _Stream:
    """Stands for a ``torch.cuda.Stream`` (which a CPU cannot create): what the projection's fork uses of one."""

    def __init__(self, device=torch.device("cuda", 0)):
        self.device = device

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        pass


AUX_STREAM_CASES = {
    "raises": (_raise, "kda_host_aux_stream raised RuntimeError: boom"),
    "answers-int": (123, "kda_host_aux_stream answered int 123; accepted: a CUDA stream on cuda:0 or None"),
    "answers-another-device": (_Stream(torch.device("cuda", 1)), "kda_host_aux_stream answered a stream on cuda:1; "
                                                                 "accepted: a CUDA stream on cuda:0 or None"),
}


@pytest.mark.parametrize("case", list(AUX_STREAM_CASES), ids=[f"plugin-aux-stream-{c}" for c in AUX_STREAM_CASES])
def test_aux_stream_hook_that_fails_drops_its_plugin_and_the_next_answers(case, kda_log):
    stream = _Stream()
    answer, problem = AUX_STREAM_CASES[case]
    register_plugin(_plugin("kda_host_aux_stream", stream), "good")
    register_plugin(_plugin("kda_host_aux_stream", answer), "bad")  # registered last: asked first
    assert hooks.aux_stream(torch.device("cuda", 0)) is stream
    assert kda_log.messages() == [_dropped("bad", problem)]


def test_hook_wrapper_is_dropped(kda_log):
    class Wrapper:
        @hookimpl(wrapper=True)
        def kda_gemm_providers(self):
            return (yield)

    register_plugin(Wrapper(), "wrapper")
    assert [p.name for p in hooks.gemm_providers()] == BUILTIN_PROVIDERS
    assert kda_log.messages() == [_dropped("wrapper", "kda_gemm_providers is a hook wrapper; kda-backend calls each "
                                                      "implementation alone")]


def test_register_plugin_refuses_bad_names_and_unknown_hooks():
    with pytest.raises(ValueError) as caught:
        register_plugin(object(), "")
    assert str(caught.value) == "register_plugin: name ''; accepted: a non-empty string"

    class Typo:
        @hookimpl
        def kda_gemm_provider(self):
            return []

    with pytest.raises(pluggy.PluginValidationError, match="unknown hook 'kda_gemm_provider'"):
        register_plugin(Typo(), "typo")
    assert "typo" not in plugins.plugin_names()
    assert [p.name for p in hooks.gemm_providers()] == BUILTIN_PROVIDERS


def _entry_point_plugin(root, name, module_text):
    (root / f"{name}.py").write_text(module_text)
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kda_backend]\n{name} = {name}:plugin\n")


ENTRY_POINT_CASES = {
    "import-fails": ("import missing_dependency_of_the_plugin\nplugin = None\n",
                     "entry point {n} = {n}:plugin of {n} failed to import: ModuleNotFoundError: No module named "
                     "'missing_dependency_of_the_plugin'"),
    "typo-hook": ("from kda_backend import hookimpl\nclass P:\n    @hookimpl\n    def kda_gemm_provider(self): "
                  "return []\nplugin = P()\n",
                  "entry point {n} = {n}:plugin of {n} failed to register: PluginValidationError: unknown hook "
                  "'kda_gemm_provider' in plugin <{n}.P object at"),
}


@pytest.mark.parametrize("case", list(ENTRY_POINT_CASES), ids=[f"plugin-entry-point-{c}" for c in ENTRY_POINT_CASES])
def test_entry_point_plugin_that_fails_is_dropped_also_in_doctor(case, tmp_path, monkeypatch, kda_log, capsys):
    name = f"kdabroken_{case.replace('-', '_')}"
    text, problem = ENTRY_POINT_CASES[case]
    _entry_point_plugin(tmp_path, name, text)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.reset_plugin_manager()
    assert [p.name for p in hooks.gemm_providers()] == BUILTIN_PROVIDERS
    _run_projection()
    expected = problem.format(n=name)
    (message,) = kda_log.messages()
    assert message.startswith(f"plugin {name!r} dropped: {expected}")
    assert main(["doctor", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["plugins"] == ["builtin-host", "builtin-providers"]
    assert report["plugins_dropped"][name].startswith(expected)


def test_core_knows_the_host_plugin_names_the_adapters_register():
    """Blocking an adapter's host plugin by name is not warned about as unknown (see the env var cases)."""
    import re
    from pathlib import Path

    adapters = Path(__file__).resolve().parents[1] / "adapters"
    names = {m for p in adapters.rglob("*.py") for m in re.findall(r'HOST_PLUGIN_NAME = "([^"]+)"', p.read_text())}
    assert names == set(plugins.HOST_PLUGINS)
