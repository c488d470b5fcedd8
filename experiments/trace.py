"""Where does the time go: run a function once under ``jax.profiler`` and summarise the trace.

:func:`device_trace` captures one call of ``fn`` and reads the XSpace back with
``jax.profiler.ProfileData`` (part of jaxlib; no TensorBoard needed), then reports, per device
plane (``/device:GPU:0``, or ``/host:CPU`` when asked for on a CPU):

* ``busy_s``: the union of the kernel intervals on the plane's stream lines -- the time the
  device was doing anything; ``span_s``: first kernel start to last kernel end; ``wall_s`` (top
  level): host time of the call. ``1 - busy_s / span_s`` is the idle (launch/sync-bound) share.
* ``top_kernels``: the kernels with the most total time (name, seconds, launches).
* ``modules``: the XLA modules (jitted functions) that ran, with their total time and count,
  when the plane has an ``XLA Modules`` line.

* ``windows`` (when the traced code ran under ``jax.profiler.TraceAnnotation`` spans whose names
  start with ``jaxspec.``, e.g. KnapSpec's plan and its stages): per annotation name, how many
  spans, their host (wall) time, the plane's busy time inside them and the kernels that started
  inside them. Host and device events share the profiler's clock, so this attributes device work
  to a part of the program without a module line (JAX's GPU planes have none).

* ``phases`` (when the caller passes the traced program's compiled text and phase names, as
  ``dustin-speed --trace`` does with the round's named scopes, ``jaxspec.decoding.speculative.ROUND_PHASES``):
  per phase, the busy time, kernel time and launches of the kernels whose HLO op (the ``hlo_op`` stat XLA
  attaches to each kernel event) carries that scope in its ``op_name`` metadata, the innermost phase of the
  scope path winning; ``other`` for ops under none of them, ``unattributed`` for events without a known op.
  This splits one fused jitted call -- a whole decode loop -- by phase on the device.

Used by ``dustin-speed --trace`` and ``knapspec --trace`` (one traced run per method, after the
timed runs; the trace is not part of any timing).
"""

from __future__ import annotations

import glob
import os
import re
import tempfile
import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

# lines of a device plane that describe (not are) kernel activity: skip them for busy time
META_LINES = ("XLA Modules", "XLA Ops", "Steps", "XLA TraceMe", "Source code", "Framework Ops",
              "Framework Name Scope", "TensorFlow Ops", "TensorFlow Name Scope", "Launch Stats")


def union_length(intervals: List[Tuple[int, int]]) -> int:
    """Total length covered by ``[start, end)`` intervals (ns)."""
    total, current_start, current_end = 0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def op_names(hlo_text: str) -> Dict[str, str]:
    """``{instruction name: op_name metadata}`` of a compiled program's text (``compiled.as_text()``), for every
    instruction that carries an ``op_name`` (fusions carry their root's). A Pallas (Triton) custom call's kernel is
    named by its ``backend_config``'s ``name``, not by the instruction, so that name maps too: to the scope path
    its calls share (the common leading components when several calls launch a kernel of that name)."""
    out: Dict[str, str] = {}
    kernels: Dict[str, List[str]] = {}
    for line in hlo_text.splitlines():
        match = re.match(r"\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=.*?op_name=\"([^\"]*)\"", line)
        if match:
            out[match.group(1)] = match.group(2)
            if "xla.gpu.triton" in line and "backend_config=" in line:
                config = line[line.index("backend_config="):]
                names = re.findall(r'[{,]\s*\\?"?name\\?"?\s*[=:]\s*\\?"([\w.$\-]+)', config)
                if names:
                    kernels.setdefault(names[-1], []).append(match.group(2))
    for kernel, scopes in kernels.items():
        if kernel in out:
            continue
        parts = [scope.split("/") for scope in scopes]
        common = []
        for level in zip(*parts):
            if any(part != level[0] for part in level):
                break
            common.append(level[0])
        out[kernel] = "/".join(common)
    return out


