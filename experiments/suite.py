"""``python -m experiments.run suite NAME``: run the steps of ``experiments/suites/NAME.toml``.

A suite file::

    description = "What this suite measures, in one paragraph."
    device = "nvidia-h200"            # where its committed results were measured ("cpu" for CPU suites)
    needs = ["smollm2-135m"]          # optional: registry models / corpora a machine must have
    env = {XLA_PYTHON_CLIENT_PREALLOCATE = "true"}  # optional: environment variables for every step
    [[steps]]
    name = "b16"                      # unique within the suite
    run = "dustin-speed --contexts 32768 --batches 16 --out experiments/results/..."
    timeout_s = 400                   # optional
    env = {XLA_FLAGS = "..."}         # optional: environment variables for this step (over the suite's)

Each step is one ``python -m experiments.run <run>`` subprocess (from the repository root) with
its timeout, cut to what is left of ``--time-budget``. A step whose ``--out`` is complete is
resumed or skipped by the experiment itself. The whole file, and every step's command line, is
checked before the first step runs. At the end a summary table; the exit status is non-zero when
a step failed, timed out or was left out for lack of time.

On an accelerator (any ``device`` but ``"cpu"``) each step holds the machine's device lock while it
runs, a file lock in ``$JAXSPEC_CACHE/locks/`` named by ``$CUDA_VISIBLE_DEVICES``: a second suite
runner on the same devices waits for the step in flight to end, so two steps never share a GPU's
memory and time (one would run out of memory, the other's timings would be the two's). The wait
does not count against the step's timeout. ``--no-device-lock`` turns it off.

A suite's result files are named after its ``device``, so an NVIDIA suite refuses to start on a
machine whose GPU is another model (``nvidia-h200`` on an H100, say): ``--any-device`` runs it
anyway, and its files then name a device they were not measured on.

``--dry-run`` checks a suite and prints its commands, each with whether its ``--out`` file exists yet (which
steps have been measured); ``--list`` lists the suites with their descriptions; ``--suites-dir DIR`` (or
``$JAXSPEC_SUITES_DIR``) reads suites from another folder.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import pathlib
import shlex
import signal
import subprocess
import sys
import threading
import time
import tomllib
from typing import Any, Dict, List, Optional, Sequence

from experiments.common import REPO, ResultWriter, print_table

SUITES_DIR = REPO / "experiments" / "suites"
SUITES_DIR_ENV = "JAXSPEC_SUITES_DIR"
SUITE_FIELDS = {"description": str, "device": str, "needs": list, "env": dict, "steps": list}
STEP_FIELDS = {"name": str, "run": str, "timeout_s": (int, float), "env": dict}


@dataclasses.dataclass(frozen=True)
class Step:
    name: str
    run: str
    timeout_s: Optional[float] = None
    env: tuple = ()  # (NAME, value) pairs set for this step's process only (the suite's, then the step's own)

    def argv(self) -> List[str]:
        return shlex.split(self.run)

    def out(self) -> Optional[str]:
        """The step's result file (its ``--out``, relative to the repository root), or None without one."""
        argv = self.argv()
        for i, arg in enumerate(argv):
            if arg == "--out" and i + 1 < len(argv):
                return argv[i + 1]
            if arg.startswith("--out="):
                return arg[len("--out="):]
        return None

    def measured(self) -> str:
        """``"yes"`` when the step's result file exists (a complete or partial run), ``"not yet"`` when it does not,
        ``"-"`` for a step without ``--out``."""
        out = self.out()
        if out is None:
            return "-"
        return "yes" if (REPO / out).exists() else "not yet"


@dataclasses.dataclass(frozen=True)
class Suite:
    name: str
    path: pathlib.Path
    description: str
    device: str
    needs: tuple
    steps: tuple


def suites_dir(override: Optional[str] = None) -> pathlib.Path:
    return pathlib.Path(override or os.environ.get(SUITES_DIR_ENV) or SUITES_DIR)


def _type_name(kind) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join({str: "a string", list: "a list", int: "an integer", float: "a number"}[k] for k in kinds)


def _check_env(env: dict, where: str) -> None:
    bad_env = [k for k, v in env.items() if not isinstance(v, str) or not k.isidentifier()]
    if bad_env:
        raise ValueError(f"{where}: field 'env' must map variable names to strings; bad entries {bad_env}")


