"""One vLLM tensor-parallel rank in its own process (started by tests/engines/test_tp_processes.py).

Sets up vLLM's distributed state as a vLLM worker does (``init_distributed_environment`` over gloo, then
``initialize_model_parallel(world_size)`` under a ``VllmConfig``), loads vLLM's plugins and resolves the Kimi-K3
architecture (which injects the adapter's layer), then for each seeded checkpoint whose heads the ranks divide:
builds the layer with vLLM's model code, loads this rank's shard through vLLM's weight loaders and runs vLLM's
post-load pass, where the adapter builds its projection and shares rank 0's plan over the TP group. Reports the
projection's outputs at every parity M and the plans, then runs its forwards when its turn comes (see
tp_processes.py).
"""

import os
import time

START = time.monotonic()
# Importing vLLM starts two background builds of humming's CUDA kernels per process (nothing to build them with
# here); on a 2-core machine with 8 ranks they would take as much CPU as the ranks themselves.
os.environ["HUMMING_DISABLE_PARALLEL_BUILD"] = "1"

import torch  # noqa: E402

import tp_processes  # noqa: E402
from parity.checkpoint import CHECKPOINTS, PARITY_MS, load_checkpoint, parity_input  # noqa: E402


class ProjectionHandedOn(Exception):
    """Raised by the stand-in for vLLM's ``_forward``: the forward's projection stage has run. What follows it
    (o_proj's all-reduce of the partial sums) is a collective of every rank by design, and is not under test."""


def main() -> None:
    args = tp_processes.parse_args()
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel, parallel_state
    from vllm.model_executor.model_loader.utils import get_model_architecture
    from vllm.plugins import load_general_plugins

    # The adapter tests' small Kimi-K3 model config, construction by vLLM's model code, loaders and post-load pass.
    import test_vllm_adapter as adapter_tests

    names = tp_processes.checkpoints_for(args.world_size)
    configs = {
        name: adapter_tests._vllm_config(args.folder / f"config-{name}-rank{args.rank}", g.hidden_size, g.num_heads,
                                         g.head_dim)
        for name, g in CHECKPOINTS.items() if name in names
    }
    imported = time.monotonic()
    with set_current_vllm_config(configs[names[0]]):
        init_distributed_environment(world_size=args.world_size, rank=args.rank, local_rank=args.rank,
                                     distributed_init_method=args.init_method, backend="gloo")
        initialize_model_parallel(args.world_size)
    grouped = time.monotonic()
    load_general_plugins()
    get_model_architecture(configs[names[0]].model_config)
    tp_processes.plan_as_on_a_gpu()
    broadcasts = tp_processes.count_calls(parallel_state.get_tp_group(), "broadcast_object")

    report, layers = {"rank": args.rank, "checkpoints": {}}, {}
    for name in names:
        tensors = load_checkpoint(args.checkpoints / f"{name}.safetensors")
        layer = adapter_tests._construct(configs[name])
        adapter_tests._load_weights(layer, tensors)
        stored = tp_processes.store_plan(layer.kda_geometry(), args.rank)
        adapter_tests._post_load(layer, configs[name])
        projection = layer.kda_projection
        assert projection is not None, layer.kda_vllm_path_reason
        outputs = {m: [t.clone() for t in projection(parity_input(m, CHECKPOINTS[name].hidden_size))]
                   for m in PARITY_MS}
        report["checkpoints"][name] = tp_processes.loaded_checkpoint(outputs, stored, projection, layer.tp_size, layer.local_num_heads)
        layers[name] = (layer, outputs)
    tp_processes.report_loaded(args, report, broadcasts[0], (START, imported, grouped))

    def forward():
        """vLLM's forward of every layer at M = 1, 5, 16, up to the tensors it hands ``_forward``."""
        handed = []

        def record(**tensors):
            handed.append(tensors)
            raise ProjectionHandedOn

        equal = True
        for name, (layer, outputs) in layers.items():
            layer._forward = record
            for m in (1, 5, 16):
                try:
                    layer.forward(parity_input(m, CHECKPOINTS[name].hidden_size), torch.arange(m))
                except ProjectionHandedOn:
                    pass
                qkvg = outputs[m][0]
                equal &= torch.equal(handed[-1]["mixed_qkv"], qkvg[:, : 3 * layer.local_projection_size])
        return {"forwards": len(handed), "equal": bool(equal), "broadcasts": broadcasts[0]}

    tp_processes.forward_when_its_turn(args, forward)


if __name__ == "__main__":
    main()
    tp_processes.exit_at_once()