def phase_of(op_name: str, phases: Tuple[str, ...]) -> str:
    """The innermost component of the scope path ``op_name`` that is one of ``phases``; ``other`` if none."""
    found = [part for part in op_name.split("/") if part in phases]
    return found[-1] if found else "other"


def _stat(event, name: str):
    for key, value in getattr(event, "stats", ()):
        if key == name:
            return value
    return None


def summarize_phases(plane, names: Dict[str, str], phases: Tuple[str, ...],
                     kernel_lines: Optional[Callable[[str], bool]] = None) -> Dict[str, Any]:
    """Per phase of ``phases`` (plus ``other`` and ``unattributed``): busy time (union), kernel time, launches and top
    kernels of the plane's kernel events.

    An event's op is its ``hlo_op`` stat looked up in ``names`` (:func:`op_names`); failing that its ``tf_op`` stat (a
    scope path itself); then its own name looked up in ``names``, also with a trailing ``_N`` read as ``.N`` (a GPU
    kernel is named after its fusion, with the dot replaced: inside an XLA command buffer, whose kernels carry the
    buffer's ``hlo_op``, the name is what is left). An event still unplaced whose nearest placed neighbours on its
    stream, before and after, are in the same phase takes that phase (a cuBLAS kernel inside a command buffer carries
    neither its op nor a fusion name; a round's phases run one after another). ``attributed_by`` counts the events
    each route placed; ``unattributed_stats`` lists the stat names of the first event left unplaced,
    ``unattributed_top`` the unplaced kernels with the most time (name, ``hlo_op``, ``tf_op``, ``hlo_module``)."""
    routes: Dict[str, int] = {}
    placed: List[Tuple[Any, Optional[str], str]] = []  # (event, phase or None, route)
    for line in _kernel_lines(plane, kernel_lines):
        events = sorted((e for e in line.events if e.duration_ns > 0), key=lambda e: e.start_ns)
        found = [_place(e, names, phases) for e in events]
        after: List[Optional[str]] = [None] * len(found)  # the next placed event's phase, from each position on
        nxt = None
        for i in range(len(found) - 1, -1, -1):
            after[i] = nxt
            nxt = found[i][0] if found[i][0] is not None else nxt
        before = None  # the previous placed event's phase
        for i, (phase, route) in enumerate(found):
            if phase is None and before is not None and before == after[i]:
                phase, route = before, "neighbours"
            elif phase is not None:
                before = phase
            placed.append((events[i], phase, route))
    intervals: Dict[str, List[Tuple[int, int]]] = {}
    kernels: Dict[str, Dict[str, List[float]]] = {}  # phase -> kernel name -> [ns, count]
    unplaced: Dict[Tuple[str, str, str, str], List[float]] = {}
    unplaced_stats: Optional[List[str]] = None
    for event, phase, route in placed:
        routes[route] = routes.get(route, 0) + 1
        if phase is None:
            phase = "unattributed"
            if unplaced_stats is None:
                unplaced_stats = sorted(str(key) for key, _ in getattr(event, "stats", ()))
            key = (str(event.name)[:80], str(_stat(event, "hlo_op")), str(_stat(event, "tf_op"))[:160],
                   str(_stat(event, "hlo_module")))
            entry = unplaced.setdefault(key, [0.0, 0])
            entry[0] += event.duration_ns
            entry[1] += 1
        intervals.setdefault(phase, []).append((int(event.start_ns), int(event.start_ns + event.duration_ns)))
        entry = kernels.setdefault(phase, {}).setdefault(str(event.name), [0.0, 0])
        entry[0] += event.duration_ns
        entry[1] += 1
    out: Dict[str, Any] = {phase: {"busy_s": union_length(intervals[phase]) / 1e9,
                                   "kernel_time_s": sum(ns for ns, _ in per.values()) / 1e9,
                                   "launches": int(sum(count for _, count in per.values())),
                                   "top_kernels": _top(per, 8)}
                           for phase, per in kernels.items()}
    top = sorted(unplaced.items(), key=lambda kv: -kv[1][0])[:8]
    return {"phases": out, "attributed_by": routes, "unattributed_stats": unplaced_stats,
            "unattributed_top": [{"name": n, "hlo_op": o, "tf_op": t, "hlo_module": m, "total_s": ns / 1e9,
                                  "count": int(c)} for (n, o, t, m), (ns, c) in top]}


