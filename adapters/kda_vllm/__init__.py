"""vLLM plugin: makes every Kimi-K3 KDA layer vLLM builds run kda-backend's projection stage.

Entry point ``vllm.general_plugins: kda_backend = kda_vllm:register``. vLLM calls :func:`register` in every process
(front end, engine core, workers, model inspection), so it is idempotent and cheap, and importing this module
imports nothing heavy: torch, vLLM and the core load only inside :func:`register`.
"""

TESTED_VERSION_PREFIX = "0.33."


def register() -> None:
    """Inject the overlapped KimiK3DeltaAttention unless disabled or on an untested vLLM version."""
    import importlib.metadata

    from kda_backend import env
    from kda_backend.log import get_logger

    log = get_logger()
    if env.flag("KDA_BACKEND_DISABLE"):
        log.info("vLLM plugin disabled by KDA_BACKEND_DISABLE")
        return
    version = importlib.metadata.version("vllm")
    if not version.startswith(TESTED_VERSION_PREFIX) and not env.flag("KDA_BACKEND_FORCE_ENGINE_VERSION"):
        log.warning(
            "vLLM %s is untested (tested: %sx); not injecting (KDA_BACKEND_FORCE_ENGINE_VERSION=1 forces it)",
            version, TESTED_VERSION_PREFIX,
        )
        return
    from kda_vllm.injection import install

    if install():
        log.info("vLLM %s: Kimi-K3 KDA layers use kda-backend's projection stage", version)
