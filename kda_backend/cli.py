"""The ``kda-backend`` command line: ``doctor``, ``autotune``, ``bench``, ``plot``.

Every user error (an argument, a file, an environment variable) ends the command with exit status 2 and one line
on stderr naming the input, its value and what is accepted, never a traceback; arguments are checked before any
GPU work.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kda_backend.batch_sizes import MAX_TUNED_M
from kda_backend.geometry import PRESETS


class _Parser(argparse.ArgumentParser):
    """argparse with usage errors on one line (``kda-backend bench: error: ...``), exit status 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def _doctor(args: argparse.Namespace) -> int:
    from kda_backend import doctor

    report = doctor.collect()
    print(json.dumps(report, indent=2) if args.json else doctor.render(report))
    return 0


def _geometry(args: argparse.Namespace):
    from kda_backend.geometry import preset

    try:
        return preset(args.preset, args.tp)
    except ValueError as exc:
        raise ValueError(f"--tp {args.tp}: {exc}") from None


def _ms(text: str) -> tuple[int, ...]:
    try:
        ms = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        ms = ()
    if not ms or ms[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: comma-separated integers >= 1")
    return ms


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: an integer >= 1")
    return value


def _max_m(text: str) -> int:
    value = _positive_int(text)
    if value > MAX_TUNED_M:
        raise argparse.ArgumentTypeError(f"{text!r}: accepted: an integer from 1 to {MAX_TUNED_M} (the largest M a "
                                         "plan tunes)")
    return value


def _writable_folder(path: Path) -> Path:
    """``path`` as a folder a file can be written in (created if missing), else ``OSError``/``ValueError``."""
    from kda_backend.plugins import prove_writable

    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: not a folder; accepted: a folder (created if missing)")
    try:
        prove_writable(path)
    except OSError as exc:
        raise ValueError(f"--out {path}: cannot write there ({exc.strerror}); accepted: a writable folder") from None
    return path


def _no_cuda() -> int:
    print("kda-backend: CUDA is not available on this machine; nothing can be measured here", file=sys.stderr)
    return 2


def _autotune(args: argparse.Namespace) -> int:
    geometry = _geometry(args)
    import torch

    if not torch.cuda.is_available():
        return _no_cuda()
    from kda_backend import autotune, plan_store, planning
    from kda_backend.batch_sizes import engine_batch_sizes

    plan_store.check_writable()  # before minutes of tuning whose result could not be stored
    device = torch.device("cuda", torch.cuda.current_device())
    ms = args.ms or engine_batch_sizes(args.engine, args.max_m)
    plan = planning.share(autotune.autotune(geometry, device, ms, progress=_elapsed_printer()))
    path = plan_store.save(plan_store.device_key(geometry, device, torch.bfloat16), plan)
    print(plan.describe())
    print(f"plan stored in {path}")
    return 0


def _elapsed_printer():
    """``print`` for progress lines, each after the seconds since this call (where tuning spends its minutes)."""
    start = time.monotonic()

    def progress(line: str) -> None:
        print(f"[{time.monotonic() - start:6.1f} s] {line}", flush=True)

    return progress


def _bench(args: argparse.Namespace) -> int:
    geometry = _geometry(args)
    import torch

    if not torch.cuda.is_available():
        return _no_cuda()
    out = _writable_folder(Path(args.out))
    from kda_backend import bench

    ms = args.ms or bench.DEFAULT_MS
    try:
        from tqdm import tqdm

        bar = tqdm(total=len(ms), desc="bench", unit="M")
        tick = bar.update
    except ImportError:
        bar, tick = None, lambda: print(".", end="", flush=True, file=sys.stderr)
    results = bench.run_bench(geometry, ms, tick=tick)
    if bar is not None:
        bar.close()
    print(bench.render_table(results))
    bench.save_json(results, out / "bench.json")
    print(f"results: {out / 'bench.json'}")
    return _plot_into(results, out / "bench.png")


def _plot_into(results, path: Path, required: bool = False) -> int:
    """Write the plot; without matplotlib say so (an error when the plot is all that was asked for)."""
    from kda_backend import bench

    try:
        bench.write_plot(results, path)
    except ImportError:
        if required:
            raise ValueError("matplotlib is not installed; accepted: `pip install matplotlib` first") from None
        print(f"matplotlib is not installed: no plot; later: kda-backend plot {path.with_suffix('.json')}",
              file=sys.stderr)
        return 0
    except OSError as exc:
        raise ValueError(f"cannot write {path}: {exc.strerror or exc}") from None
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path.with_suffix('.json')}: rows hold values the plot cannot draw ({exc!r}); accepted: "
                         "a bench.json written by kda-backend bench") from None
    print(f"plot: {path}")
    return 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def read_results(path: Path) -> dict[str, Any]:
    """A ``bench.json`` with what the plot needs, else ``ValueError`` naming the file and the problem."""
    accepted = "accepted: a bench.json written by kda-backend bench"
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file; {accepted}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc}); {accepted}") from None
    if not text.strip():
        raise ValueError(f"{path}: empty file; {accepted}")
    try:
        results = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{path}: not JSON ({exc}); {accepted}") from None
    problem = _results_problem(results)
    if problem is not None:
        raise ValueError(f"{path}: {problem}; {accepted}")
    return results


def _results_problem(results: Any) -> str | None:
    """What the plot needs and ``results`` lacks, or ``None``."""
    if not isinstance(results, dict):
        return "not an object"
    if not isinstance(results.get("device"), str):
        return "no 'device' string"
    geometry = results.get("geometry")
    if not isinstance(geometry, dict) or not isinstance(geometry.get("tp_size"), int):
        return "no 'geometry' with an integer 'tp_size'"
    rows = results.get("rows")
    if not isinstance(rows, list) or not rows:
        return "no non-empty 'rows' list"
    for i, row in enumerate(rows):
        m = row.get("m") if isinstance(row, dict) else None
        if not (isinstance(m, int) and not isinstance(m, bool) and m > 0 and _number(row.get("floor"))):
            return f"rows[{i}] has no positive integer 'm' and number 'floor'"
    return None


def _plot(args: argparse.Namespace) -> int:
    path = Path(args.results)
    return _plot_into(read_results(path), path.with_suffix(".png"), required=True)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kda-backend", description="Kimi-K3 KDA projection backend")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report environment, kernels, engines and the autotune cache")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)

    for name, func, help_text in (
        ("autotune", _autotune, "tune the projection plan on this GPU and store it in the cache"),
        ("bench", _bench, "time the projection stage vs sequential cuBLAS, the peers' design and the HBM floor"),
    ):
        cmd = sub.add_parser(name, help=help_text)
        cmd.add_argument("--preset", default="kimi-k3", choices=sorted(PRESETS),
                         help="model geometry preset (default kimi-k3)")
        cmd.add_argument("--tp", type=_positive_int, default=8,
                         help="tensor-parallel size, a divisor of the heads (default 8)")
        cmd.add_argument("--ms", type=_ms, default=None,
                         help="comma-separated token counts M (default: every batch size both engines capture)")
        cmd.set_defaults(func=func)
    sub.choices["autotune"].add_argument("--max-m", type=_max_m, default=MAX_TUNED_M,
                                         help=f"largest M to tune (default {MAX_TUNED_M})")
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
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # a user's input or file: one line, never a traceback
        message = f"{exc.filename}: {exc.strerror}" if isinstance(exc, OSError) and exc.filename else str(exc)
        print(f"kda-backend {args.command}: {' '.join(message.split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