def load_suite(path: pathlib.Path) -> Suite:
    """Read and check one suite file; every error names the file, the step and the field."""
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"{path}: not valid TOML ({err})") from None
    unknown = sorted(set(data) - set(SUITE_FIELDS))
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {unknown}; a suite has {', '.join(SUITE_FIELDS)}")
    for field in ("description", "device", "steps"):
        if field not in data:
            raise ValueError(f"{path}: missing field {field!r}")
    for field, kind in SUITE_FIELDS.items():
        if field in data and (not isinstance(data[field], kind) or isinstance(data[field], bool)):
            raise ValueError(f"{path}: field {field!r} must be {_type_name(kind)}, got {data[field]!r}")
    needs = data.get("needs", [])
    if not all(isinstance(n, str) for n in needs):
        raise ValueError(f"{path}: field 'needs' must be a list of strings, got {needs!r}")
    _check_env(data.get("env", {}), str(path))
    if not data["steps"]:
        raise ValueError(f"{path}: no [[steps]]")
    steps, seen = [], set()
    for index, raw in enumerate(data["steps"], 1):
        where = f"{path}: step {index}"
        if not isinstance(raw, dict):
            raise ValueError(f"{where}: must be a [[steps]] table, got {raw!r}")
        if isinstance(raw.get("name"), str):
            where = f"{path}: step {raw['name']!r}"
        unknown = sorted(set(raw) - set(STEP_FIELDS))
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {unknown}; a step has {', '.join(STEP_FIELDS)}")
        for field in ("name", "run"):
            if field not in raw:
                raise ValueError(f"{where}: missing field {field!r}")
        for field, kind in STEP_FIELDS.items():
            if field in raw and (not isinstance(raw[field], kind) or isinstance(raw[field], bool)):
                raise ValueError(f"{where}: field {field!r} must be {_type_name(kind)}, got {raw[field]!r}")
        if not raw["name"].strip():
            raise ValueError(f"{where}: field 'name' is empty")
        if raw["name"] in seen:
            raise ValueError(f"{where}: field 'name' repeats {raw['name']!r}; step names are unique within a suite")
        seen.add(raw["name"])
        if "timeout_s" in raw and not raw["timeout_s"] > 0:
            raise ValueError(f"{where}: field 'timeout_s' must be > 0, got {raw['timeout_s']!r}")
        _check_env(raw.get("env", {}), where)
        try:
            argv = shlex.split(raw["run"])
        except ValueError as err:
            raise ValueError(f"{where}: field 'run' is not a command line ({err})") from None
        if not argv:
            raise ValueError(f"{where}: field 'run' is empty")
        if argv[0] == "suite":
            raise ValueError(f"{where}: field 'run' starts another suite; a step runs one experiment")
        check_step_command(argv, where)
        steps.append(Step(raw["name"], raw["run"], float(raw["timeout_s"]) if "timeout_s" in raw else None,
                          tuple(sorted({**data.get("env", {}), **raw.get("env", {})}.items()))))
    return Suite(path.stem, path, data["description"], data["device"], tuple(needs), tuple(steps))


def check_step_command(argv: Sequence[str], where: str) -> None:
    """Parse the step's command line as ``python -m experiments.run`` would (no work is done)."""
    import argparse
    import contextlib
    import io

    from experiments.run import build_parser

    parser = build_parser()
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            parser.parse_args(list(argv))
    except SystemExit:
        message = errors.getvalue().strip().splitlines()
        raise ValueError(f"{where}: field 'run' is not a valid experiment command: "
                         f"{message[-1] if message else ' '.join(argv)}") from None
    except argparse.ArgumentError as err:
        raise ValueError(f"{where}: field 'run': {err}") from None


def available_suites(folder: pathlib.Path) -> List[pathlib.Path]:
    return sorted(folder.glob("*.toml")) if folder.is_dir() else []


def list_suites(folder: pathlib.Path) -> None:
    paths = available_suites(folder)
    if not paths:
        print(f"no suites in {folder}")
        return
    rows = []
    for path in paths:
        try:
            suite = load_suite(path)
            rows.append({"suite": suite.name, "device": suite.device, "steps": len(suite.steps),
                         "description": suite.description})
        except ValueError as err:
            rows.append({"suite": path.stem, "device": "?", "steps": "?", "description": f"INVALID: {err}"})
    print_table(rows, title=f"suites in {folder}")


