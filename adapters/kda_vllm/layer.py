"""vLLM's Kimi-K3 KDA layer with the projection stage served by :class:`kda_backend.KDAProjection`.

Everything else (weights, loaders, state specs, metadata, ``_forward``, o_proj) is vLLM's. The projection reads
zero-copy views of ``in_proj_qkvgfab.weight`` ([q|k|v|g|f_a|beta|pad], the core's packed layout) and
``f_b_proj.weight``, for any TP size that divides the heads. It is built, and its plan resolved and shared across
the TP group, in vLLM's post-load hook for attention layers, on every rank at the same point of loading; a forward
never communicates. Where the weights are not plain bf16 rows on the GPU, or vLLM runs batch-invariant, vLLM's
path serves, and one log line says why; so it does for any M the plan has no tuned step for (no tuned plan, or M
above the largest tuned one), as the plan's resolution says once.
"""

from __future__ import annotations

import torch
import vllm.envs
from einops import rearrange
from vllm.model_executor.layers.linear import UnquantizedLinearMethod
from vllm.model_executor.offloader.base import NoopOffloader, get_offloader
from vllm.models.kimi_k3.nvidia.kda import KimiK3DeltaAttention

from kda_backend import KDAGeometry, KDAProjection, ProjectionWeights, serve_layer
from kda_backend.log import info_once, warn_once

from kda_vllm.injection import register_host

NOT_LOADED = "its weights were never processed (vLLM's process_weights_after_loading did not run for this layer)"
BUILD_FAILED = "kda-backend could not build its projection (the error logged at load says why)"


