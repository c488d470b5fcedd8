"""Shared plumbing for experiments: environment record, resumable JSON results, tables, timing,
the persistent compilation cache, model loading, prompt reading and stop tokens."""

from __future__ import annotations

import json
import os
import pathlib
import dataclasses
import platform
import socket
import subprocess
import sys
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_MODEL = "smollm2-135m"
DEMO_PROMPT_FILE = REPO / "experiments" / "prompts" / "long_demo.txt"
#: keys of an experiment's arguments that are not part of its results' config (resume compares configs)
NOT_CONFIG = ("func", "out", "no_compilation_cache", "compilation_cache", "empty_compilation_cache", "argv",
              "warm_workers", "compile_threads")
#: set to 1 to turn the persistent compilation cache off (as ``--no-compilation-cache`` does)
NO_COMPILATION_CACHE_ENV = "JAXSPEC_NO_COMPILATION_CACHE"


def git_commit() -> Dict[str, Any]:
    """The commit the code runs at and whether tracked files other than results differ from it (``dirty``;
    results under experiments/results/ do not count: a suite's earlier steps rewrite them before its later steps
    start). ``None`` where the tree carries no usable git metadata."""
    try:
        result = subprocess.run(["git", "rev-parse", "--verify", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                timeout=10)
        commit = result.stdout.strip() if result.returncode == 0 else ""
        if not commit:  # a copied tree without usable git metadata (e.g. the GPU machine)
            return {"commit": os.environ.get("JAXSPEC_COMMIT", "unknown"), "dirty": None}
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                     ":(exclude)experiments/results"], cwd=REPO,
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
    if os.environ.get("XLA_FLAGS"):  # e.g. command buffers on: part of what was measured
        env["xla_flags"] = os.environ["XLA_FLAGS"]
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


def load_choice_table(path: str, target: Optional[str], draft: Optional[str], flag: str = "--arbitrate-table"):
    """``flag FILE`` before any model loads: the :class:`~jaxspec.decoding.arbitration.ChoiceTable`, or a one-line
    ``ValueError`` for a missing or malformed file, or one measured for another target/draft pair (its ``meta``;
    a model drafting for itself, as KnapSpec does, has the draft ``"self"``)."""
    from jaxspec.decoding.arbitration import ChoiceTable

    if not pathlib.Path(path).is_file():
        raise ValueError(f"{flag} {path}: no such file (write one with `python -m experiments.run choice-table`)")
    try:
        table = ChoiceTable.load(path)
    except ValueError as err:
        raise ValueError(f"{flag}: {err}") from None
    for side, name in (("target", target), ("draft", draft)):
        measured = table.meta.get(side)
        if measured is not None and name and measured != name:
            raise ValueError(f"{flag} {path}: measured with {side} {measured!r}, this run's {side} is "
                             f"{name!r} (a table holds one pair's speed-ups)")
    return table


def check_output_path(path: Optional[str]) -> None:
    """Refuse an ``--out`` that cannot be written, before any work: a directory, a read-only file,
    a parent that is not a folder or not writable. A missing parent folder is created."""
    if not path:
        return
    out = pathlib.Path(path)
    if out.is_dir():
        raise ValueError(f"--out {path}: is a directory; give a file name, e.g. {out / 'results.json'}")
    if out.exists() and not out.stat().st_mode & 0o222:
        raise ValueError(f"--out {path}: the file is read-only; make it writable or pass another --out")
    parent = out.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ValueError(f"--out {path}: cannot create its folder {parent} ({err.strerror or err})") from None
    probe = parent / f".{out.name}.{os.getpid()}.probe"
    try:
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise ValueError(f"--out {path}: cannot write in {parent} ({err.strerror or err})") from None


