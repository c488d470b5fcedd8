"""Measured arbitration between speculative rounds and plain decoding (docs/methods.md §5.2).

:func:`measured_arbitration` is the one rule, shared by KnapSpec's driver (after a plan that drafts,
:class:`~jaxspec.knapspec.controller.KnapSpecController`) and :class:`MeasuredChoiceController` (any
speculative method): on the live sequence, run a few speculative rounds, then as many plain
autoregressive steps (both commit real tokens), and keep the faster in tokens committed per second.
Both probes have fixed shapes (``max_rounds`` and the plain step count are traced), so nothing
compiles in a timed run whichever wins, and a method that does not pay at this context and batch
costs at most its probe.

:class:`MeasuredChoiceController` makes the choice per ``(context, batch)``: the key is the active
row count and the power-of-two bucket of the mean context length at the probe. A decision of a timed
run is remembered by the controller object, so a later run at the same key skips the probe (the
warm-up run's probe timings include compiles and are never remembered); ``reprobe_rounds`` probes
again after that many rounds, as the context grows.
"""

from __future__ import annotations

import json
import math
import pathlib
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from jaxspec.decoding.contract import Chunk, ScriptedController


#: the default margin of a :class:`ChoiceTable`: speculate only where the measured whole-run speed-up is at
#: least 1 + this (2 %: the spread of the paired AR runs of one case on the H200, docs/results.md)
CHOICE_MARGIN = 0.02


class ChoiceTable:
    """Whole-run speed-ups measured ahead of time, per method and ``(context bucket, batch)``, for one
    target/draft pair on one device (docs/methods.md §5.2).

    A probe of a few rounds right after the prefill prices speculation by its first rounds, which commit
    fewer tokens a row than a whole run does, and the probe itself costs a few percent of a 256-token
    decode. With a table, :class:`MeasuredChoiceController` takes its decision for a key the table holds
    from the measured speed-up of whole runs instead (speculate when it is at least ``1 + margin``; plain
    decoding otherwise, with no probe at all) and probes only where the table has no entry.

    ``entries``: dicts with ``method`` (the name the table is looked up by), ``context_bucket`` (a power of
    two: :func:`context_bucket` of the run at its start), ``batch`` (rows), ``speedup`` (whole run against
    AR in the same process) and optionally ``ar_step_s`` (a plain step's seconds, from the paired AR run;
    recorded, not used to decide) and ``measured`` (the runs it came from). ``meta``: what the speed-ups were measured on
    (``target``, ``draft``, ``device``, ...), kept in the file and the run's metrics."""

    def __init__(self, entries: Sequence[Mapping[str, Any]], margin: float = CHOICE_MARGIN,
                 meta: Optional[Mapping[str, Any]] = None):
        if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not 0 <= margin < 1:
            raise ValueError(f"margin={margin!r} must be a number in [0, 1) (speculate at speed-up >= 1 + margin)")
        self.margin, self.meta = float(margin), dict(meta or {})
        self.entries: Dict[Tuple[str, int, int], Dict[str, Any]] = {}
        for i, entry in enumerate(entries):
            self._check(i, entry)
            key = (str(entry["method"]), int(entry["context_bucket"]), int(entry["batch"]))
            if key in self.entries:
                raise ValueError(f"choice table entry {i}: method {key[0]!r} at context bucket {key[1]}, batch "
                                 f"{key[2]} appears twice (one entry per key: combine the runs first)")
            self.entries[key] = dict(entry)

    @staticmethod
    def _check(i: int, entry: Mapping[str, Any]) -> None:
        missing = [k for k in ("method", "context_bucket", "batch", "speedup") if k not in entry]
        if missing:
            raise ValueError(f"choice table entry {i}: missing {', '.join(missing)} (needs method, context_bucket, "
                             f"batch, speedup)")
        bucket, batch, speedup = entry["context_bucket"], entry["batch"], entry["speedup"]
        if isinstance(bucket, bool) or not isinstance(bucket, int) or bucket < 1 or bucket & (bucket - 1):
            raise ValueError(f"choice table entry {i}: context_bucket={bucket!r} must be a power of two (the bucket "
                             f"of the run's mean context length at its start)")
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            raise ValueError(f"choice table entry {i}: batch={batch!r} must be an integer >= 1")
        if isinstance(speedup, bool) or not isinstance(speedup, (int, float)) or not speedup > 0 \
                or not math.isfinite(speedup):
            raise ValueError(f"choice table entry {i}: speedup={speedup!r} must be a finite number > 0")
        step = entry.get("ar_step_s")
        if step is not None and (isinstance(step, bool) or not isinstance(step, (int, float)) or not step > 0):
            raise ValueError(f"choice table entry {i}: ar_step_s={step!r} must be None or seconds > 0")

    def lookup(self, method: str, bucket: int, batch: int) -> Optional[Dict[str, Any]]:
        """The entry for exactly this key, or None (the controller then probes)."""
        return self.entries.get((str(method), int(bucket), int(batch)))

    def decide(self, entry: Mapping[str, Any]) -> str:
        """``"speculative"`` when the entry's speed-up is at least ``1 + margin``, else ``"ar"``."""
        return "speculative" if float(entry["speedup"]) >= 1.0 + self.margin else "ar"

    def to_json(self) -> Dict[str, Any]:
        return {"kind": "jaxspec choice table", "margin": self.margin, "meta": self.meta,
                "entries": [self.entries[k] for k in sorted(self.entries)]}

    def save(self, path) -> pathlib.Path:
        path = pathlib.Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        tmp.replace(path)
        return path

    @classmethod
    def load(cls, path, margin: Optional[float] = None) -> "ChoiceTable":
        """Read a table written by :meth:`save`; ``margin`` overrides the file's."""
        path = pathlib.Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"choice table {path}: no such file (write one with `python -m experiments.run "
                                    f"choice-table`)")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"choice table {path}: not JSON ({err})") from None
        if not isinstance(data, dict) or data.get("kind") != "jaxspec choice table" or not isinstance(
                data.get("entries"), list):
            raise ValueError(f"choice table {path}: not a jaxspec choice table (expected kind 'jaxspec choice "
                             f"table' and a list of entries)")
        return cls(data["entries"], margin=data.get("margin", CHOICE_MARGIN) if margin is None else margin,
                   meta=data.get("meta"))

    def rows(self) -> List[Dict[str, Any]]:
        """Every entry with the decision it gives, sorted by method, context and batch."""
        return [dict(self.entries[k], choice=self.decide(self.entries[k])) for k in sorted(self.entries)]


