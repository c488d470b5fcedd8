"""``python -m experiments.run NAME [options]``: every experiment of jaxspec.

Each experiment accepts ``--out FILE`` and writes JSON with its full config, the environment
(device, JAX version, git commit) and its results, and prints a readable table.
"""

from __future__ import annotations

import argparse
import sys

from experiments import foundation, kernels, speculative

EXPERIMENT_MODULES = (foundation, speculative, kernels)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.run",
        description="jaxspec experiments. Run `python -m experiments.run NAME --help` for the options of one.")
    subparsers = parser.add_subparsers(dest="experiment", metavar="NAME", title="experiments")
    subparsers.required = True
    for module in EXPERIMENT_MODULES:
        module.register(subparsers)
    for sub in subparsers.choices.values():
        sub.add_argument("--out", default=None, help="write the JSON results here (resumed if it exists)")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
