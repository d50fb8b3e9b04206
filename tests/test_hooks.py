import pytest
import torch

from kda_backend import GemmProvider, hookimpl, hooks, plugins, register_plugin, unregister_plugin
from kda_backend.providers.torch_provider import TorchProvider


class _Provider(GemmProvider):
    name, priority = "fake", 50

    def why_not(self, call):
        return None

    def run(self, role, x, w, out):
        out.copy_(torch.mm(x, w.t()))


class _Host:
    def __init__(self, fork=True, cache=None):
        self.fork, self.cache, self.shared = fork, cache, None

    @hookimpl
    def kda_gemm_providers(self):
        return [_Provider()]

    @hookimpl
    def kda_host_fork_allowed(self, device):
        return self.fork

    @hookimpl
    def kda_autotune_cache_dir(self):
        return self.cache

    @hookimpl
    def kda_share_plan(self, plan):
        self.shared = plan
        return {**plan, "from": "rank0"}


def test_kda_gemm_providers_builtin_and_external_sorted_by_priority():
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]
    assert register_plugin(_Host(), "host")
    names = [p.name for p in hooks.gemm_providers()]
    assert names == ["cute", "fake", "flashinfer", "torch"]
    unregister_plugin("host")
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]


def test_kda_host_fork_allowed_default_false_outside_capture_and_overridable():
    assert hooks.fork_allowed(torch.device("cpu")) is False
    register_plugin(_Host(fork=True), "host")
    assert hooks.fork_allowed(torch.device("cpu")) is True
    unregister_plugin("host")
    register_plugin(_Host(fork=None), "host")  # None defers to the built-in answer
    assert hooks.fork_allowed(torch.device("cpu")) is False


def test_kda_host_aux_stream_external_answer_wins():
    class Stream:  # stands for a torch.cuda.Stream on cuda:0, which a CPU cannot create
        device = torch.device("cuda", 0)

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            pass

    sentinel = Stream()

    class StreamHost:
        @hookimpl
        def kda_host_aux_stream(self, device):
            return sentinel

    register_plugin(StreamHost(), "streams")
    assert hooks.aux_stream(torch.device("cuda", 0)) is sentinel


@pytest.mark.gpu
def test_kda_host_aux_stream_builtin_creates_one_stream_per_device():
    dev = torch.device("cuda", 0)
    s1, s2 = hooks.aux_stream(dev), hooks.aux_stream(dev)
    assert s1 is s2 and s1 != torch.cuda.current_stream(dev)


def test_kda_autotune_cache_dir_default_plugin_and_env(tmp_path, monkeypatch):
    monkeypatch.delenv("KDA_BACKEND_CACHE_DIR", raising=False)
    assert hooks.cache_dir().parts[-2:] == (".cache", "kda_backend")
    register_plugin(_Host(cache=tmp_path / "engine"), "host")
    assert hooks.cache_dir() == tmp_path / "engine"
    monkeypatch.setenv("KDA_BACKEND_CACHE_DIR", str(tmp_path / "env"))
    assert hooks.cache_dir() == tmp_path / "env"


def test_kda_share_plan_identity_then_host():
    plan = {"steps": {}}
    assert hooks.share_plan(plan) is plan
    host = _Host()
    register_plugin(host, "host")
    assert hooks.share_plan(plan) == {"steps": {}, "from": "rank0"}
    assert host.shared is plan


def test_register_is_idempotent_and_block_list(monkeypatch):
    assert register_plugin(_Host(), "host")
    assert not register_plugin(_Host(), "host")
    plugins.reset_plugin_manager()
    monkeypatch.setenv("KDA_BACKEND_BLOCK_PLUGINS", "host, other")
    assert not register_plugin(_Host(), "host")
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]


def test_builtins_cannot_be_blocked(monkeypatch, kda_log):
    monkeypatch.setenv("KDA_BACKEND_BLOCK_PLUGINS", "builtin-providers")
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]
    assert any("cannot be blocked" in m for m in kda_log.messages())


def _install_entry_point_plugin(root, name="extplugin"):
    """A real distribution on sys.path whose ``kda_backend`` entry point provides a GEMM provider."""
    (root / f"{name}.py").write_text(
        "import torch\n"
        "from kda_backend import GemmProvider, hookimpl\n"
        "class P(GemmProvider):\n"
        "    name, priority = 'ext', 10\n"
        "    def why_not(self, call): return None\n"
        "    def run(self, role, x, w, out): torch.mm(x, w.t(), out=out)\n"
        "class Plugin:\n"
        "    @hookimpl\n"
        "    def kda_gemm_providers(self): return [P()]\n"
        "plugin = Plugin()\n"
    )
    info = root / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[kda_backend]\next = {name}:plugin\n")


def test_entry_point_plugins_are_loaded_and_blockable(tmp_path, monkeypatch):
    _install_entry_point_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    plugins.reset_plugin_manager()
    assert "ext" in plugins.plugin_names()
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "ext", "torch"]
    monkeypatch.setenv("KDA_BACKEND_BLOCK_PLUGINS", "ext")
    plugins.reset_plugin_manager()
    assert "ext" not in plugins.plugin_names()
    assert [p.name for p in hooks.gemm_providers()] == ["cute", "flashinfer", "torch"]


def test_torch_provider_serves_everything():
    p = TorchProvider()
    x, w = torch.randn(3, 8), torch.randn(5, 8)
    out = torch.full((3, 5), float("nan"))
    p.run("qkvg", x, w, out)
    assert torch.equal(out, x @ w.t())