def _place(event, names: Dict[str, str], phases: Tuple[str, ...]) -> Tuple[Optional[str], str]:
    """(phase, route) of one kernel event by its own stats and name; (None, "none") when they do not tell."""
    op, scope = _stat(event, "hlo_op"), _stat(event, "tf_op")
    if op is not None and str(op) in names:
        return phase_of(names[str(op)], phases), "hlo_op"
    if scope is not None and "/" in str(scope):
        return phase_of(str(scope), phases), "tf_op"
    name = _bare(event.name)  # XLA:CPU marks an async op's completion as "end: <op>"
    for candidate in (name, re.sub(r"_(\d+)$", r".\1", name), re.sub(r"__\d+$", "", name)):
        if candidate in names:
            return phase_of(names[candidate], phases), "kernel_name"
    return None, "none"


def _bare(name) -> str:
    name = str(name)
    return name[len("end: "):] if name.startswith("end: ") else name


def _top(totals: Dict[str, List[float]], top: int) -> List[Dict[str, Any]]:
    rows = sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]
    return [{"name": name[:160], "total_s": ns / 1e9, "count": int(count)} for name, (ns, count) in rows]


def _kernel_lines(plane, kernel_lines: Optional[Callable[[str], bool]] = None):
    """The plane's kernel lines: all but META_LINES by default; never the XLA Modules line."""
    is_kernel_line = kernel_lines or (lambda name: name not in META_LINES)
    return [line for line in plane.lines if line.name != "XLA Modules" and is_kernel_line(line.name)]


def _kernel_events(plane, kernel_lines: Optional[Callable[[str], bool]] = None):
    """The plane's kernel events: non-empty events on its kernel lines (:func:`_kernel_lines`)."""
    for line in _kernel_lines(plane, kernel_lines):
        yield from (event for event in line.events if event.duration_ns > 0)


def summarize_plane(plane, top: int = 25, kernel_lines: Optional[Callable[[str], bool]] = None) -> Dict[str, Any]:
    """Busy time, span, top kernels and modules of one XPlane (see the module doc)."""
    intervals: List[Tuple[int, int]] = []
    kernels: Dict[str, List[float]] = {}
    modules: Dict[str, List[float]] = {}
    line_names = []
    for line in plane.lines:
        line_names.append(line.name)
        if line.name == "XLA Modules":
            for event in line.events:
                entry = modules.setdefault(event.name, [0.0, 0])
                entry[0] += event.duration_ns
                entry[1] += 1
    for event in _kernel_events(plane, kernel_lines):
        intervals.append((int(event.start_ns), int(event.start_ns + event.duration_ns)))
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += event.duration_ns
        entry[1] += 1
    span = (max(e for _, e in intervals) - min(s for s, _ in intervals)) if intervals else 0
    return {"busy_s": union_length(intervals) / 1e9, "span_s": span / 1e9,
            "kernel_time_s": sum(v[0] for v in kernels.values()) / 1e9,
            "launches": int(sum(v[1] for v in kernels.values())), "distinct_kernels": len(kernels),
            "top_kernels": _top(kernels, top), "modules": _top(modules, top), "lines": line_names}


#: profiler annotations (jax.profiler.TraceAnnotation names) that device_trace summarises as windows
WINDOW_PREFIX = "jaxspec."


