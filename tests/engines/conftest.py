"""Engine tests run in the engine's own environment (nox sessions `vllm`, `sglang`), not in the core session."""
