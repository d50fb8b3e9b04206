"""SGLang plugin: ``--attention-backend kda`` runs kda-backend's projection stage in every Kimi-K3 KDA layer.

Entry point ``sglang.srt.plugins: kda_backend = kda_sglang:register``. SGLang calls :func:`register` in the launcher
(before argument parsing) and in every scheduler process, so it is idempotent; importing this module imports
nothing heavy: torch, SGLang and the core load only inside :func:`register`.
"""

TESTED_VERSION = "0.5.23"
BACKEND_NAME = "kda"


def register() -> None:
    """Add the ``kda`` attention backend and the KDA layer subclass unless disabled or on an untested SGLang."""
    import importlib.metadata

    from kda_backend import env
    from kda_backend.log import get_logger

    log = get_logger()
    if env.flag("KDA_BACKEND_DISABLE"):
        log.info("SGLang plugin disabled by KDA_BACKEND_DISABLE")
        return
    version = importlib.metadata.version("sglang")
    if version != TESTED_VERSION and not env.flag("KDA_BACKEND_FORCE_ENGINE_VERSION"):
        log.warning(
            "SGLang %s is untested (tested: %s); not registering (KDA_BACKEND_FORCE_ENGINE_VERSION=1 forces it)",
            version, TESTED_VERSION,
        )
        return
    from kda_sglang.injection import install

    install()