def graph_token_counts(vllm_config) -> list[int]:
    """The token counts vLLM's CUDA graphs run a layer at: its capture sizes and, under speculative decoding, each
    rounded up to a multiple of the tokens a decode step verifies per request (1 + the draft tokens) where that
    stays within the largest size, as vLLM rounds them for FULL decode graphs once the model is loaded
    (``CompilationConfig.adjust_cudagraph_sizes_for_spec_decode``; its V2 runner rounds decode batches alike)."""
    compilation = vllm_config.compilation_config
    sizes = set(compilation.cudagraph_capture_sizes or ())
    spec = vllm_config.speculative_config
    per_request = 1 + (spec.num_speculative_tokens or 0) if spec is not None else 1
    if sizes and per_request > 1:
        largest = compilation.max_cudagraph_capture_size or max(sizes)
        sizes |= {m for m in (-(-size // per_request) * per_request for size in sizes) if m <= largest}
    return sorted(sizes)


class KdaBackendKimiK3DeltaAttention(KimiK3DeltaAttention):
    """Built by vLLM in place of ``KimiK3DeltaAttention`` (same constructor arguments).

    :attr:`kda_projection` is the projection serving this layer, ``None`` where vLLM's own path serves;
    :attr:`kda_vllm_path_reason` then says why.
    """

    def __init__(self, config, vllm_config, *args, **kwargs) -> None:
        super().__init__(config, vllm_config, *args, **kwargs)
        self._kda_graph_token_counts = graph_token_counts(vllm_config)
        extra = vllm_config.additional_config
        if isinstance(extra, dict) and extra.get("decode_backend") == "latency_specialized":
            # vLLM's model then runs its own executor over the weights for the decode steps it captured; only the
            # steps that fall back to the layers' forward (prefill, larger batches, piecewise) reach this layer.
            info_once("vllm-specialized-decode", "vLLM's decode_backend=latency_specialized runs its own decode "
                      "executor: kda-backend serves only the steps that fall back to the stock forward")
        self.kda_projection: KDAProjection | None = None
        self.kda_vllm_path_reason: str | None = NOT_LOADED

    def kda_geometry(self) -> KDAGeometry:
        return KDAGeometry(
            hidden_size=self.hidden_size, num_heads=self.num_heads, head_dim=self.head_dim,
            tp_size=self.tp_size, conv_width=self.conv_size,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        """vLLM's post-load hook for attention layers (``is_deferred_attention_layer``): called on every rank after
        every linear's quant method processed its weights, and again after a weight reload. Builds the projection
        over the weights vLLM keeps and resolves its plan here (the plan's TP broadcast is a collective)."""
        register_host()
        self.kda_projection = None
        self.kda_vllm_path_reason = self._why_vllm_path()
        if self.kda_vllm_path_reason is not None:
            warn_once(f"vllm-path-{self.kda_vllm_path_reason}", f"vLLM path kept: {self.kda_vllm_path_reason}")
            return
        weights = ProjectionWeights.from_packed(self.in_proj_qkvgfab.weight, self.f_b_proj.weight, self.kda_geometry())
        self.kda_projection = serve_layer(
            self, weights, aux_stream=self._projection_aux_stream, batch_sizes=self._kda_graph_token_counts
        )
        if self.kda_projection is None:  # building failed after the plan was shared: said once, as an error
            self.kda_vllm_path_reason = BUILD_FAILED
            return
        info_once("vllm-serves", "vLLM: Kimi-K3 KDA layers use kda-backend's projection stage")
        # Where the plan serves every M vLLM's overlap branch would take, that branch never runs for this layer; a
        # zero token limit also makes vLLM's warm-up skip tuning its overlap kernels for it. Elsewhere (no tuned
        # plan, one tuned below vLLM's limit, or sequential cuBLAS at some M there) vLLM's path, its overlap
        # included, stays exactly as vLLM set it up.
        limit = self._projection_overlap_max_tokens
        if limit > 0:
            from vllm.models.kimi_k3.nvidia import low_latency_gemm

            # The model's init sets the limit to its smallest configs' reach; vLLM's warm-up (autotune_kda_qkvg)
            # raises every positive one to the limit its forward then runs with.
            reach = max(limit, low_latency_gemm.KDA_PROJECTION_OVERLAP_MAX_TOKENS)
            if all(self.kda_projection.serves(m) for m in range(1, reach + 1)):
                self._projection_overlap_max_tokens = 0

    def _why_vllm_path(self) -> str | None:
        """Why the projection cannot serve from the tensors vLLM keeps, or ``None`` where it can. Depends only on
        the configuration and shapes, so every rank of a TP group decides alike (the plan broadcast needs all)."""
        if vllm.envs.VLLM_BATCH_INVARIANT:
            # vLLM then promises results independent of the batch size; kda-backend's kernels pick tactics per M.
            return "VLLM_BATCH_INVARIANT is set; vLLM's batch-invariant path serves"
        offloader = get_offloader()
        if not isinstance(offloader, NoopOffloader):
            return f"vLLM offloads weights to the CPU ({type(offloader).__name__}); kda-backend serves resident ones"
        for name in ("in_proj_qkvgfab", "f_b_proj"):
            linear = getattr(self, name)
            method = type(linear.quant_method)
            # Any unquantized method (vLLM's Kimi-K3 low-latency one is a subclass) keeps plain [out, in] rows, as
            # long as it processes weights after loading as UnquantizedLinearMethod does (not at all on CUDA).
            if not issubclass(method, UnquantizedLinearMethod):
                return f"{name} is quantized ({method.__name__})"
            if method.process_weights_after_loading is not UnquantizedLinearMethod.process_weights_after_loading:
                return f"{name}: {method.__name__} changes its weights after loading; their layout is unknown"
            if linear.weight.dtype != torch.bfloat16:
                return f"{name} weight is {linear.weight.dtype}, not bfloat16"
        try:
            ProjectionWeights.from_packed(self.in_proj_qkvgfab.weight, self.f_b_proj.weight, self.kda_geometry())
        except ValueError as exc:
            return f"in_proj_qkvgfab / f_b_proj are not the packed layout: {exc}"
        return None

    def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``hidden_states [M, hidden]`` -> ``[M, hidden]``: vLLM's forward with the projection stage replaced."""
        projection = self.kda_projection
        num_tokens = hidden_states.size(0)
        if projection is None:
            warn_once(f"vllm-path-{self.kda_vllm_path_reason}", f"vLLM path kept: {self.kda_vllm_path_reason}")
            return super().forward(hidden_states, positions)
        if not projection.serves(num_tokens):  # no step of ours for this M (see KDAProjection.serves)
            return super().forward(hidden_states, positions)
        qkvg, g1, beta = projection(hidden_states)
        mixed_qkv, g_proj_states = qkvg.split([3 * self.local_projection_size, self.local_projection_size], dim=-1)
        # From here on vLLM's forward, unchanged: _forward and o_proj get the tensors vLLM's own projection hands
        # them (tests/engines/test_vllm_adapter.py records and compares them).
        beta = beta.unsqueeze(0)
        g1 = rearrange(g1, "n (h d) -> 1 n h d", d=self.head_dim)
        g2 = rearrange(g_proj_states, "... (h d) -> ... h d", d=self.head_dim)
        core_attn_out = torch.empty(
            (1, num_tokens, self.local_num_heads, self.head_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        self._forward(mixed_qkv=mixed_qkv, g1=g1, g2=g2, beta=beta, core_attn_out=core_attn_out)
        core_attn_out = rearrange(core_attn_out, "1 n h d -> n (h d)")
        if self.gemm_rs_ar is not None and self.gemm_rs_ar.should_run(core_attn_out):
            return self.gemm_rs_ar.apply(core_attn_out, self.o_proj)
        return self.o_proj(core_attn_out)[0]