class ResultWriter:
    """Resumable results file: every case is written as soon as it is measured.

    The file holds ``{"experiment", "config", "environment", "cases": {key: result}, ...}``. A
    rerun with the same ``--out`` and the same config skips cases already present (``has``) and
    finds a finished run's fields (``previous``); a rerun with a different config, or a file this
    writer did not make (a JSON list, another program's output), is refused so nothing is
    overwritten. An option the file's config does not hold, given its off value (``None`` / ``False``),
    is the same config: the file predates the option. The file is written atomically (a ``.tmp`` next to it, then renamed).
    """

    def __init__(self, path: Optional[str], experiment: str, config: Dict[str, Any]):
        self.path = pathlib.Path(path) if path else None
        self.data: Dict[str, Any] = {"experiment": experiment, "config": config, "environment": environment(),
                                     "cases": {}}
        #: the whole earlier file of this experiment and config (empty when there is none)
        self.previous: Dict[str, Any] = {}
        if self.path is None:
            return
        check_output_path(str(self.path))
        if not self.path.exists() or not self.path.read_text().strip():
            return
        try:
            old = json.loads(self.path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{self.path}: existing file is not valid JSON ({err}); move it away or pass another "
                             f"--out") from None
        if not isinstance(old, dict) or "experiment" not in old or "config" not in old:
            kind = type(old).__name__ if not isinstance(old, dict) else "JSON object without experiment/config"
            raise ValueError(f"{self.path}: existing file is not a results file of this program ({kind}); move it "
                             f"away or pass another --out so it is not overwritten")
        old_config = old.get("config") or {}
        changed = sorted(k for k in set(config) | set(old_config)
                         if old_config.get(k, "<absent>") != config.get(k, "<absent>")
                         # an option added after the file was written, left at its off value, changes nothing
                         and not (k not in old_config and config.get(k) in (None, False)))
        if old.get("experiment") != experiment or changed:
            raise ValueError(f"{self.path} holds results of {old.get('experiment')!r} with a different config "
                             f"(differs in: {', '.join(changed) if changed else 'experiment'}); pass another --out "
                             f"(or delete it) so results are not mixed")
        self.previous = old
        self.data["cases"] = dict(old.get("cases") or {})
        if self.data["cases"]:
            print(f"[resume] {len(self.data['cases'])} case(s) already in {self.path}", file=sys.stderr)

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
        try:
            tmp.write_text(json.dumps(self.data, indent=1, default=json_default))
            os.replace(tmp, self.path)
        finally:
            if tmp.exists():
                tmp.unlink()


def config_of(args, exclude: Iterable[str] = ()) -> Dict[str, Any]:
    """An experiment's arguments as its results' config (sorted; without ``NOT_CONFIG`` keys)."""
    skip = set(NOT_CONFIG) | set(exclude)
    return {k: v for k, v in sorted(vars(args).items()) if k not in skip}


# ---------------------------------------------------------------------------- compilation cache
def compilation_cache_dir() -> pathlib.Path:
    """The default compilation cache folder, ``<jaxspec cache>/jax_compilation_cache`` (the jaxspec cache honours
    ``$JAXSPEC_CACHE``); ``--compilation-cache DIR`` replaces it (:func:`enable_compilation_cache`)."""
    from jaxspec.models.registry import cache_dir

    return cache_dir() / "jax_compilation_cache"


def empty_compilation_cache(path: pathlib.Path) -> int:
    """Delete the compiled programs in ``path`` (a first run's compile times without touching the default
    cache); returns how many files went. Refuses, before deleting anything, a path that is not a folder
    or holds a folder (JAX's compilation cache is flat), so a mistyped path loses nothing."""
    path = pathlib.Path(path)
    if not path.exists():
        return 0
    if not path.is_dir():
        raise ValueError(f"--compilation-cache {path} is not a folder; pass a new or empty folder, or one a "
                         f"compilation cache was kept in")
    entries = list(path.iterdir())
    folders = [e.name for e in entries if not e.is_file() or e.is_symlink()]
    if folders:
        raise ValueError(f"--empty-compilation-cache refuses {path}: it holds {folders[0]!r}, which is not a "
                         f"compiled program (a compilation cache holds only files); pass a new or empty folder")
    for entry in entries:
        entry.unlink()
    return len(entries)


