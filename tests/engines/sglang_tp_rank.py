"""One SGLang tensor-parallel rank in its own process (started by tests/engines/test_tp_processes.py).

Starts as SGLang's scheduler process does (``run_scheduler_process``): loads SGLang's plugins, publishes the server
arguments (``--attention-backend kda``, TP ``world_size``, CPU) with this process's placement, and builds the
parallel groups with SGLang's ``init_parallel_runtime`` (``init_distributed_environment``,
``initialize_model_parallel``, ``initialize_dp_attention``) over gloo. Then for each seeded checkpoint whose heads
the ranks divide: builds the layer with SGLang's model code, loads this rank's shard through SGLang's weight loaders
and runs ``_merge_bfa_weights`` as ``post_load_weights`` does, where the adapter builds its projection and shares
rank 0's plan over the TP group. Reports the projection's outputs at every parity M and the plans, then runs its
forwards when its turn comes (see tp_processes.py).
"""

import os
import time

START = time.monotonic()

import torch  # noqa: E402

import tp_processes  # noqa: E402
from parity.checkpoint import CHECKPOINTS, PARITY_MS, PREFIX, load_checkpoint, parity_input  # noqa: E402


def cpu_environment(world_size: int) -> None:
    """What SGLang reads to run TP on a machine without GPUs. Its CUDA wheels ship an NCCL library, and a TP group
    that finds one builds a PyNccl communicator on a CUDA device; without the library SGLang leaves NCCL out, as on
    any machine without NVIDIA GPUs. Its CPU runtime binds each rank's threads to the cores named for it (only
    where its CPU kernels exist), and needs one entry per rank when the ranks outnumber the NUMA nodes."""
    os.environ["SGLANG_NCCL_SO_PATH"] = "no-nccl-on-this-machine"
    cores = ",".join(map(str, sorted(os.sched_getaffinity(0))))
    os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join([cores] * world_size)


def project(layer, x, defer_f_b=False) -> list[torch.Tensor]:
    """The layer's projection stage (SGLang's ``forward_qkvbfg_fused``) as ``(qkvg, g1, beta)``, the layout every
    parity artifact uses."""
    qkv, beta, forget_gate, g_proj = layer.forward_qkvbfg_fused(x, defer_f_b=defer_f_b)
    return [torch.cat([qkv, g_proj], dim=-1), forget_gate.clone(), beta.clone()]


def main() -> None:
    args = tp_processes.parse_args()
    cpu_environment(args.world_size)
    from sglang.srt.distributed import bootstrap, parallel_state
    from sglang.srt.plugins import load_plugins
    from sglang.srt.runtime_context import SpawnRanks, get_device, publish, spawn_world_rank
    from sglang.srt.server_args import ServerArgs

    # The adapter tests' construction of SGLang's layer and their shard ids for the fused QKVG loader.
    import test_sglang_adapter as adapter_tests

    imported = time.monotonic()
    load_plugins()
    server_args = ServerArgs(model_path="dummy", attention_backend="kda", tp_size=args.world_size, device="cpu",
                             disable_custom_all_reduce=True)
    publish(server_args, role="scheduler", ranks=SpawnRanks(
        world_rank=spawn_world_rank(server_args, tp_rank=args.rank, pp_rank=0), gpu_id=args.rank,
    ))
    bootstrap.init_parallel_runtime(server_args=server_args, device=get_device().device, dist_port=args.port)
    grouped = time.monotonic()
    tp_processes.plan_as_on_a_gpu()
    broadcasts = tp_processes.count_calls(parallel_state.get_tp_group(), "broadcast_object")

    report, layers = {"rank": args.rank, "checkpoints": {}}, {}
    for name in tp_processes.checkpoints_for(args.world_size):
        geometry = CHECKPOINTS[name]
        tensors = load_checkpoint(args.checkpoints / f"{name}.safetensors")
        layer = adapter_tests._build_layer(merge=False, hidden=geometry.hidden_size, heads=geometry.num_heads,
                                           head_dim=geometry.head_dim)
        qkvg = layer.fused_qkvg_proj.weight
        for weight, shard_id in adapter_tests.SGLANG_QKVG_SHARD_IDS.items():
            qkvg.weight_loader(qkvg, tensors[f"{PREFIX}.{weight}.weight"], shard_id)
        for weight in ("f_a_proj", "b_proj", "f_b_proj"):
            param = getattr(layer, weight).weight
            param.weight_loader(param, tensors[f"{PREFIX}.{weight}.weight"])
        stored = tp_processes.store_plan(layer.kda_geometry(), args.rank)
        layer._merge_bfa_weights()
        projection = layer._kda_projection
        assert projection is not None, "SGLang's own method serves"
        outputs = {m: project(layer, parity_input(m, geometry.hidden_size)) for m in PARITY_MS}
        report["checkpoints"][name] = tp_processes.loaded_checkpoint(outputs, stored, projection, layer.attn_tp_size, layer.local_num_heads)
        layers[name] = (layer, outputs)
    tp_processes.report_loaded(args, report, broadcasts[0], (START, imported, grouped))

    def forward():
        """SGLang's projection stage of every layer at M = 1, 5, 16, in both of SGLang's modes (F_B applied here,
        and deferred to SGLang's fused decode)."""
        calls, equal = 0, True
        for name, (layer, outputs) in layers.items():
            for m in (1, 5, 16):
                x = parity_input(m, CHECKPOINTS[name].hidden_size)
                full, deferred = project(layer, x), project(layer, x, defer_f_b=True)
                calls += 1
                equal &= all(torch.equal(a, b) for a, b in zip(full, outputs[m]))
                equal &= torch.equal(deferred[0], outputs[m][0]) and torch.equal(deferred[2], outputs[m][2])
        return {"forwards": calls, "equal": bool(equal), "broadcasts": broadcasts[0]}

    tp_processes.forward_when_its_turn(args, forward)


if __name__ == "__main__":
    main()
    tp_processes.exit_at_once()