def annotation_spans(planes, prefix: str = WINDOW_PREFIX) -> Dict[str, List[Tuple[int, int]]]:
    """``{name: [(start_ns, end_ns), ...]}`` of the events on host planes (``/host:``) whose name starts with
    ``prefix`` (the code's own ``jax.profiler.TraceAnnotation`` spans)."""
    spans: Dict[str, List[Tuple[int, int]]] = {}
    for plane in planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for event in line.events:
                if event.name.startswith(prefix) and event.duration_ns > 0:
                    spans.setdefault(event.name, []).append((int(event.start_ns),
                                                             int(event.start_ns + event.duration_ns)))
    return spans


def _clipped(intervals: List[Tuple[int, int]], windows: List[Tuple[int, int]]) -> List[Tuple[int, int]]:
    out = []
    for start, end in intervals:
        for w_start, w_end in windows:
            lo, hi = max(start, w_start), min(end, w_end)
            if hi > lo:
                out.append((lo, hi))
    return out


def summarize_windows(plane, spans: Dict[str, List[Tuple[int, int]]],
                      kernel_lines: Optional[Callable[[str], bool]] = None) -> Dict[str, Dict[str, Any]]:
    """Per annotation name (:func:`annotation_spans`): ``count`` spans, ``wall_s`` (their total length),
    ``busy_s`` (the union of the plane's kernel intervals inside them), ``launches`` (kernels that started
    inside them) and ``idle_share`` (1 - busy / wall)."""
    kernels = [(int(e.start_ns), int(e.start_ns + e.duration_ns)) for e in _kernel_events(plane, kernel_lines)]
    out = {}
    for name, windows in sorted(spans.items()):
        wall = union_length(windows)
        busy = union_length(_clipped(kernels, windows))
        launches = sum(1 for start, _ in kernels if any(w0 <= start < w1 for w0, w1 in windows))
        out[name] = {"count": len(windows), "wall_s": wall / 1e9, "busy_s": busy / 1e9, "launches": launches,
                     "idle_share": 1 - busy / wall if wall else None}
    return out