def select_steps(suite: Suite, names: Optional[str]) -> List[Step]:
    if not names:
        return list(suite.steps)
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    known = [s.name for s in suite.steps]
    bad = [n for n in wanted if n not in known]
    if bad or not wanted:
        raise ValueError(f"--steps {names!r}: unknown step(s) {bad}; {suite.path} has {', '.join(known)}")
    return [s for s in suite.steps if s.name in wanted]


class Terminated(Exception):
    """The suite runner got SIGTERM / SIGHUP (e.g. from ``timeout`` or a batch scheduler)."""


def _raise_terminated(signum, frame):
    raise Terminated(signal.Signals(signum).name)


def _kill_group(process) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def run_step(step: Step, timeout: Optional[float]) -> Dict[str, Any]:
    """One step as a subprocess in its own process group, killed as a whole on timeout and when
    the runner itself is stopped (Ctrl-C, SIGTERM, SIGHUP): a step never outlives its suite, so
    no stray process keeps a device busy under the next measurement."""
    command = [sys.executable, "-m", "experiments.run", *step.argv()]
    start = time.perf_counter()
    handlers = {}
    if threading.current_thread() is threading.main_thread():  # signal handlers: main thread only
        handlers = {sig: signal.signal(sig, _raise_terminated) for sig in (signal.SIGTERM, signal.SIGHUP)}
    try:
        process = subprocess.Popen(command, cwd=REPO, start_new_session=True, env={**os.environ, **dict(step.env)})
        try:
            rc = process.wait(timeout=timeout)
            status = "ok" if rc == 0 else "failed"
        except subprocess.TimeoutExpired:
            _kill_group(process)
            rc, status = None, "timed out"
        except BaseException:  # KeyboardInterrupt, Terminated: take the step down, then stop
            _kill_group(process)
            raise
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return {"step": step.name, "status": status, "rc": rc, "seconds": time.perf_counter() - start,
            "timeout_s": timeout, "run": step.run}


def device_lock_path() -> pathlib.Path:
    """The lock file of the devices this process sees: one per ``$CUDA_VISIBLE_DEVICES`` value (all
    devices when unset) under ``$JAXSPEC_CACHE/locks``."""
    from jaxspec.assets import cache_dir

    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    tag = "all" if not visible else "".join(c if c.isalnum() else "-" for c in visible)
    return cache_dir() / "locks" / f"device-{tag}.lock"


@contextlib.contextmanager
def device_lock(device: str, enabled: bool = True, holder: str = ""):
    """Hold the device lock (:func:`device_lock_path`) for a step of a suite measured on ``device``;
    nothing for ``"cpu"`` suites or when ``enabled`` is false. Waits, saying so once, while another
    process holds it; the lock file records the holder's pid and ``holder`` (e.g. the suite and step)."""
    if device == "cpu" or not enabled:
        yield None
        return
    path = device_lock_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            current = handle.read().strip() or "another process"
            print(f"waiting for the device lock {path} (held by {current}) ...", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()}" + (f", {holder}" if holder else ""))
        handle.flush()
        try:
            yield path
        finally:
            handle.seek(0)
            handle.truncate()
            handle.flush()
            fcntl.flock(handle, fcntl.LOCK_UN)