def measured_arbitration(run, speculative: Callable, plain: Callable, *, rounds: int,
                         ar_model_rate: Optional[Callable[[int], float]] = None, ar_model_floor: bool = True,
                         warmup_speculative: Optional[Callable] = None, warmup_plain: Optional[Callable] = None):
    """Generator (``yield from`` it inside a :class:`~jaxspec.decoding.contract.ScriptedController`):
    ``speculative()`` / ``plain()`` are generators that run the two probes (yielding chunks) and return
    the rounds / steps they ran. Returns ``(probe, units)``: ``probe`` is ``None`` when every row finished
    during the speculative probe, else a dict with both rates and ``"choice"`` (``"speculative"`` or
    ``"ar"``); ``units`` the rounds + steps run. ``ar_model_rate(active_rows)``: a predicted
    plain-decoding rate; the better of it and the measured one is used (a short probe's fixed per-call
    cost weighs more on a few cheap AR steps than on the longer speculative rounds). ``plain()`` may
    return ``(steps, step_s)``: a plain step's time measured without the per-call cost (see
    :func:`two_stretch_step`), which then prices the plain rate; the mean over the probe is kept too.
    ``speculative()`` may likewise return ``(rounds, round_s)``: the speculative rate is then the probe's
    tokens per round over that round time. ``ar_model_floor=False`` records the model's rate without
    letting it decide (for probes whose two sides are both priced without per-call costs).
    ``warmup_speculative`` / ``warmup_plain``: generators like those two, run untimed just before each side's
    timed part (their tokens are committed like any other): the first call after a switch of plan or mode
    pays one-time costs (a program's first run, host-side state changes) that would otherwise be charged to
    that side's few timed rounds (docs/methods.md §5.2). Their times are kept in the probe record."""
    warm = {}

    def untimed(side, generator):
        if generator is None:
            return 0
        start, committed = time.perf_counter(), run.committed_total()
        units = yield from generator()
        warm[f"{side}_warmup_units"], warm[f"{side}_warmup_tokens"] = int(units), run.committed_total() - committed
        warm[f"{side}_warmup_s"] = time.perf_counter() - start
        return int(units)

    active = int(np.sum(~np.asarray(run.state.done)))
    spec_warm = yield from untimed("speculative", warmup_speculative)
    if run.finished():
        return None, spec_warm
    n0, t0 = run.committed_total(), time.perf_counter()
    spec_units = yield from speculative()
    n1, t1 = run.committed_total(), time.perf_counter()
    spec_units, round_s = spec_units if isinstance(spec_units, tuple) else (spec_units, None)
    spec_timed, spec_units = int(spec_units), int(spec_units) + spec_warm
    if run.finished():
        return None, spec_units
    plain_warm = yield from untimed("ar", warmup_plain)
    if run.finished():
        return None, spec_units + plain_warm
    n2, t2 = run.committed_total(), time.perf_counter()
    plain_units = yield from plain()
    n3, t3 = run.committed_total(), time.perf_counter()
    plain_units, marginal_s = plain_units if isinstance(plain_units, tuple) else (plain_units, None)
    spec_mean, ar_mean = (n1 - n0) / max(t1 - t0, 1e-9), (n3 - n2) / max(t3 - t2, 1e-9)
    spec_rate = spec_mean if not (round_s and spec_timed) else (n1 - n0) / spec_timed / round_s
    ar_measured = ar_mean if not marginal_s else (n3 - n2) / plain_units / marginal_s
    ar_model = None if ar_model_rate is None else float(ar_model_rate(active))
    ar_rate = max(ar_measured, ar_model or 0.0) if ar_model_floor else ar_measured
    mean_step = (t3 - t2) / plain_units if plain_units else None
    mean_round = (t1 - t0) / spec_timed if spec_timed else None
    probe = {"rounds": int(rounds), "speculative_tokens": n1 - n0, "speculative_s": t1 - t0,
             "ar_tokens": n3 - n2, "ar_s": t3 - t2, "ar_steps": int(plain_units),
             "ar_step_s": marginal_s or mean_step, "ar_step_s_mean": mean_step,
             "speculative_round_s": round_s or mean_round, "speculative_round_s_mean": mean_round,
             "speculative_tokens_per_s": spec_rate, "speculative_tokens_per_s_mean": spec_mean,
             "ar_tokens_per_s": ar_rate, "ar_tokens_per_s_measured": ar_measured, "ar_tokens_per_s_mean": ar_mean,
             "ar_tokens_per_s_model": ar_model, "choice": "speculative" if spec_rate >= ar_rate else "ar", **warm}
    return probe, spec_units + plain_warm + plain_units


