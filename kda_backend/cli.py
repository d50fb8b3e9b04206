"""The ``kda-backend`` command line."""

from __future__ import annotations

import argparse
import json
import sys


def _doctor(args: argparse.Namespace) -> int:
    from kda_backend import doctor

    report = doctor.collect()
    print(json.dumps(report, indent=2) if args.json else doctor.render(report))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kda-backend", description="Kimi-K3 KDA projection backend")
    sub = parser.add_subparsers(dest="command", required=True)
    doctor = sub.add_parser("doctor", help="report environment, kernels, engines and the autotune cache")
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.set_defaults(func=_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