def gpu_names() -> Optional[List[str]]:
    """The NVIDIA GPUs this process sees, by ``nvidia-smi`` (None when there is no ``nvidia-smi``)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def check_device(suite: "Suite", names: Optional[Sequence[str]]) -> None:
    """Raise when an NVIDIA suite (``device = "nvidia-<model>[-xN]"``) would run on another GPU model:
    its result files are named after ``suite.device``. ``names``: :func:`gpu_names`; None (no
    ``nvidia-smi``) only warns."""
    if not suite.device.startswith("nvidia-"):
        return
    model = suite.device.split("-")[1].lower()  # nvidia-h200 -> h200, nvidia-h100-x1 -> h100
    if names is None:
        print(f"warning: suite {suite.name} is measured on {suite.device}, and nvidia-smi cannot say which GPU "
              f"this is", file=sys.stderr, flush=True)
        return
    if not names or not any(model in n.lower().replace(" ", "") for n in names):
        seen = ", ".join(sorted(set(names))) or "no NVIDIA GPU"
        raise ValueError(f"suite {suite.name} is measured on {suite.device} (its result files are named so), but "
                         f"this machine has {seen}: run it on an {model.upper()}, or pass --any-device to measure "
                         f"anyway")


def cmd_suite(args) -> Dict[str, Any]:
    folder = suites_dir(args.suites_dir)
    if args.list:
        list_suites(folder)
        return {}
    if not args.name:
        names = ", ".join(p.stem for p in available_suites(folder)) or f"none in {folder}"
        raise ValueError(f"give a suite NAME (or --list); suites: {names}")
    path = folder / f"{args.name}.toml"
    if not path.exists():
        names = ", ".join(p.stem for p in available_suites(folder)) or "none"
        raise ValueError(f"no suite {args.name!r}: {path} does not exist; suites in {folder}: {names}")
    if args.time_budget is not None and not args.time_budget > 0:
        raise ValueError(f"--time-budget={args.time_budget}: must be > 0 seconds")
    suite = load_suite(path)
    steps = select_steps(suite, args.steps)
    print(f"suite {suite.name} ({suite.path}): {suite.description}", flush=True)
    if suite.needs:
        print(f"needs: {', '.join(suite.needs)}", flush=True)
    if args.dry_run:
        rows = [{"step": s.name, "timeout_s": s.timeout_s or "-", "result file": s.measured(),
                 "command": "python -m experiments.run " + s.run} for s in steps]
        print_table(rows, title=f"{len(steps)} step(s) (dry run: nothing runs)")
        return {"suite": suite.name, "dry_run": True, "steps": rows}
    if not args.any_device:
        check_device(suite, gpu_names())
    writer = ResultWriter(args.out, "suite", {"suite": suite.name, "file": str(suite.path),
                                              "steps": [s.name for s in steps]})
    started = time.perf_counter()
    rows = []
    for step in steps:
        with device_lock(suite.device, enabled=not args.no_device_lock, holder=f"suite {suite.name} step {step.name}"):
            timeout = step.timeout_s
            if args.time_budget is not None:
                left = args.time_budget - (time.perf_counter() - started)
                if left <= 0:
                    rows.append({"step": step.name, "status": "not run (time budget)", "rc": None, "seconds": 0.0,
                                 "timeout_s": None, "run": step.run})
                    writer.add(step.name, rows[-1])
                    continue
                timeout = left if timeout is None else min(timeout, left)
            print(f"== step {step.name}: python -m experiments.run {step.run}"
                  + (f" (timeout {timeout:.0f} s)" if timeout else ""), file=sys.stderr, flush=True)
            rows.append(run_step(step, timeout))
            writer.add(step.name, rows[-1])
    print_table([{k: r[k] for k in ("step", "status", "rc", "seconds", "timeout_s")} for r in rows],
                title=f"suite {suite.name}: {sum(r['status'] == 'ok' for r in rows)}/{len(rows)} step(s) ok, "
                      f"{time.perf_counter() - started:.0f} s")
    bad = [r["step"] for r in rows if r["status"] != "ok"]
    if bad:
        raise SuiteFailed(f"suite {suite.name}: step(s) not ok: {', '.join(bad)}")
    return writer.data


class SuiteFailed(ValueError):
    """A step failed, timed out or was left out (the runner exits non-zero)."""


def register(subparsers) -> None:
    p = subparsers.add_parser("suite", help="run the steps of experiments/suites/NAME.toml (or --list them)",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("name", nargs="?", metavar="NAME", help="the suite (a file NAME.toml in the suites folder)")
    p.add_argument("--list", action="store_true", help="list the suites with their descriptions")
    p.add_argument("--steps", default=None, metavar="A,B", help="run only these steps (by name)")
    p.add_argument("--dry-run", action="store_true",
                   help="check the suite and print its commands and whether each step's --out file exists; run nothing")
    p.add_argument("--no-device-lock", action="store_true",
                   help="run each step without the device lock (by default a GPU suite's steps wait for any "
                        "other suite runner's step on the same devices)")
    p.add_argument("--any-device", action="store_true",
                   help="run an NVIDIA suite on whatever GPU this is (by default it refuses a GPU model other than "
                        "its device: its result files are named after that device)")
    p.add_argument("--time-budget", type=float, default=None, metavar="SECONDS",
                   help="stop starting steps after this long; each step's timeout is cut to what is left")
    p.add_argument("--suites-dir", default=None, metavar="DIR",
                   help=f"read suites from DIR (default {SUITES_DIR.relative_to(REPO)}; also ${SUITES_DIR_ENV})")
    p.set_defaults(func=cmd_suite)
