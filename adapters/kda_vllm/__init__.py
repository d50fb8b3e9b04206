"""vLLM plugin: makes every Kimi-K3 KDA layer vLLM builds run kda-backend's projection stage.

Entry point ``vllm.general_plugins: kda_backend = kda_vllm:register``. vLLM calls :func:`register` in every process
(front end, engine core, workers, model inspection), so it is idempotent and cheap, and importing this module
imports nothing heavy: torch, vLLM and the core load only inside :func:`register`.
"""

TESTED_VERSION_PREFIX = "0.33."


def register() -> None:
    """Inject the overlapped KimiK3DeltaAttention unless disabled or on an untested vLLM version."""
    from kda_backend.engine_gate import adapter_enabled

    if not adapter_enabled("vllm", TESTED_VERSION_PREFIX):
        return
    from kda_vllm.injection import install

    if install():
        from kda_backend.log import get_logger

        get_logger().info("vLLM: Kimi-K3 KDA layers use kda-backend's projection stage")