def enable_compilation_cache(enabled: bool = True, path: Optional[str] = None,
                             empty: bool = False) -> Optional[pathlib.Path]:
    """Turn on JAX's persistent compilation cache (every compile, CPU ones included, is saved and
    reused by the next process running the same program), in ``path`` when given (else the default of
    :func:`compilation_cache_dir`), emptied first with ``empty`` (only an explicit ``path``: the default
    cache is never emptied). Off with ``enabled=False`` or ``JAXSPEC_NO_COMPILATION_CACHE=1``. Returns
    the folder, or None when off."""
    if empty and path is None:
        raise ValueError("--empty-compilation-cache needs --compilation-cache DIR (the folder to empty); the "
                         f"default cache {compilation_cache_dir()} is never emptied")
    if empty and not enabled:
        raise ValueError("--empty-compilation-cache with --no-compilation-cache: the cache is off, nothing to empty")
    if not enabled or os.environ.get(NO_COMPILATION_CACHE_ENV, "") not in ("", "0"):
        return None
    import jax

    path = pathlib.Path(path).expanduser().absolute() if path is not None else compilation_cache_dir()
    if empty:
        removed = empty_compilation_cache(path)
        print(f"[compilation cache] emptied {path} ({removed} files)", file=sys.stderr)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        print(f"[compilation cache] off: cannot create {path} ({err.strerror or err})", file=sys.stderr)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # default 1 s: most CPU compiles
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def compilation_cache_on() -> bool:
    """Whether JAX's persistent compilation cache has a folder in this process."""
    import jax

    return bool(jax.config.jax_compilation_cache_dir)


# ---------------------------------------------------------------------------- warming the cache in parallel
#: what a warm-up worker's log keeps when it fails (its last lines go to stderr)
WARM_LOG_TAIL = 20


def replace_options(argv: Sequence[str], values: Dict[str, Optional[str]]) -> List[str]:
    """``argv`` without each option named in ``values`` (as ``--opt V`` or ``--opt=V``), then ``--opt V``
    for each value that is not None. Every option named must take exactly one value."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in values:
            skip = "=" not in arg
            continue
        out.append(arg)
    for name, value in values.items():
        if value is not None:
            out += [name, str(value)]
    return out


def check_warm_workers(workers: int, argv: Optional[Sequence[str]], shares: int) -> None:
    """Refuse ``--warm-workers N`` that cannot work, before anything loads: N < 1, more workers than
    ``shares`` (the parts the work splits into), no command line to start workers from, the
    compilation cache off, or a GPU whose processes would each take 75 % of its memory."""
    if workers < 1:
        raise ValueError(f"--warm-workers {workers}: must be >= 1 (1: no warm-up)")
    if workers == 1:
        return
    if workers > shares:
        raise ValueError(f"--warm-workers {workers}: at most one worker per method ({shares} here)")
    if not argv:
        raise ValueError("--warm-workers needs the command line it was started with (`python -m experiments.run ...`)")
    if not compilation_cache_on():
        raise ValueError("--warm-workers fills the persistent compilation cache, which is off here "
                         "(--no-compilation-cache or JAXSPEC_NO_COMPILATION_CACHE): drop one or the other")
    on_cpu = os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu"
    preallocate = os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "").strip().lower() not in ("false", "0")
    if preallocate and not on_cpu and not os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"):
        raise ValueError(f"--warm-workers {workers} runs {workers + 1} processes on one device: set "
                         "XLA_PYTHON_CLIENT_PREALLOCATE=false (each would otherwise take 75 % of a GPU's memory), "
                         "or JAX_PLATFORMS=cpu on a CPU")


def warm_compilation_cache(experiment: str, argv: Sequence[str],
                           overrides: Sequence[Dict[str, Optional[str]]]) -> List[Dict[str, Any]]:
    """Fill the persistent compilation cache from several processes at once, then return.

    One process per entry of ``overrides`` runs ``python -m experiments.run EXPERIMENT`` with ``argv``
    (this run's command line) and that entry's options replaced (:func:`replace_options`; give each a
    share of the methods, a short run and an ``--out`` of its own), all at the same time. XLA compiles
    one program after another in a process, and a long-context run builds hundreds of them before its
    first measurement; split over processes they compile in parallel, and the calling run then loads
    them from the cache. The workers' results are discarded; their logs are printed (last lines) if one
    fails. Returns per worker: its overrides, exit code and seconds."""
    import tempfile

    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    env.pop("JAXSPEC_DISTRIBUTED", None)
    report: List[Dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxspec-warm-") as folder:
        running = []
        for i, values in enumerate(overrides):
            values = {k: (v.replace("{tmp}", folder) if isinstance(v, str) else v) for k, v in values.items()}
            kept = [arg for arg in argv if arg != "--empty-compilation-cache"]  # the run emptied it already
            command = [sys.executable, "-m", "experiments.run", experiment, *replace_options(kept, values)]
            log = open(pathlib.Path(folder) / f"worker{i}.log", "w+")
            running.append((values, log, time.perf_counter(), subprocess.Popen(command, cwd=REPO, env=env, stdout=log,
                                                                             stderr=subprocess.STDOUT)))
        progress_line(f"warming the compilation cache: {len(running)} worker processes")
        for i, (values, log, start, process) in enumerate(running):
            code = process.wait()
            seconds = time.perf_counter() - start
            shown = {k: v for k, v in values.items() if v is not None and folder not in str(v)}
            report.append({"options": shown, "returncode": code, "seconds": round(seconds, 1)})
            progress_line(f"warm-up worker {i + 1}/{len(running)} {shown}: "
                          + (f"done in {seconds:.0f} s" if code == 0 else f"exit {code} after {seconds:.0f} s; the run "
                             "compiles what it left out"), done=True)
            if code != 0:
                log.seek(0)
                for line in log.read().splitlines()[-WARM_LOG_TAIL:]:
                    print(f"    | {line}", file=sys.stderr)
            log.close()
    return report


class CompileCounter:
    """Counts, from its creation on, the programs JAX loaded from the persistent compilation cache
    (``cache_hits``) and the ones it had to compile and store (``cache_misses``)."""

    EVENTS = {"/jax/compilation_cache/cache_hits": "cache_hits", "/jax/compilation_cache/cache_misses": "cache_misses"}

    def __init__(self):
        import jax

        self.hits = {"cache_hits": 0, "cache_misses": 0}
        jax.monitoring.register_event_listener(self.on_event)

    def on_event(self, event: str, **kwargs) -> None:
        if event in self.EVENTS:
            self.hits[self.EVENTS[event]] += 1

    def counts(self) -> Dict[str, int]:
        return dict(self.hits)


def progress_line(text: str, done: bool = False) -> None:
    """One progress line on stderr (flushed: visible while the slow part runs); ``done``: a phase
    that finished (no trailing ``...``)."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}{'' if done else ' ...'}", file=sys.stderr, flush=True)