def two_stretch_step(first_s: float, first_steps: int, second_s: float, second_steps: int) -> Optional[float]:
    """A plain step's seconds from two stretches of different lengths, each ``fixed + steps x step``:
    ``(second_s - first_s) / (second_steps - first_steps)``, the per-call cost (dispatch, the stretch's
    host reads) cancelled. After its probe a run decodes plainly in one long stretch, so this is the
    price that decides (docs/methods.md §5.2). None when the lengths are equal or the difference is not
    positive (timing noise): the caller keeps the mean."""
    if second_steps <= first_steps:
        return None
    step = (second_s - first_s) / (second_steps - first_steps)
    return step if step > 0 else None


def two_stretches(stretch: Callable, units: int):
    """Generator: run ``units`` rounds or plain steps as two calls, a quarter (at least 1) and then the rest,
    timed apart. ``stretch(n)`` is a generator that runs ``n`` and returns how many ran. Returns ``(units
    run, seconds per unit)``, the latter from :func:`two_stretch_step` or None: None when ``units`` is too short for
    two different lengths, when rows finished inside a stretch (the lengths that ran are not the ones
    asked) or when the difference is not positive (timing noise)."""
    units = int(units)
    first = max(1, units // 4)
    if units - first <= first:  # too short to tell two lengths apart
        return (yield from stretch(units)), None
    t0 = time.perf_counter()
    done = yield from stretch(first)
    t1 = time.perf_counter()
    rest = yield from stretch(units - first)
    t2 = time.perf_counter()
    if done < first or rest < units - first:
        return done + rest, None
    return done + rest, two_stretch_step(t1 - t0, first, t2 - t1, rest)


def remaining_steps(run) -> int:
    """The most tokens an active row still generates (0 when every row finished)."""
    state = run.state
    left = np.asarray(run.engine.max_new_tokens - state.num_out)[~np.asarray(state.done)]
    return int(left.max(initial=0))


def bucket_of(length: float) -> int:
    """The power of two at or above ``length`` (at least 1): the context bucket of a mean context length."""
    return int(2 ** int(np.ceil(np.log2(max(float(length), 1.0)))))


def start_bucket(prompt_length: float) -> int:
    """The context bucket a run with prompts of ``prompt_length`` tokens starts in: its committed length is the
    prompt plus the token the prefill produced (so a 16,384-token prompt starts in bucket 32,768). Tables built
    from measured runs key them by this, as :func:`context_bucket` looks them up."""
    return bucket_of(float(prompt_length) + 1)


def context_bucket(run) -> int:
    """The power of two at or above the active rows' mean context length (prompt + generated)."""
    state = run.state
    active = ~np.asarray(state.done)
    lengths = np.asarray(state.committed)[active] if active.any() else np.asarray(state.committed)
    return bucket_of(float(np.mean(lengths)))


def pooled_rates(tokens, rounds: int, prior_rounds: Optional[float] = None) -> np.ndarray:
    """Each row's tokens per round, shrunk toward the batch mean: ``(tokens_i + m mean) / (rounds + m)``
    with ``m = prior_rounds`` (None: ``rounds``, i.e. half the weight on the batch). After a few rounds a
    row's own rate is noisy and the slowest of 16 such rates is far below that row's true rate, so
    finishing times taken from it come out far too long (docs/methods.md §5.2); ``prior_rounds=0`` keeps
    the rows' own rates."""
    if prior_rounds is not None and prior_rounds < 0:
        raise ValueError(f"prior_rounds={prior_rounds!r} must be >= 0 or None")
    tokens = np.asarray(tokens, np.float64)
    rounds = max(int(rounds), 1)
    if tokens.size == 0:
        return tokens
    m = float(rounds if prior_rounds is None else prior_rounds)
    mean = tokens.mean() / rounds
    return (tokens + m * mean) / (rounds + m)


def finish_times(round_s: float, step_s: float, left, tokens_per_round) -> Tuple[float, float]:
    """Seconds until every active row is done ``(speculative, plain)``: the batched loop runs until
    its slowest row finishes, so speculation needs ``max_i left_i / tokens_per_round_i`` rounds of
    ``round_s`` and plain decoding ``max_i left_i`` steps of ``step_s`` (docs/methods.md §5.2)."""
    left = np.asarray(left, np.float64)
    rate = np.maximum(np.asarray(tokens_per_round, np.float64), 1e-9)
    if left.size == 0:
        return 0.0, 0.0
    return float(round_s * np.max(np.ceil(left / rate))), float(step_s * np.max(left))


def simulated_tail_switch(rounds_per_row, round_s: float, step_s: float, new_tokens: int, after: int,
                          every: int, prior_rounds: Optional[float] = None, opening_rounds: int = 8,
                          opening_pace: float = 0.6, margin: float = 0.0) -> Optional[int]:
    """The round at which the tail check (checks every ``every`` rounds from round ``after`` on) would switch
    a measured run to plain decoding, or None if it never would (docs/methods.md §5.2). Row i commits
    ``new_tokens / rounds_per_row[i]`` tokens a round, times ``opening_pace`` in the first
    ``opening_rounds`` rounds (opening rounds are slower than a whole run's mean); ``round_s`` and
    ``step_s`` are the run's round and plain step prices. An estimate of what the guard does on a run whose
    per-round trajectory was not recorded, not a replay."""
    rounds_per_row = np.asarray(rounds_per_row, np.float64)
    rate = new_tokens / np.maximum(rounds_per_row, 1)
    out = np.zeros_like(rate)
    for n in range(1, 8 * int(rounds_per_row.max()) + 8):
        out = np.minimum(out + rate * (opening_pace if n <= opening_rounds else 1.0), new_tokens)
        active = out < new_tokens
        if not active.any():
            return None
        if n >= after and n % every == 0:
            per_round = pooled_rates(out[active], n, prior_rounds)
            spec_s, plain_s = finish_times(round_s, step_s, new_tokens - out[active], per_round)
            if plain_s < spec_s * (1.0 - margin):
                return n
    return None


class MeasuredChoiceController(ScriptedController):
    """Speculation only where it pays: probe ``probe_rounds`` speculative rounds against as many plain
    decoding steps on the live sequence (:func:`measured_arbitration`), then run the rest of the run
    (or ``reprobe_rounds`` rounds, then probe again) in the faster mode. Decisions of timed runs are
    remembered per ``(context bucket, active rows)`` (see the module doc); ``remember=False`` probes
    every run. ``metrics["arbitration"]`` lists the probes and the choices.

    ``tail_check=R``: while speculating, return to the host every ``R`` rounds and compare the time
    to finish the whole batch both ways (:func:`finish_times`: each row's tokens per round since
    speculation began, pooled toward the batch mean by :func:`pooled_rates` with ``tail_prior_rounds``,
    the measured round time, the probe's plain step time); switch to plain
    decoding for the rest once that is sooner. A probe's rates are means over the rows, but the
    loop waits for its slowest row, so a batch with a few low-acceptance rows can be faster in plain
    decoding than its probe says (docs/methods.md §5.2). The tail check guards probed (and remembered)
    decisions from their first chunk on. A ``table`` decision stands for the run by default, since the
    table's speed-ups were measured over whole runs, slowest rows and opening rounds included;
    ``table_tail_after=N`` tail-checks it too, from its ``N``-th round on (judged by the rounds since
    speculation began and the entry's ``ar_step_s``): a row far slower than those of the table's run (a
    straggler) is then caught once the opening rounds weigh little in its rate. Such a switch needs plain
    decoding to finish at least ``table_tail_margin`` (10 %) sooner: at round 32 a row's rate still carries
    the slow opening rounds (8 of 32 at about 0.6x pace: ~10 % low), and a near-tie is no evidence against
    a whole-run measurement (docs/methods.md §5.2).

    ``probe_warmup=N``: before each side of a probe, N rounds (plain steps) run untimed, their tokens kept, so a
    first call's one-time costs do not decide (:func:`measured_arbitration`)."""

    def __init__(self, probe_rounds: int = 8, reprobe_rounds: Optional[int] = None, remember: bool = True,
                 tail_check: Optional[int] = None, tail_prior_rounds: Optional[float] = None,
                 table: Optional[ChoiceTable] = None, table_method: Optional[str] = None,
                 table_tail_after: Optional[int] = None, table_tail_margin: float = 0.1, probe_warmup: int = 0):
        if isinstance(probe_rounds, bool) or not isinstance(probe_rounds, int) or probe_rounds < 1:
            raise ValueError(f"probe_rounds={probe_rounds!r} must be an integer >= 1")
        if isinstance(probe_warmup, bool) or not isinstance(probe_warmup, int) or probe_warmup < 0:
            raise ValueError(f"probe_warmup={probe_warmup!r} must be an integer >= 0 (untimed rounds before each "
                             f"side of a probe)")
        self.probe_warmup = probe_warmup
        if reprobe_rounds is not None and (isinstance(reprobe_rounds, bool) or not isinstance(reprobe_rounds, int)
                                           or reprobe_rounds < 1):
            raise ValueError(f"reprobe_rounds={reprobe_rounds!r} must be None (probe once) or an integer >= 1")
        if tail_check is not None and (isinstance(tail_check, bool) or not isinstance(tail_check, int)
                                       or tail_check < 1):
            raise ValueError(f"tail_check={tail_check!r} must be None (no tail check) or an integer >= 1")
        self.probe_rounds, self.reprobe_rounds, self.remember = probe_rounds, reprobe_rounds, remember
        if tail_prior_rounds is not None and (isinstance(tail_prior_rounds, bool) or tail_prior_rounds < 0):
            raise ValueError(f"tail_prior_rounds={tail_prior_rounds!r} must be None (as many as observed) or >= 0 "
                             f"(0: each row's own rate)")
        self.tail_check, self.tail_prior_rounds = tail_check, tail_prior_rounds
        if table is not None and not table_method:
            raise ValueError("a choice table needs table_method: the method name its entries are looked up by")
        self.table, self.table_method = table, table_method
        if table_tail_after is not None and (isinstance(table_tail_after, bool) or not isinstance(table_tail_after, int)
                                             or table_tail_after < 1):
            raise ValueError(f"table_tail_after={table_tail_after!r} must be None (a table's decision stands) or an "
                             f"integer >= 1 (tail-check it from that round on)")
        if table_tail_after is not None and (tail_check is None or table is None):
            raise ValueError(f"table_tail_after={table_tail_after} needs tail_check (the check's interval) and a "
                             f"table (the decisions it guards)")
        if isinstance(table_tail_margin, bool) or not isinstance(table_tail_margin, (int, float)) \
                or not 0 <= table_tail_margin < 1:
            raise ValueError(f"table_tail_margin={table_tail_margin!r} must be a number in [0, 1) (switch when plain "
                             f"decoding finishes at least that share sooner)")
        self.table_tail_after, self.table_tail_margin = table_tail_after, float(table_tail_margin)
        self.decisions: Dict[Tuple[int, int], str] = {}
        self.step_seconds: Dict[Tuple[int, int], float] = {}  # the probes' plain step time per key

    def _speculative(self, run, rounds: int):
        # a bounded chunk, never None: the traced round limit keeps one compile for probes and stretches
        yield Chunk(rounds=int(rounds))
        return run.last_chunk

    def _plain(self, run, steps: int):
        steps = min(int(steps), remaining_steps(run))
        if steps <= 0:
            return 0
        yield Chunk(plain_steps=steps)
        return steps

    def _plain_probe(self, run, steps: int):
        """The probe's plain steps as two stretches, a quarter then the rest, timed apart, so that the
        step's price comes without the per-call cost (:func:`two_stretch_step`). Returns ``(steps run,
        step seconds or None)``."""
        steps = min(int(steps), remaining_steps(run))
        return (yield from two_stretches(lambda n: self._plain(run, n), steps))

    def chunks(self, run):
        self.events = []
        limit = run.engine.max_new_tokens  # more rounds than any row can need
        while not run.finished():
            key = (context_bucket(run), int(np.sum(~np.asarray(run.state.done))))
            choice, probe = self.decisions.get(key) if self.remember else None, None
            entry = None if self.table is None else self.table.lookup(self.table_method, *key)
            if entry is not None:  # measured whole runs decide; no probe (docs/methods.md §5.2)
                choice = self.table.decide(entry)
            elif choice is None:
                warm = self.probe_warmup
                probe, _ = yield from measured_arbitration(
                    run, lambda: self._speculative(run, self.probe_rounds),
                    lambda: self._plain_probe(run, self.probe_rounds), rounds=self.probe_rounds,
                    warmup_speculative=(lambda: self._speculative(run, warm)) if warm else None,
                    warmup_plain=(lambda: self._plain(run, warm)) if warm else None)
                if probe is None:  # every row finished in the speculative probe
                    break
                choice = probe["choice"]
                if run.warmup and choice == "ar" and not run.finished():
                    # compile what a timed run that speculates after its probe needs: the draft's catch-up
                    # on the probe's plain tokens (docs/methods.md §5.2), whatever the warm-up's probe chose
                    yield from self._speculative(run, 1)
                if self.remember and not run.warmup and not run.profiling:
                    self.decisions[key] = choice
                    if probe.get("ar_step_s"):
                        self.step_seconds[key] = probe["ar_step_s"]
            step_s = probe.get("ar_step_s") if probe is not None else self.step_seconds.get(key)
            if entry is not None:  # a plain step's price from the table's paired AR run, if it has one
                step_s = entry.get("ar_step_s") if self.table_tail_after is not None else None
            event = {"context_bucket": key[0], "active_rows": key[1], "choice": choice, "probe": probe,
                     "remembered": probe is None and entry is None}
            if entry is not None:
                event.update(reason="table", table_speedup=float(entry["speedup"]), table_margin=self.table.margin)
            self.events.append(event)
            span = limit if self.reprobe_rounds is None else self.reprobe_rounds
            if run.finished():
                break
            # a table's decision is tail-checked only from its table_tail_after-th round: its speed-up is over
            # whole runs, which include the opening rounds whose pace an early check would judge it by
            # (docs/methods.md §5.2)
            if choice == "speculative" and self.tail_check is not None and step_s:
                after = 0 if entry is None else self.table_tail_after
                margin = 0.0 if entry is None else self.table_tail_margin
                if (yield from self._speculate_to_tail(run, span, step_s, after, margin)):
                    continue  # span done (re-probe) or every row finished
                yield from self._plain(run, remaining_steps(run))  # the tail in plain decoding
            elif choice == "speculative":
                yield from self._speculative(run, span)
            else:
                yield from self._plain(run, span if self.reprobe_rounds is not None else remaining_steps(run))
        if run.warmup:  # compile both modes whichever the probe chose
            if not run.finished():
                yield Chunk(plain_steps=1)

    def _speculate_to_tail(self, run, span: int, step_s: float, after: int = 0, margin: float = 0.0):
        """Speculate for up to ``span`` rounds, the first ``after`` of them unchecked, then in chunks of
        ``tail_check``; returns True when the span ended or every row finished, False when plain decoding
        will finish the batch sooner (by at least ``margin`` of the speculative finish)."""
        start_out = np.asarray(run.state.num_out).copy()
        spent, rounds = 0.0, 0
        while rounds < span and not run.finished():
            t0 = time.perf_counter()
            chunk = max(self.tail_check, after - rounds)  # the unchecked opening as one chunk
            rounds += (yield from self._speculative(run, min(chunk, span - rounds)))
            spent += time.perf_counter() - t0
            if run.finished() or rounds >= span:
                return True
            state = run.state
            active = ~np.asarray(state.done)
            out = np.asarray(state.num_out)
            left = run.engine.max_new_tokens - out[active]
            per_round = pooled_rates((out - start_out)[active], rounds, self.tail_prior_rounds)
            spec_s, plain_s = finish_times(spent / max(rounds, 1), step_s, left, per_round)
            if plain_s < spec_s * (1.0 - margin):
                self.events.append({"context_bucket": context_bucket(run), "active_rows": int(active.sum()),
                                    "choice": "ar", "reason": "tail", "after_rounds": rounds,
                                    "speculative_finish_s": spec_s, "plain_finish_s": plain_s,
                                    "tail_prior_rounds": self.tail_prior_rounds, "unchecked_rounds": after,
                                    "margin": margin,
                                    "remembered": False, "probe": None})
                return False
        return True

    def finish(self, run) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        counters = run.counters
        choices = [event["choice"] for event in self.events]
        metrics = {"arbitration": {"probe_rounds": self.probe_rounds, "reprobe_rounds": self.reprobe_rounds,
                                   "tail_check": self.tail_check, "table_tail_after": self.table_tail_after,
                                   "table_tail_margin": self.table_tail_margin,
                                   "events": self.events,
                                   "table": None if self.table is None else {
                                       "method": self.table_method, "margin": self.table.margin,
                                       "meta": self.table.meta},
                                   "choice": choices[-1] if choices else "speculative"},
                   "ar_steps": counters.plain_steps, "ar_tokens": counters.plain_tokens,
                   "draft_catch_ups": counters.catch_ups}
        return metrics, {}


__all__ = ["CHOICE_MARGIN", "ChoiceTable", "MeasuredChoiceController", "context_bucket", "finish_times",
           "measured_arbitration", "pooled_rates", "remaining_steps", "two_stretch_step", "two_stretches"]
