"""The ``kda-backend`` command line: ``doctor``, ``autotune``, ``bench``, ``plot``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _doctor(args: argparse.Namespace) -> int:
    from kda_backend import doctor

    report = doctor.collect()
    print(json.dumps(report, indent=2) if args.json else doctor.render(report))
    return 0


def _geometry(args: argparse.Namespace):
    from kda_backend.geometry import preset

    return preset(args.preset, args.tp)


def _ms(text: str) -> tuple[int, ...]:
    try:
        ms = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ms wants comma-separated integers, got {text!r}") from None
    if not ms or ms[0] < 1:
        raise argparse.ArgumentTypeError("--ms values must be >= 1")
    return ms


def _no_cuda() -> int:
    print("kda-backend: CUDA is not available on this machine; nothing can be measured here", file=sys.stderr)
    return 2


def _autotune(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        return _no_cuda()
    from kda_backend import autotune, plan_store, planning
    from kda_backend.batch_sizes import engine_batch_sizes

    geometry = _geometry(args)
    device = torch.device("cuda", torch.cuda.current_device())
    ms = args.ms or engine_batch_sizes(args.engine, args.max_m)
    plan, tactics = autotune.autotune(geometry, device, ms, progress=print)
    plan, tactics = planning.share(plan, tactics)
    path = plan_store.save(plan_store.device_key(geometry, device, torch.bfloat16), plan, tactics)
    print(plan.describe())
    print(f"plan stored in {path}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    if not torch.cuda.is_available():
        return _no_cuda()
    from kda_backend import bench

    ms = args.ms or bench.DEFAULT_MS
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(ms), desc="bench", unit="M")
        tick = bar.update
    except ImportError:
        bar, tick = None, lambda: print(".", end="", flush=True, file=sys.stderr)
    results = bench.run_bench(_geometry(args), ms, tick=tick)
    if bar is not None:
        bar.close()
    print(bench.render_table(results))
    out = Path(args.out)
    bench.save_json(results, out / "bench.json")
    print(f"results: {out / 'bench.json'}")
    return _plot_into(results, out / "bench.png")


def _plot_into(results, path: Path) -> int:
    from kda_backend import bench

    try:
        bench.write_plot(results, path)
    except ImportError:
        print(f"matplotlib is not installed: no plot; later: kda-backend plot {path.with_suffix('.json')}",
              file=sys.stderr)
        return 0
    print(f"plot: {path}")
    return 0


def _plot(args: argparse.Namespace) -> int:
    path = Path(args.results)
    return _plot_into(json.loads(path.read_text()), path.with_suffix(".png"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-backend", description="Kimi-K3 KDA projection backend")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report environment, kernels, engines and the autotune cache")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)

    for name, func, help_text in (
        ("autotune", _autotune, "tune the projection plan on this GPU and store it in the cache"),
        ("bench", _bench, "time the projection stage vs sequential cuBLAS, the peers' design and the HBM floor"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--preset", default="kimi-k3", help="model geometry preset (default kimi-k3)")
        cmd.add_argument("--tp", type=int, default=8, help="tensor-parallel size (default 8)")
        cmd.add_argument("--ms", type=_ms, default=None,
                         help="comma-separated token counts M (default: every batch size both engines capture)")
        cmd.set_defaults(func=func)
    sub.choices["autotune"].add_argument("--max-m", type=int, default=256, help="largest M to tune (default 256)")
    sub.choices["autotune"].add_argument(
        "--engine", choices=("vllm", "sglang", "all"), default="all",
        help="tune the default CUDA-graph batch sizes of this engine (default: both); --ms overrides",
    )
    sub.choices["bench"].add_argument("--out", default="bench-results", help="folder for bench.json / bench.png")

    plot = sub.add_parser("plot", help="render bench.png from a bench.json")
    plot.add_argument("results", help="path of a bench.json")
    plot.set_defaults(func=_plot)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
