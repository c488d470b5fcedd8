"""``python -m experiments.run NAME [options]``: every experiment of jaxspec.

Each experiment accepts ``--out FILE`` and writes JSON with its full config, the environment
(device, JAX version, git commit) and its results, and prints a readable table.

Each also accepts ``--mesh data=D,tensor=T`` (a device mesh; see the README's "Multi-device"
section); experiments that cannot run on a mesh refuse it. With ``JAXSPEC_DISTRIBUTED=1`` the
process first joins a multi-host job (``jax.distributed.initialize``), and only process 0
writes ``--out``.

JAX's persistent compilation cache is on for every experiment (``~/.cache/jaxspec/
jax_compilation_cache``, under ``$JAXSPEC_CACHE`` when set): a second run of the same command
loads its compiled programs instead of compiling them. ``--no-compilation-cache`` (or
``JAXSPEC_NO_COMPILATION_CACHE=1``) turns it off; ``--compilation-cache DIR`` keeps it in DIR instead,
and ``--empty-compilation-cache`` empties that DIR first (how the demo's first run is timed).

The experiments are those of the modules in :data:`experiments.registry.EXPERIMENT_MODULES`.
"""

from __future__ import annotations

import argparse
import os
import sys

from experiments import registry
from experiments.common import check_output_path, enable_compilation_cache


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m experiments.run",
        description="jaxspec experiments. Run `python -m experiments.run NAME --help` for the options of one.")
    subparsers = parser.add_subparsers(dest="experiment", metavar="NAME", title="experiments")
    subparsers.required = True
    for module in registry.load_experiment_modules():
        module.register(subparsers)
    for sub in subparsers.choices.values():
        sub.add_argument("--out", default=None,
                         help="write the JSON results here; a rerun with the same options resumes (or skips) it, "
                              "other options are refused so no result is overwritten")
        sub.add_argument("--no-compilation-cache", action="store_true",
                         help="do not use JAX's persistent compilation cache (also: JAXSPEC_NO_COMPILATION_CACHE=1)")
        sub.add_argument("--compilation-cache", default=None, metavar="DIR",
                         help="keep compiled programs in DIR instead of the jaxspec cache's jax_compilation_cache")
        sub.add_argument("--empty-compilation-cache", action="store_true",
                         help="empty the --compilation-cache DIR first (a first run's compile times; the default "
                              "cache is never emptied)")
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
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])  # the experiment's options (warm-up workers reuse them)
    try:
        check_mesh_support(args)
        check_output_path(args.out)
        enable_compilation_cache(not args.no_compilation_cache, args.compilation_cache, args.empty_compilation_cache)
        if os.environ.get("JAXSPEC_DISTRIBUTED") == "1":
            from jaxspec.parallel import initialize_distributed

            if initialize_distributed() != 0:
                args.out = None  # one writer per job
        args.func(args)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # a file that cannot be read or written: one line, not a traceback
        where = f": {err.filename}" if err.filename else ""
        print(f"error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
