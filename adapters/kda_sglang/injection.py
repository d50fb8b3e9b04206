"""The seams kda-backend uses in SGLang 0.5.23 (see adapters/SEAMS.md).

``--attention-backend kda`` chooses kda-backend's projection stage for the Kimi-K3 KDA layers and nothing else. In
SGLang the flag names the full-attention (MLA) backend, and page size, KV-cache dtype checks, the Kimi-K3 defaults,
the MLA forward method, fp8 handling and the speculative draft backend all key on that name. So the first step of
SGLang's server-argument resolution declares ``kda`` as "no backend given": every full-attention decision is the one
SGLang makes by default on this platform (FA3 on Hopper, TRT-LLM MLA on SM 10.x, ...), in every process, because
they all read the resolved configuration. The operator's raw input keeps ``kda``; SGLang carries the record to every
scheduler, where :func:`kda_selected` reads it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kda_backend import hookimpl, register_plugin
from kda_backend.engine_gate import broadcast_from_rank0
from kda_backend.log import get_logger
from kda_sglang import BACKEND_NAME

HOST_PLUGIN_NAME = "sglang-host"
LAYER_TARGET = "sglang.srt.models.kimi_k3.KimiK3DeltaAttention"
# The first step SGLang's resolution pipeline runs (arg_groups/pipeline.py): every reader of the attention backend
# (model overrides, page size, KV-dtype checks, speculative defaults) comes after it, even for a dummy model.
FIRST_RESOLUTION_STEP = "handle_deprecated_dp_attention"
RESOLUTION_SOURCE = "kda_backend"
# Flags that share --attention-backend's choices, so they also parse `kda`; it is meaningful only as the base flag.
SPLIT_BACKEND_FLAGS = ("prefill_attention_backend", "decode_attention_backend")
# Why this process could not load the KDA layer subclass (set by install()): `kda` then still parses, and resolution
# refuses it with this reason instead of serving SGLang's own projection silently.
_layer_load_failure: str | None = None


def kda_means_platform_default(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Wraps SGLang's first resolution step: ``attention_backend="kda"`` is declared ``None`` (no backend given)
    before any step reads it, so SGLang resolves every full-attention setting as it would by default.

    :raises ValueError: ``kda`` given to ``--prefill-attention-backend`` or ``--decode-attention-backend``, or
        to ``--attention-backend`` where :func:`install` could not load the KDA layer.
    """
    for name in SPLIT_BACKEND_FLAGS:
        if getattr(server_args, name) == BACKEND_NAME:
            flag = "--" + name.replace("_", "-")
            raise ValueError(
                f"{flag} {BACKEND_NAME}: '{BACKEND_NAME}' selects kda-backend's KDA projection and is given to "
                f"--attention-backend only; leave {flag} unset or name a full-attention backend"
            )
    if server_args.attention_backend == BACKEND_NAME:
        if _layer_load_failure is not None:
            raise ValueError(
                f"--attention-backend {BACKEND_NAME}: kda-backend's KDA layer failed to load ({_layer_load_failure}; "
                "the plugin error logged above has the traceback); fix the installation, or leave "
                "--attention-backend unset to serve with SGLang's own projection"
            )
        from sglang.srt.arg_groups.overrides import declare_resolution

        declare_resolution(server_args, RESOLUTION_SOURCE, attention_backend=None)
        get_logger().info(
            "SGLang: --attention-backend %s: Kimi-K3 KDA layers project through kda-backend; full-attention "
            "layers keep SGLang's default backend", BACKEND_NAME,
        )
    previous(server_args)


def kda_selected() -> bool:
    """Whether this process serves a server started with ``--attention-backend kda``: the operator's raw input on
    the published ``ServerArgs`` (resolution itself saw no backend given)."""
    from sglang.srt.runtime_context import get_server_args

    try:
        server_args = get_server_args()
    except ValueError:  # nothing published in this process
        return False
    return server_args.attention_backend == BACKEND_NAME


