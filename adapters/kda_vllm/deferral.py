"""Inject only when vLLM loads a Kimi-K3 model class, through vLLM's model registry.

vLLM resolves a model's architecture through ``ModelRegistry`` (``model_executor/models/registry.py``): every
architecture maps to an entry whose ``load_model_cls()`` imports the model's module, and whose
``inspect_model_cls()`` reports its interfaces (from a file cache or a subprocess). :func:`defer_injection` wraps
the entries of the Kimi-K3 architectures (those whose module is ``vllm.models.kimi_k3``) in :class:`InjectOnLoad`,
which inspects exactly as vLLM's entry does and, once vLLM has imported the model class, injects the layer before
the model is built. Other architectures are untouched. At every place vLLM loads general plugins the registry
module is already imported (or costs milliseconds), so this module is cheap to import there.
"""

from __future__ import annotations

import dataclasses

from vllm.model_executor.models.registry import ModelRegistry, _BaseRegisteredModel, _LazyRegisteredModel

K3_MODULE = "vllm.models.kimi_k3"


@dataclasses.dataclass(frozen=True)
class InjectOnLoad(_BaseRegisteredModel):
    """vLLM's registry entry of a Kimi-K3 architecture; loading its class injects kda-backend's layer first."""

    original: _BaseRegisteredModel

    def inspect_model_cls(self):
        # The original entry, so the model-info cache and the inspection subprocess are vLLM's own.
        return self.original.inspect_model_cls()

    def load_model_cls(self):
        model_cls = self.original.load_model_cls()  # vLLM's import: its errors stay vLLM's
        inject()
        return model_cls


def defer_injection() -> None:
    """Wrap the registry entries of the Kimi-K3 architectures (idempotent; all or none). An entry another plugin
    registered for one of those names is left alone."""
    wrapped = {
        arch: InjectOnLoad(entry)
        for arch, entry in ModelRegistry.models.items()
        if isinstance(entry, _LazyRegisteredModel)
        and (entry.module_name == K3_MODULE or entry.module_name.startswith(K3_MODULE + "."))
    }
    ModelRegistry.models.update(wrapped)


def inject() -> None:
    """Register the layer subclass unless disabled or on an untested vLLM; never raises (one error is logged and
    vLLM builds its own layer)."""
    try:
        from kda_backend.engine_gate import adapter_enabled

        from kda_vllm import TESTED_VERSION_PREFIX

        if not adapter_enabled("vllm", TESTED_VERSION_PREFIX):
            return
        from kda_vllm.injection import install

        install()  # the first layer built says so (a Kimi-Linear model of these classes builds none)
    except Exception:
        from kda_vllm import log_failure

        log_failure("injecting kda-backend's Kimi-K3 KDA layer into vLLM")
