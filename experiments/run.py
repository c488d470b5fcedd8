"""``python -m experiments.run NAME [options]``: every experiment of jaxspec.

Each experiment accepts ``--out FILE`` and writes JSON with its full config, the environment
(device, JAX version, git commit) and its results, and prints a readable table.

Each also accepts ``--mesh data=D,tensor=T`` (a device mesh; see the README's "Multi-device"
section); experiments that cannot run on a mesh refuse it. With ``JAXSPEC_DISTRIBUTED=1`` the
process first joins a multi-host job (``jax.distributed.initialize``), and only process 0
writes ``--out``.
"""

from __future__ import annotations

import argparse
import os
import sys

from experiments import dustin_exp, dustin_speed, foundation, kernels, knapspec_exp, speculative

EXPERIMENT_MODULES = (foundation, speculative, kernels, dustin_exp, dustin_speed, knapspec_exp)


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
        sub.add_argument("--mesh", default=None, metavar="data=D,tensor=T",
                         help="run on a device mesh: batch rows over D, heads and MLP over T (D x T = devices)")
    return parser


def check_mesh_support(args) -> None:
    """``--mesh`` only where the experiment honours it; absent, it leaves the JSON config unchanged."""
    if args.mesh is None:
        del args.mesh  # results files (and their resume check) stay as they were without --mesh
        return
    if not getattr(args.func, "supports_mesh", False):
        raise ValueError(f"--mesh is not supported by {args.experiment!r} (it runs on one device); "
                         f"experiments that take it: generate, demo")
    from jaxspec.parallel import parse_mesh_shape

    parse_mesh_shape(args.mesh)  # validate the spec before anything loads


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_mesh_support(args)
        if os.environ.get("JAXSPEC_DISTRIBUTED") == "1":
            from jaxspec.parallel import initialize_distributed

            if initialize_distributed() != 0:
                args.out = None  # one writer per job
        args.func(args)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