def graph_token_counts() -> tuple[int, ...]:
    """The token counts SGLang's decode CUDA graphs run a layer at: each captured batch size times the tokens per
    request (the draft tokens a target verifies under speculative decoding, each candidate's under adaptive
    speculation, else 1); empty without decode graphs (disabled, or a configuration resolved without a model,
    which leaves them unset)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend
    from sglang.srt.runtime_context import get_exec, get_spec
    from sglang.srt.speculative.adaptive_spec_params import resolve_candidate_steps_from_config
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_utils import resolve_num_tokens_per_req

    config = get_exec().graph.cuda_graph_config
    if config is None or config.decode.backend == Backend.DISABLED or not config.decode.bs:
        return ()
    spec = get_spec()
    algorithm = SpeculativeAlgorithm.from_string(spec.speculative_algorithm)
    widths = {1}
    if algorithm.is_speculative() and spec.speculative_adaptive:
        # A target-verify graph per candidate step, of steps + 1 tokens per request (SGLang's adaptive runtime
        # states capture each for the batch sizes that can reach that step: a subset of these).
        widths = {steps + 1 for steps in resolve_candidate_steps_from_config(spec.speculative_adaptive_config)}
    elif algorithm.is_speculative():
        # None where an algorithm sets no verify width (not Kimi-K3's): its graphs then run the batch sizes as given.
        widths = {resolve_num_tokens_per_req(phase="target_verify", spec_algorithm=algorithm) or 1}
    return tuple(sorted({bs * width for bs in config.decode.bs for width in widths}))


def deterministic_inference() -> bool:
    """Whether SGLang runs with ``--enable-deterministic-inference`` (``False`` where nothing is published)."""
    from sglang.srt.runtime_context import get_exec

    try:
        return bool(get_exec().deterministic.enable_deterministic_inference)
    except ValueError:  # nothing published in this process
        return False


class SglangHost:
    """Answers the core's host hooks from SGLang's own state."""

    @hookimpl
    def kda_host_fork_allowed(self, device: torch.device) -> bool:
        from sglang.srt.model_executor.runner_utils.capture_mode import get_is_capture_mode

        # SGLang's own projection-overlap gate: capture mode (its two eager warm-ups and the capture) or a breakable
        # graph. The projection joins its fork before it returns, so the fork stays inside one captured segment.
        return get_is_capture_mode()

    @hookimpl
    def kda_share_plan(self, plan: dict[str, Any]) -> dict[str, Any] | None:
        from sglang.srt.distributed import parallel_state

        return broadcast_from_rank0(parallel_state, plan)


def install() -> None:
    """Idempotent: the CLI choice, the resolution step, the layer REPLACE and the host plugin. The choice and the
    resolution step come first: where the layer (SGLang's Kimi-K3 model module and the core) fails to import, the
    error propagates to SGLang's plugin loader, which logs it, and ``--attention-backend kda`` still parses and is
    refused at resolution with that reason (see :func:`kda_means_platform_default`), not as an invalid choice."""
    global _layer_load_failure
    from sglang.srt.arg_groups import resolution_hooks
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES, add_attention_backend_choices
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    if BACKEND_NAME not in ATTENTION_BACKEND_CHOICES:
        add_attention_backend_choices([BACKEND_NAME])
    if kda_means_platform_default not in resolution_hooks._HOOKS.get(FIRST_RESOLUTION_STEP, []):
        resolution_hooks.register_resolution_hook(FIRST_RESOLUTION_STEP)(kda_means_platform_default)
    try:
        from kda_sglang.layer import KdaBackendKimiK3DeltaAttention
    except Exception as exc:
        _layer_load_failure = f"{type(exc).__name__}: {exc}"
        raise
    _layer_load_failure = None
    if not any(hook is KdaBackendKimiK3DeltaAttention for _, hook, _ in HookRegistry._hooks.get(LAYER_TARGET, [])):
        HookRegistry.register(LAYER_TARGET, KdaBackendKimiK3DeltaAttention, HookType.REPLACE)
    register_plugin(SglangHost(), HOST_PLUGIN_NAME)
    get_logger().debug("SGLang: '%s' attention-backend choice, resolution step and KDA layer registered", BACKEND_NAME)