def check_skip_ranges(spec: str, flag: str) -> None:
    """Refuse a reversed layer range (``mlp:12-10`` would skip nothing) in a skip spec."""
    import re

    for lo, hi in re.findall(r"(\d+)-(\d+)", spec or ""):
        if int(lo) > int(hi):
            raise ValueError(f"{flag} {spec!r}: the range {lo}-{hi} is reversed (it would skip nothing); "
                             f"write it low-high, e.g. {hi}-{lo}")


# ---------------------------------------------------------------------------- models, prompts, stop tokens
def check_fused_projections(args) -> None:
    """``--fused-projections`` is for one device (docs/methods.md §2, fused projections): refused with ``--mesh``
    before anything is built."""
    if getattr(args, "fused_projections", False) and getattr(args, "mesh", None):
        raise ValueError(f"--fused-projections with --mesh {args.mesh}: the fused layout is for one device "
                         "(docs/methods.md §2, fused projections)")


def fused_if_asked(args, *params):
    """``params`` in the fused projection layout when ``--fused-projections`` is given, else as they are (one
    result per argument; ``None`` stays ``None``)."""
    if not getattr(args, "fused_projections", False):
        return params
    from jaxspec.models.params import fuse_projections

    return tuple(None if p is None else fuse_projections(p) for p in params)


