"""SGLang plugin: ``--attention-backend kda`` runs kda-backend's projection stage in every Kimi-K3 KDA layer.

Entry point ``sglang.srt.plugins: kda_backend = kda_sglang:register``. SGLang calls :func:`register` in the launcher
(before argument parsing) and in every scheduler process, so it is idempotent; importing this module imports
nothing heavy: torch, SGLang and the core load only inside :func:`register`.
"""

TESTED_VERSION = "0.5.23"
BACKEND_NAME = "kda"


def register() -> None:
    """Add the ``kda`` choice of ``--attention-backend`` (resolved as SGLang's default full-attention backend), the
    KDA layer subclass and the host plugin, unless disabled or on an untested SGLang."""
    from kda_backend.engine_gate import adapter_enabled

    if not adapter_enabled("sglang", TESTED_VERSION):
        return
    from kda_sglang.injection import install

    install()
