"""Shared plumbing for experiments: environment record, resumable JSON results, tables, timing."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent


def git_commit() -> Dict[str, Any]:
    try:
        result = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10)
        commit = result.stdout.strip() if result.returncode == 0 else ""
        if not commit:  # a copied tree without usable git metadata (e.g. the GPU machine)
            return {"commit": os.environ.get("JAXSPEC_COMMIT", "unknown"), "dirty": None}
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                    capture_output=True, text=True, timeout=10).stdout.strip())
        out = {"commit": commit or os.environ.get("JAXSPEC_COMMIT", "unknown"), "dirty": dirty}
        if os.environ.get("JAXSPEC_COMMIT") and os.environ["JAXSPEC_COMMIT"] != commit:
            # a copied tree (the GPU machine) whose git metadata is older than the code it holds:
            # the commit the working tree was copied at, as recorded by the caller
            out["tree_commit"] = os.environ["JAXSPEC_COMMIT"]
        return out
    except (OSError, subprocess.SubprocessError):
        return {"commit": os.environ.get("JAXSPEC_COMMIT", "unknown"), "dirty": None}


def environment() -> Dict[str, Any]:
    """Device, versions and commit: stored with every result."""
    import jax

    devices = jax.devices()
    env = {
        "backend": jax.default_backend(),
        "devices": [getattr(d, "device_kind", str(d)) for d in devices],
        "device_count": len(devices),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "host": socket.gethostname(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        **git_commit(),
    }
    try:
        import jaxlib

        env["jaxlib"] = jaxlib.__version__
    except (ImportError, AttributeError):
        pass
    for name in ("flax", "transformers", "torch"):
        module = sys.modules.get(name)
        if module is not None:
            env[name] = getattr(module, "__version__", "?")
    return env


class ResultWriter:
    """Resumable results file: every case is written as soon as it is measured.

    The file holds ``{"experiment", "config", "environment", "cases": {key: result}}``. A rerun
    with the same ``--out`` and the same config skips cases already present (``has``); a rerun
    with a different config refuses to mix results and asks for another file.
    """

    def __init__(self, path: Optional[str], experiment: str, config: Dict[str, Any], resume: bool = True):
        self.path = pathlib.Path(path) if path else None
        self.data: Dict[str, Any] = {"experiment": experiment, "config": config, "environment": environment(),
                                     "cases": {}}
        if self.path and self.path.exists() and resume:
            try:
                old = json.loads(self.path.read_text())
            except json.JSONDecodeError as err:
                raise ValueError(f"{self.path}: existing results file is not valid JSON ({err}); move it away") from err
            if old.get("experiment") == experiment and old.get("config") == config:
                self.data["cases"] = old.get("cases", {})
                if self.data["cases"]:
                    print(f"[resume] {len(self.data['cases'])} case(s) already in {self.path}", file=sys.stderr)
            elif old.get("cases"):
                raise ValueError(f"{self.path} holds results of {old.get('experiment')!r} with a different config; "
                                 f"pass another --out (or delete it) so results are not mixed")

    def has(self, key: str) -> bool:
        return key in self.data["cases"]

    def get(self, key: str):
        return self.data["cases"][key]

    def add(self, key: str, result: Any) -> None:
        self.data["cases"][key] = result
        self.flush()

    def set(self, field: str, value: Any) -> None:
        self.data[field] = value
        self.flush()

    def flush(self) -> None:
        if not self.path:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(self.path.suffix + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=_json_default))
        os.replace(tmp, self.path)


def _json_default(value):
    import numpy as np

    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, pathlib.Path):
        return str(value)
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def print_table(rows: Sequence[Dict[str, Any]], columns: Optional[Sequence[str]] = None, title: str = "") -> str:
    """A plain aligned text table (also returned as a string)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())

    def fmt(value):
        if isinstance(value, float):
            if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6):
                return f"{value:.3e}"
            return f"{value:.4g}"
        return str(value)

    cells = [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    lines.append("  ".join("-" * w for w in widths))
    lines.extend("  ".join(v.ljust(w) for v, w in zip(r, widths)) for r in cells)
    text = "\n".join(lines)
    print(text, flush=True)
    return text


def median_time(fn: Callable[[], Any], repeats: int = 10, warmup: int = 2) -> Dict[str, float]:
    """Median/min wall time of ``fn`` (which must block until its device work is done)."""
    for _ in range(warmup):
        fn()
    times: List[float] = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"median_s": times[len(times) // 2], "min_s": times[0], "max_s": times[-1], "repeats": repeats,
            "all_s": times}


def progress(iterable: Iterable, description: str, total: Optional[int] = None):
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=description, total=total, file=sys.stderr)
    except ImportError:
        return iterable