def load_model_timed(source: str, dtype: str, attention_backend: str = "auto"):
    """``jaxspec.models.loading.load_model`` with the attention backend set and a stderr line."""
    from jaxspec.models.loading import load_model
    from jaxspec.models.params import num_params

    print(f"loading {source} ({dtype}) ...", file=sys.stderr, flush=True)
    start = time.perf_counter()
    model = load_model(source, dtype=dtype)
    if attention_backend != model.config.attention_backend:
        model = dataclasses.replace(model, config=dataclasses.replace(model.config,
                                                                      attention_backend=attention_backend))
    print(f"loaded {source} ({model.config.num_layers} layers, {num_params(model.config) / 1e6:.1f} M params, "
          f"{dtype}) in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return model


def encode_prompt(tokenizer, text: str, chat: bool) -> List[int]:
    """Token ids of ``text``, wrapped in the tokenizer's chat template when ``chat`` and it has one."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer(text)["input_ids"])


def stop_tokens(tokenizer) -> List[int]:
    """The tokenizer's end-of-sequence ids (eos and the usual end-of-turn tokens it knows)."""
    stops = set()
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    for name in ("<|im_end|>", "<|endoftext|>", "<|eot_id|>"):
        if tokenizer is not None and name in tokenizer.get_vocab():
            stops.add(int(tokenizer.convert_tokens_to_ids(name)))
    return sorted(stops)


BATCH_FILE_FORMS = '--batch-file takes JSONL lines {"prompt": "..."} (or JSON strings), or one JSON list of those'


def _prompt_of(item: Any, where: str) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        if "prompt" not in item:
            raise ValueError(f"{where}: object without a \"prompt\" field (keys: {sorted(item)}); {BATCH_FILE_FORMS}")
        if not isinstance(item["prompt"], str):
            raise ValueError(f"{where}: \"prompt\" is a {type(item['prompt']).__name__}, not a string; "
                             f"{BATCH_FILE_FORMS}")
        return item["prompt"]
    raise ValueError(f"{where}: a JSON {type(item).__name__} is not a prompt; {BATCH_FILE_FORMS}")


def read_batch_file(path: str) -> List[str]:
    """Prompts of a ``--batch-file``: a JSON list of strings / ``{"prompt": ...}`` objects, or
    JSONL with one string or ``{"prompt": ...}`` object per line (blank lines ignored)."""
    file = pathlib.Path(path)
    text = file.read_text()
    stripped = text.strip()
    prompts: List[str] = []
    if stripped.startswith("{"):  # one object (one JSONL line, or pretty-printed): one prompt
        try:
            single = json.loads(stripped)
        except json.JSONDecodeError:
            single = None  # several JSONL lines: read below
        if single is not None:
            return [_prompt_of(single, f"{file}")]
    if stripped.startswith("["):
        try:
            data = json.loads(stripped)
        except json.JSONDecodeError as err:
            raise ValueError(f"{file}: not a JSON list ({err}); {BATCH_FILE_FORMS}") from None
        prompts = [_prompt_of(item, f"{file}: item {i}") for i, item in enumerate(data)]
    else:
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{file}:{number}: not JSON ({err}); {BATCH_FILE_FORMS}") from None
            prompts.append(_prompt_of(item, f"{file}:{number}"))
    if not prompts:
        raise ValueError(f"{file}: no prompts found; {BATCH_FILE_FORMS}")
    return prompts


def read_prompts(args) -> List[str]:
    """``--prompt``, ``--prompt-file`` or ``--batch-file`` (see :func:`read_batch_file`)."""
    given = [name for name, value in (("--prompt", args.prompt), ("--prompt-file", args.prompt_file),
                                      ("--batch-file", args.batch_file)) if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one of --prompt, --prompt-file, --batch-file (got {', '.join(given)})")
    if args.batch_file is not None:
        return read_batch_file(args.batch_file)
    if args.prompt_file is not None:
        return [pathlib.Path(args.prompt_file).read_text()]
    if args.prompt is not None:
        return [args.prompt]
    raise ValueError("give --prompt TEXT, --prompt-file F or --batch-file F")


def json_default(value):
    """``json.dumps(default=...)`` for numpy scalars and arrays and paths."""
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


def release_memory(clear_compiled: bool = False, jit_tables: Sequence[Dict[Any, Any]] = ()) -> None:
    """Hand freed host memory back to the OS (``malloc_trim``; on the CPU backend, where the arrays
    live in host memory; on an accelerator only with ``clear_compiled``); with ``clear_compiled``
    also drop every compiled executable (``jax.clear_caches()`` and the experiment's own tables of
    jitted functions, ``jit_tables``) and collect garbage.

    Measured on SmolLM2 (CPU, dustin-quality): the process grew ~0.3 GB per newly compiled variant
    while its live JAX arrays stayed constant -- glibc keeps the heap freed after XLA compiles (many
    arenas, one per compile thread); ``malloc_trim`` returned ~2/3 of it. The executables themselves
    (~0.06 GB each) only serve one context length (the cache capacity is part of every shape), so
    callers drop them when the length changes.
    """
    import ctypes
    import gc

    import jax

    if clear_compiled:
        jax.clear_caches()
        for table in jit_tables:
            table.clear()
        gc.collect()
    elif jax.default_backend() != "cpu":
        return
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass


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
