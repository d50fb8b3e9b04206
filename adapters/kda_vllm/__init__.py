"""vLLM plugin: makes every Kimi-K3 KDA layer vLLM builds run kda-backend's projection stage.

Entry point ``vllm.general_plugins: kda_backend = kda_vllm:register``. vLLM calls :func:`register` in every process
(front end, engine core, workers, model inspection) for every model it serves, so it is idempotent, cheap and
never raises. It only marks vLLM's registry entries of the Kimi-K3 architectures (:mod:`kda_vllm.deferral`); the
layer is injected when vLLM loads one of those model classes, so for any other model neither vLLM's Kimi-K3 code
nor the core (torch kernels, CuTe DSL) is imported. Importing this module imports nothing heavy.
"""

TESTED_VERSION_PREFIX = "0.33."


def register() -> None:
    """Defer the injection until vLLM loads a Kimi-K3 model class. Any failure logs one error and leaves vLLM as it
    was (vLLM does not catch exceptions from plugins)."""
    try:
        import importlib.metadata

        if not importlib.metadata.version("vllm").startswith(TESTED_VERSION_PREFIX):
            # Only here is the core imported at registration: it warns, or honours the forcing switch.
            from kda_backend.engine_gate import adapter_enabled

            if not adapter_enabled("vllm", TESTED_VERSION_PREFIX):
                return
        from kda_vllm.deferral import defer_injection

        defer_injection()
    except Exception:
        log_failure("kda-backend's vLLM plugin (register)")


def log_failure(what: str) -> None:
    """Log the exception being handled as one error naming ``what``; vLLM then runs as if the plugin were absent."""
    import logging

    try:
        from kda_backend.log import get_logger

        logger = get_logger()
    except Exception:  # the core itself may be what failed to import
        logger = logging.getLogger("kda_backend")
    logger.error("%s failed; vLLM runs without kda-backend", what, exc_info=True)