def summarize_profile(data, prefixes: Iterable[str] = ("/device:",), top: int = 25,
                      kernel_lines: Optional[Callable[[str], bool]] = None, names: Optional[Dict[str, str]] = None,
                      phases: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """:func:`summarize_plane` for every plane whose name starts with one of ``prefixes``; with ``names`` and
    ``phases`` also :func:`summarize_phases`."""
    prefixes = tuple(prefixes)
    spans = annotation_spans(data.planes)
    out = {}
    for plane in data.planes:
        if plane.name.startswith(prefixes):
            out[plane.name] = summarize_plane(plane, top, kernel_lines)
            if spans:
                out[plane.name]["windows"] = summarize_windows(plane, spans, kernel_lines)
            if names and phases:
                if any(phase_of(name, tuple(phases)) != "other" for name in names.values()):
                    split = summarize_phases(plane, names, tuple(phases), kernel_lines)
                    out[plane.name]["phases"] = split["phases"]
                    out[plane.name]["phases_attributed_by"] = split["attributed_by"]
                    if split["unattributed_stats"] is not None:
                        out[plane.name]["phases_unattributed_stats"] = split["unattributed_stats"]
                        out[plane.name]["phases_unattributed_top"] = split["unattributed_top"]
                else:  # a split with every kernel under "other" would read as a measurement
                    out[plane.name]["phases_error"] = f"the compiled text names none of the phases {list(phases)}"
            elif phases:
                out[plane.name]["phases_error"] = "no compiled text to attribute the kernels by"
    return out


def device_trace(fn: Callable[[], Any], *, top: int = 25, prefixes: Iterable[str] = ("/device:",),
                 kernel_lines: Optional[Callable[[str], bool]] = None, keep_dir: Optional[str] = None,
                 hlo_text: Optional[str] = None, phases: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """Run ``fn()`` once (it must block until its work is done) under the profiler; return
    ``{"wall_s", "planes": {name: summary}}``. ``keep_dir``: also keep the raw trace there (for
    TensorBoard / Perfetto); otherwise it goes to a temporary folder that is deleted. ``hlo_text`` (the
    traced program's ``compiled.as_text()``) and ``phases`` (named scopes in it): each plane's ``phases``."""
    import jax
    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        where = keep_dir or tmp
        os.makedirs(where, exist_ok=True)
        with jax.profiler.trace(where):
            start = time.perf_counter()
            fn()
            wall = time.perf_counter() - start
        paths = sorted(glob.glob(os.path.join(where, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
        if not paths:
            raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {where}")
        data = ProfileData.from_file(paths[-1])
        planes = summarize_profile(data, prefixes, top, kernel_lines, op_names(hlo_text) if hlo_text else None,
                                   phases)
    return {"wall_s": wall, "planes": planes}


def trace_on_backend(fn: Callable[[], Any], label: str = "", top: int = 25, *, hlo_text: Optional[str] = None,
                     phases: Tuple[str, ...] = ()) -> Dict[str, Any]:
    """:func:`device_trace` with the planes of the default backend: the device planes on a GPU/TPU;
    on a CPU (no device plane) the host plane, counting XLA's worker threads and not the Python
    tracer's line. Prints :func:`format_summary` to stderr under ``label``."""
    import sys

    import jax

    if jax.default_backend() == "cpu":
        summary = device_trace(fn, top=top, prefixes=("/host:CPU",),
                               kernel_lines=lambda name: name not in META_LINES and name != "python",
                               hlo_text=hlo_text, phases=phases)
    else:
        summary = device_trace(fn, top=top, hlo_text=hlo_text, phases=phases)
    summary["backend"] = jax.default_backend()
    if label:
        print(f"{label}\n{format_summary(summary)}", file=sys.stderr, flush=True)
    return summary


def trace_or_error(fn: Callable[[], Any], label: str, **phase_args) -> Dict[str, Any]:
    """:func:`trace_on_backend` for the experiments' ``--trace``: a profiler that fails (no CUPTI,
    say) is reported as ``{"error": ...}`` and must not lose the timed results already measured."""
    import sys

    try:
        return trace_on_backend(fn, label, **phase_args)
    except Exception as error:
        print(f"{label} failed: {error!r}", file=sys.stderr, flush=True)
        return {"error": repr(error)}


def format_summary(summary: Dict[str, Any], top: int = 8) -> str:
    """A few printable lines per plane: busy/span/wall and the top kernels."""
    lines = []
    for name, plane in summary["planes"].items():
        idle = 1 - plane["busy_s"] / plane["span_s"] if plane["span_s"] else float("nan")
        lines.append(f"  {name}: wall {summary['wall_s'] * 1e3:.2f} ms, span {plane['span_s'] * 1e3:.2f} ms, busy "
                     f"{plane['busy_s'] * 1e3:.2f} ms (idle {idle:.0%}), {plane['launches']} launches")
        for k in plane["top_kernels"][:top]:
            lines.append(f"    {k['total_s'] * 1e3:8.3f} ms  x{k['count']:<5d} {k['name'][:90]}")
        for window, w in plane.get("windows", {}).items():
            lines.append(f"    window {window}: {w['count']} span(s), wall {w['wall_s'] * 1e3:.2f} ms, busy "
                         f"{w['busy_s'] * 1e3:.2f} ms, {w['launches']} launches")
        for phase, p in plane.get("phases", {}).items():
            lines.append(f"    phase {phase}: busy {p['busy_s'] * 1e3:.2f} ms, {p['launches']} launches")
        if "phases_attributed_by" in plane:
            lines.append(f"    phases attributed by {plane['phases_attributed_by']}"
                         + (f"; an unplaced event's stats: {plane['phases_unattributed_stats']}"
                            if "phases_unattributed_stats" in plane else ""))
        if "phases_error" in plane:
            lines.append(f"    phases: {plane['phases_error']}")
    return "\n".join(lines)


__all__ = ["WINDOW_PREFIX", "annotation_spans", "device_trace", "format_summary", "op_names", "phase_of",
           "summarize_phases", "summarize_plane", "summarize_profile", "summarize_windows", "trace_on_backend",
           "trace_or_error"]
