"""Measured choice between speculative rounds and plain decoding (docs/methods.md §5.2): the faster mode wins on
the live sequence, the output stays AR's, decisions are remembered per (context bucket, batch); a choice table's
measured whole-run speed-ups decide without a probe where it holds the key."""

import json
import time

import jax
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding import speculative as engine_module
from jaxspec.decoding.arbitration import ChoiceTable, MeasuredChoiceController
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SelfDraft, parse_skip_spec
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.models.llama import init_params

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]
NEW = 24


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2)


def _run(params, controller, warmup=False):
    policy = SelfDraft(TARGET)
    return speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                draft_state=policy.initial_state(parse_skip_spec("mlp:1", 3)),
                                engine=EngineConfig(gamma=3, max_new_tokens=NEW), controller=controller,
                                warmup=warmup)


@pytest.mark.parametrize("slow", ["speculative", "ar"])
def test_measured_choice_keeps_the_faster_mode(params, monkeypatch, slow):
    """Slowing one mode on the host (a sleep after each call, per step or round it ran) makes the choice
    certain; the output is AR's either way; a timed run's decision is reused by the next run at the same
    (context, batch)."""
    side = {"speculative": "run_loop", "ar": "plain_decode"}[slow]
    real = getattr(engine_module, side)

    def slowed(*args, **kwargs):
        out = real(*args, **kwargs)
        jax.block_until_ready(out)
        units = int(args[2]) if side == "plain_decode" else (kwargs.get("max_rounds") or NEW)
        time.sleep(0.1 * units)
        return out

    monkeypatch.setattr(engine_module, side, slowed)
    ar_rows = generate(params, TARGET, PROMPTS, NEW).rows()
    # both modes compiled first: a probe that ran a compile would price that mode by it, whichever test ran
    # before this one in the worker
    _run(params, MeasuredChoiceController(probe_rounds=2))
    controller = MeasuredChoiceController(probe_rounds=2)
    result = _run(params, controller)
    assert result.rows() == ar_rows
    info = result.metrics["arbitration"]
    winner = "ar" if slow == "speculative" else "speculative"
    probe = info["events"][0]["probe"]
    assert info["choice"] == winner and probe["choice"] == winner
    assert probe["speculative_tokens"] > 0 and probe["ar_tokens"] > 0
    assert (probe["ar_tokens_per_s"] > probe["speculative_tokens_per_s"]) == (winner == "ar")
    assert (result.metrics["ar_tokens"] > probe["ar_tokens"]) == (winner == "ar")  # AR ran past its probe
    key = (info["events"][0]["context_bucket"], info["events"][0]["active_rows"])
    assert key == (32, 3) and controller.decisions == {key: winner}
    again = _run(params, controller)
    assert again.rows() == ar_rows and again.metrics["arbitration"]["events"][0]["remembered"]
    assert (again.metrics["ar_tokens"] > 0) == (winner == "ar")


def test_plain_probe_prices_a_step_without_the_per_call_cost(params, monkeypatch):
    """A fixed cost per plain-decoding call (a sleep after each call, whatever its length) inflates the
    probe's mean step time; the two stretches of different lengths cancel it, so the step the choice
    prices is the step a long plain stretch runs at (docs/methods.md §5.2)."""
    from jaxspec.decoding.arbitration import two_stretch_step

    assert two_stretch_step(0.3 + 2 * 0.01, 2, 0.3 + 6 * 0.01, 6) == pytest.approx(0.01)
    assert two_stretch_step(0.5, 2, 0.4, 6) is None and two_stretch_step(0.5, 3, 0.6, 3) is None
    # a step priced well above the tiny model's own (~1 ms) and a loaded machine's timing jitter, so the
    # difference of the two stretches (4 steps) cannot come out negative from noise
    real, fixed, step = engine_module.plain_decode, 0.25, 0.02

    def per_call(*args, **kwargs):
        out = real(*args, **kwargs)
        jax.block_until_ready(out)
        time.sleep(fixed + step * int(args[2]))  # args[2]: the stretch's step count
        return out

    monkeypatch.setattr(engine_module, "plain_decode", per_call)
    policy = SelfDraft(TARGET)
    result = speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                  draft_state=policy.initial_state(parse_skip_spec("mlp:1", 3)),
                                  engine=EngineConfig(gamma=3, max_new_tokens=96),
                                  controller=MeasuredChoiceController(probe_rounds=8, remember=False),
                                  warmup=True)  # the timed run: both stretch lengths already compiled
    probe = result.metrics["arbitration"]["events"][0]["probe"]
    assert probe["ar_steps"] == 8  # two stretches, 2 and 6 steps
    # the mean carries 2 x fixed / 8 steps; the two-stretch step carries none of it
    assert probe["ar_step_s_mean"] > step + 2 * fixed / 8
    assert probe["ar_step_s"] < probe["ar_step_s_mean"] - fixed / 8
    assert 0.75 * step < probe["ar_step_s"] < step + 0.02  # the sleep's step and the model's, give or take jitter
    assert probe["ar_tokens_per_s"] > probe["ar_tokens_per_s_mean"]


def test_warmup_decisions_not_remembered_and_errors(params):
    controller = MeasuredChoiceController(probe_rounds=2, reprobe_rounds=3)
    result = _run(params, controller, warmup=True)
    assert result.rows() == generate(params, TARGET, PROMPTS, NEW).rows()
    events = result.metrics["arbitration"]["events"]
    # the timed run probed afresh (the warm-up run's decision, with its compiles, was not kept) and re-probed
    assert not events[0]["remembered"] and len(events) >= 2
    for bad in (dict(probe_rounds=0), dict(reprobe_rounds=0), dict(probe_rounds=True)):
        with pytest.raises(ValueError, match="must be"):
            MeasuredChoiceController(**bad)


def test_probe_warmup_takes_a_first_call_cost_off_the_probe(params, monkeypatch):
    """A one-time cost of the first speculative call (slept on the host here: 2 s) makes the probe pick plain
    decoding; with ``probe_warmup=1`` one untimed round takes it and the probe picks speculation. Plain stretches
    sleep 0.1 s a step so that speculation is certainly faster once warm. Output is AR's either way."""
    _run(params, MeasuredChoiceController(probe_rounds=2, remember=False))  # compiles, unslowed
    real_loop, real_plain = engine_module.run_loop, engine_module.plain_decode
    calls = {"loop": 0}

    def first_slow(*args, **kwargs):
        out = jax.block_until_ready(real_loop(*args, **kwargs))
        calls["loop"] += 1
        time.sleep(2.0 if calls["loop"] == 1 else 0.0)
        return out

    def plain_slow(*args, **kwargs):
        out = jax.block_until_ready(real_plain(*args, **kwargs))
        time.sleep(0.1 * int(args[2]))
        return out

    monkeypatch.setattr(engine_module, "run_loop", first_slow)
    monkeypatch.setattr(engine_module, "plain_decode", plain_slow)
    ar_rows = generate(params, TARGET, PROMPTS, NEW).rows()
    cold = _run(params, MeasuredChoiceController(probe_rounds=2, remember=False))
    probe = cold.metrics["arbitration"]["events"][0]["probe"]
    assert probe["choice"] == "ar" and "speculative_warmup_s" not in probe and cold.rows() == ar_rows
    calls["loop"] = 0
    warm = _run(params, MeasuredChoiceController(probe_rounds=2, remember=False, probe_warmup=1))
    probe = warm.metrics["arbitration"]["events"][0]["probe"]
    assert probe["choice"] == "speculative" and probe["speculative_warmup_s"] >= 2.0 > probe["speculative_s"]
    assert probe["speculative_warmup_units"] == 1 and probe["ar_warmup_units"] == 1
    assert warm.rows() == ar_rows
    with pytest.raises(ValueError, match="probe_warmup=-1"):
        MeasuredChoiceController(probe_warmup=-1)


def test_finish_times_wait_for_the_slowest_row():
    from jaxspec.decoding.arbitration import finish_times

    # brute force: run rounds until every row has its tokens, each row committing its own rate per round
    left, rate = np.array([10, 40, 7]), np.array([3.0, 1.5, 4.0])
    rounds, done = 0, np.zeros(3)
    while (done < left).any():
        done += rate
        rounds += 1
    spec, plain = finish_times(0.02, 0.006, left, rate)
    assert spec == pytest.approx(0.02 * rounds) and plain == pytest.approx(0.006 * 40)
    assert rounds == 27  # the 1.5-tokens-per-round row decides, not the mean rate
    assert finish_times(0.02, 0.006, [], []) == (0.0, 0.0)


@pytest.mark.parametrize("tail_prefers_plain", [True, False])
def test_tail_check_switches_to_plain_decoding_only_when_it_finishes_sooner(params, monkeypatch, tail_prefers_plain):
    """The tail rule switches the rest of the run to plain decoding exactly when its estimate says plain
    finishes the batch sooner; the output stays AR's either way."""
    from jaxspec.decoding import arbitration

    calls = []

    def estimate(round_s, step_s, left, per_round):
        calls.append((round_s, step_s, np.asarray(left).tolist(), np.asarray(per_round).tolist()))
        return (1.0, 0.5) if tail_prefers_plain else (0.5, 1.0)

    real_arbitration = arbitration.measured_arbitration

    def speculative_wins(*args, **kwargs):  # the probe picks speculation, whatever the host timings
        probe, units = yield from real_arbitration(*args, **kwargs)
        if probe is not None:
            probe["choice"] = "speculative"
        return probe, units

    monkeypatch.setattr(arbitration, "finish_times", estimate)
    monkeypatch.setattr(arbitration, "measured_arbitration", speculative_wins)
    controller = MeasuredChoiceController(probe_rounds=2, tail_check=1, remember=False)
    result = _run(params, controller)
    assert result.rows() == generate(params, TARGET, PROMPTS, NEW).rows()
    info = result.metrics["arbitration"]
    probe = info["events"][0]["probe"]
    assert probe["ar_step_s"] == pytest.approx(probe["ar_s"] / probe["ar_steps"]) and probe["ar_steps"] == 2
    assert calls and all(step == probe["ar_step_s"] and len(left) == len(rate) for _, step, left, rate in calls)
    tail = [e for e in info["events"] if e.get("reason") == "tail"]
    if tail_prefers_plain:
        assert len(calls) == 1 and len(tail) == 1 and info["choice"] == "ar"
        assert "tail_prior_rounds" in tail[0] and tail[0]["tail_prior_rounds"] is None  # the rule it used: pooled
        assert result.metrics["ar_tokens"] > probe["ar_tokens"]  # the rest ran in plain decoding
    else:
        assert len(calls) >= 2 and not tail and info["choice"] == "speculative"
        assert result.metrics["ar_tokens"] == probe["ar_tokens"]  # only the probe's plain steps
    with pytest.raises(ValueError, match="tail_check"):
        MeasuredChoiceController(tail_check=0)


def test_a_timed_run_that_speculates_after_its_probe_compiles_nothing(params, monkeypatch):
    """The warm-up run's probe (timed with its compiles) may pick plain decoding while the timed run's
    picks speculation: the timed run then speculates after the probe's plain steps, which needs the
    round loop on a state that came from plain decoding and a separate draft's catch-up on the plain
    tokens. The warm-up compiles both, so the timed run compiles no program (docs/methods.md §5.2)."""
    from jaxspec.decoding import arbitration
    from jaxspec.decoding.policies import SeparateDraft

    draft_config = TARGET.replace(num_layers=2)
    draft_params = init_params(draft_config, jax.random.PRNGKey(3), scale=0.2)
    placed = jax.device_put((params, draft_params), jax.devices()[0])  # as a loaded model's weights
    compiles, marks = [], {}
    listener = lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None
    real = arbitration.measured_arbitration

    def warmup_ar_timed_speculative(run, *args, **kwargs):
        if not run.warmup:
            marks.setdefault("timed", len(compiles))
        probe, units = yield from real(run, *args, **kwargs)
        if probe is not None:
            probe["choice"] = "ar" if run.warmup else "speculative"
        return probe, units

    monkeypatch.setattr(arbitration, "measured_arbitration", warmup_ar_timed_speculative)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = speculative_generate(placed[0], TARGET, PROMPTS, draft_policy=SeparateDraft(draft_config,
                                                                                               name="arbitrated"),
                                      draft_params=placed[1], engine=EngineConfig(gamma=3, max_new_tokens=NEW),
                                      controller=MeasuredChoiceController(probe_rounds=2, remember=False),
                                      warmup=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert result.metrics["arbitration"]["choice"] == "speculative" and result.metrics["draft_catch_ups"] == 1
    assert result.rows() == generate(params, TARGET, PROMPTS, NEW).rows()
    assert "timed" in marks and compiles[marks["timed"]:] == []


def test_pooled_rates_shrink_toward_the_batch_mean():
    from jaxspec.decoding.arbitration import pooled_rates

    tokens = np.array([8.0, 24.0, 40.0])  # after 8 rounds: 1, 3, 5 tokens a round, mean 3
    np.testing.assert_allclose(pooled_rates(tokens, 8, 0), [1.0, 3.0, 5.0])  # prior 0: the rows' own rates
    np.testing.assert_allclose(pooled_rates(tokens, 8), [2.0, 3.0, 4.0])  # default: half the weight on the mean
    np.testing.assert_allclose(pooled_rates(tokens, 8, 24), [2.5, 3.0, 3.5])
    np.testing.assert_allclose(pooled_rates(np.full(4, 16.0), 8), 2.0)  # equal rows stay where they are
    assert pooled_rates([], 8).size == 0
    with pytest.raises(ValueError, match="prior_rounds=-1"):
        pooled_rates(tokens, 8, -1)
    with pytest.raises(ValueError, match="tail_prior_rounds=-1"):
        MeasuredChoiceController(tail_check=8, tail_prior_rounds=-1)


@pytest.mark.parametrize("spread", [0.0, 0.5])
def test_pooled_rates_predict_the_slowest_row_far_better_than_its_own_rate(spread):
    """Batches of 16 rows, 256 tokens each, committing 1-5 tokens a round drawn from the accepted-count histogram
    full-KV Dustin-H measured on the real pair at 32k/b16 (with ``spread``, each row's distribution is mixed
    with up to that share of 1-token rounds: rows of different acceptance). After 8 and 16 rounds the tail
    check predicts the rounds until the slowest row is done: from each row's own rate it overshoots by tens of
    rounds (the slowest of 16 noisy rates is far below that row's true rate); pooled toward the batch mean
    (the default) its error is a fraction of that."""
    from jaxspec.decoding.arbitration import pooled_rates

    rng = np.random.default_rng(0)
    base = np.array([71, 35, 27, 21, 102], float)
    base /= base.sum()
    for observed in (8, 16):
        errors = {"own": [], "pooled": []}
        for _ in range(200):
            mix = rng.uniform(0, spread, size=16)[:, None]
            probs = (1 - mix) * base + mix * np.eye(5)[0]
            counts = np.stack([rng.choice(5, size=256, p=p) + 1 for p in probs])
            cum = np.cumsum(counts, axis=1)
            true = int(((cum < 256).sum(axis=1) + 1).max()) - observed  # rounds still needed by the slowest row
            got = cum[:, observed - 1].astype(float)
            left = 256 - got
            for name, prior in (("own", 0), ("pooled", None)):
                predicted = np.max(np.ceil(left / pooled_rates(got, observed, prior)))
                errors[name].append(predicted - true)
        own, pooled = (np.abs(np.array(errors[k])).mean() for k in ("own", "pooled"))
        assert np.mean(errors["own"]) > 10  # the rows' own rates: far too pessimistic
        assert pooled < own / 2 and abs(np.mean(errors["pooled"])) < 12


# ---------------------------------------------------------------------------- the choice table
@pytest.fixture(scope="module")
def ar_rows(params):
    return generate(params, TARGET, PROMPTS, NEW).rows()


def _entry(speedup, bucket=32, batch=3, method="self", **extra):
    return dict(method=method, context_bucket=bucket, batch=batch, speedup=speedup, **extra)


@pytest.mark.parametrize("speedup, choice", [(1.4, "speculative"), (1.01, "ar"), (0.7, "ar")])
def test_a_table_entry_decides_without_a_probe(params, ar_rows, speedup, choice):
    """1.01x is under the default 2 % margin: plain decoding. Where the table decides, nothing is probed: a
    plain choice runs no speculative round, a speculative one no plain step."""
    table = ChoiceTable([_entry(speedup, ar_step_s=0.004)])
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, table=table, table_method="self")
    result = _run(params, controller)
    assert result.rows() == ar_rows
    info = result.metrics["arbitration"]
    (event,) = info["events"]
    assert event["reason"] == "table" and event["probe"] is None and event["choice"] == choice == info["choice"]
    assert event["table_speedup"] == speedup and info["table"]["method"] == "self"
    after_prefill = int(np.sum(result.num_generated)) - len(PROMPTS)  # each row's first token is the prefill's
    assert result.metrics["ar_tokens"] == (after_prefill if choice == "ar" else 0)


def test_a_key_the_table_lacks_is_probed(params, ar_rows):
    """Another batch size, another context bucket, another method: the controller probes as without a table."""
    table = ChoiceTable([_entry(1.4, batch=4), _entry(1.4, bucket=64), _entry(1.4, method="other")])
    result = _run(params, MeasuredChoiceController(probe_rounds=2, remember=False, table=table, table_method="self"))
    assert result.rows() == ar_rows
    event = result.metrics["arbitration"]["events"][0]
    assert event.get("reason") != "table" and event["probe"] is not None and event["probe"]["ar_tokens"] > 0


def test_a_table_decision_is_not_tail_checked(params, ar_rows, monkeypatch):
    """A speculative decision from the table stands for the run with the tail check on, even where the tail
    estimate would say plain decoding finishes sooner (the table measured whole runs, their opening rounds
    included): the estimate is never consulted. The probed path under the same estimate switches
    (test_tail_check_switches_to_plain_decoding_only_when_it_finishes_sooner)."""
    from jaxspec.decoding import arbitration

    calls = []
    monkeypatch.setattr(arbitration, "finish_times", lambda *a: calls.append(a) or (1.0, 0.5))
    table = ChoiceTable([_entry(1.4, ar_step_s=1e-9)])
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1, table=table,
                                          table_method="self")
    result = _run(params, controller)
    assert result.rows() == ar_rows
    events = result.metrics["arbitration"]["events"]
    assert [e["reason"] for e in events] == ["table"] and events[0]["choice"] == "speculative"
    assert calls == [] and result.metrics["ar_tokens"] == 0


@pytest.mark.parametrize("after", [2, 1000])
def test_table_tail_after_checks_a_table_decision_from_that_round_on(params, ar_rows, monkeypatch, after):
    """With ``table_tail_after=N`` the table's speculative decision runs N rounds unchecked, then the tail check
    judges it with the entry's plain step price and switches to plain decoding where that finishes sooner (a
    straggler row); a run shorter than N rounds is never checked. The output stays AR's either way."""
    from jaxspec.decoding import arbitration

    calls = []

    def estimate(round_s, step_s, left, per_round):
        calls.append(step_s)
        return 1.0, 0.5  # plain decoding finishes sooner

    monkeypatch.setattr(arbitration, "finish_times", estimate)
    table = ChoiceTable([_entry(1.4, ar_step_s=0.0042)])
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1, table=table,
                                          table_method="self", table_tail_after=after)
    seen = []
    real = controller._speculative

    def speculative(run, rounds):
        seen.append(rounds)
        return (yield from real(run, rounds))

    controller._speculative = speculative
    result = _run(params, controller)
    assert result.rows() == ar_rows
    info = result.metrics["arbitration"]
    events = info["events"]
    assert events[0]["reason"] == "table" and events[0]["choice"] == "speculative" and info["table_tail_after"] == after
    if after == 2:
        assert seen == [2] and calls == [0.0042]  # the unchecked opening as one chunk, then one check
        assert events[1]["reason"] == "tail" and events[1]["unchecked_rounds"] == 2 and events[1]["after_rounds"] == 2
        assert info["choice"] == "ar" and result.metrics["ar_tokens"] > 0
    else:
        assert calls == [] and len(events) == 1 and result.metrics["ar_tokens"] == 0


def test_simulated_tail_switch_on_the_measured_pair_runs():
    """The guard's default on the committed real-pair runs (rounds per row, round and step prices): the
    MagicDec 32k/b8 run whose one row took 180 rounds is switched at the first check (round 32), and no run of
    at least 1.2x AR is switched before round 56 (a late switch keeps the gain of the rounds already run)."""
    import glob
    import pathlib

    from jaxspec.decoding.arbitration import simulated_tail_switch

    root = pathlib.Path(__file__).resolve().parents[2] / "experiments" / "results" / "pair_speed"
    runs = []
    for path in sorted(glob.glob(str(root / "*_h200.json"))):
        data = json.loads(pathlib.Path(path).read_text())
        for case in data["cases"].values():
            if not isinstance(case, dict) or "ar" not in case:
                continue
            for name, record in case.items():
                metrics = record.get("metrics") if isinstance(record, dict) else None
                if not metrics or not any(metrics.get("rounds_per_row") or [0]) or metrics.get("ar_steps"):
                    continue
                rows = metrics["rounds_per_row"]
                switch = simulated_tail_switch(rows, record["timings"]["decode_s"] / max(rows),
                                               len(rows) / record["paired_ar_tok_s"], 255, after=32, every=8,
                                               margin=0.1)
                runs.append((name, case["batch"], max(rows), record["speedup_vs_ar"], switch))
    assert len(runs) > 40
    straggler = [r for r in runs if r[0] == "magicdec" and r[1] == 8 and r[2] == 180 and r[3] < 0.6]
    assert straggler and all(r[4] == 32 for r in straggler)
    assert all(r[4] is None or r[4] >= 56 for r in runs if r[3] >= 1.2)


def test_table_tail_after_refuses_bad_values():
    table = ChoiceTable([_entry(1.4)])
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="table_tail_after"):
            MeasuredChoiceController(tail_check=4, table=table, table_method="self", table_tail_after=bad)
    for bad in (-0.1, 1.0, True, "0.1"):
        with pytest.raises(ValueError, match="table_tail_margin"):
            MeasuredChoiceController(tail_check=4, table=table, table_method="self", table_tail_after=8,
                                     table_tail_margin=bad)
    with pytest.raises(ValueError, match="needs tail_check"):
        MeasuredChoiceController(table=table, table_method="self", table_tail_after=8)
    with pytest.raises(ValueError, match="needs tail_check"):
        MeasuredChoiceController(tail_check=4, table_tail_after=8)


@pytest.mark.parametrize("plain_s, switches", [(0.95, False), (0.85, True)])
def test_a_table_decision_switches_only_past_its_margin(params, ar_rows, monkeypatch, plain_s, switches):
    """A table's decision is overruled only where plain decoding finishes at least table_tail_margin (10 %)
    sooner: a near-tie (5 % sooner) keeps speculating, 15 % sooner switches. A probed decision under the same
    estimate switches at any gain (test_tail_check_switches_to_plain_decoding_only_when_it_finishes_sooner)."""
    from jaxspec.decoding import arbitration

    monkeypatch.setattr(arbitration, "finish_times", lambda *a: (1.0, plain_s))
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1, table_method="self",
                                          table=ChoiceTable([_entry(1.4, ar_step_s=0.004)]), table_tail_after=2)
    result = _run(params, controller)
    assert result.rows() == ar_rows
    tail = [e for e in result.metrics["arbitration"]["events"] if e.get("reason") == "tail"]
    assert bool(tail) == switches and (result.metrics["ar_tokens"] > 0) == switches
    if switches:
        assert tail[0]["margin"] == 0.1


def test_a_table_entry_without_a_step_price_is_not_tail_checked(params, ar_rows, monkeypatch):
    """The check needs a plain step's price; a table entry without ``ar_step_s`` keeps its decision."""
    from jaxspec.decoding import arbitration

    calls = []
    monkeypatch.setattr(arbitration, "finish_times", lambda *a: calls.append(a) or (1.0, 0.5))
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1,
                                          table=ChoiceTable([_entry(1.4)]), table_method="self", table_tail_after=1)
    result = _run(params, controller)
    assert result.rows() == ar_rows and calls == [] and result.metrics["ar_tokens"] == 0


@pytest.mark.parametrize("speedup", [1.4, 0.7])
def test_a_timed_run_with_a_table_compiles_nothing(params, ar_rows, speedup):
    """The warm-up run compiles both modes whatever the table decides, so the timed run, speculating (1.4x)
    or decoding plainly (0.7x) as the table says, builds no program."""
    compiles = []
    listener = lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None
    table = ChoiceTable([_entry(speedup, ar_step_s=1e-9)])
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1, table=table,
                                          table_method="self")
    placed = jax.device_put(params, jax.devices()[0])
    policy = SelfDraft(TARGET)
    marks = {}
    real_chunks = controller.chunks

    def chunks(run):
        if not run.warmup:
            marks.setdefault("timed", len(compiles))
        return (yield from real_chunks(run))

    controller.chunks = chunks
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        result = speculative_generate(placed, TARGET, PROMPTS, draft_policy=policy,
                                      draft_state=policy.initial_state(parse_skip_spec("mlp:1", 3)),
                                      engine=EngineConfig(gamma=3, max_new_tokens=NEW), controller=controller,
                                      warmup=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert result.rows() == ar_rows and (result.metrics["ar_tokens"] > 0) == (speedup < 1)
    assert "timed" in marks and compiles[marks["timed"]:] == []


def test_table_checks_save_and_load(tmp_path):
    table = ChoiceTable([_entry(1.4), _entry(0.9, batch=16, ar_step_s=0.005)], margin=0.05,
                        meta={"target": "a", "draft": "b"})
    assert [r["choice"] for r in table.rows()] == ["speculative", "ar"]
    assert ChoiceTable([_entry(1.04)], margin=0.05).decide(_entry(1.04)) == "ar"
    assert ChoiceTable([_entry(1.04)], margin=0.0).decide(_entry(1.04)) == "speculative"
    path = table.save(tmp_path / "t" / "choice.json")
    again = ChoiceTable.load(path)
    assert again.rows() == table.rows() and again.margin == 0.05 and again.meta == {"target": "a", "draft": "b"}
    assert ChoiceTable.load(path, margin=0.5).decide(_entry(1.4)) == "ar"
    bad = [([_entry(1.4, bucket=30)], "power of two"), ([_entry(1.4, batch=0)], "batch=0"),
           ([_entry(float("nan"))], "finite"), ([_entry(1.4), _entry(1.2)], "appears twice"),
           ([{"method": "x", "batch": 1}], "missing context_bucket, speedup"),
           ([_entry(1.4, ar_step_s=-1.0)], "ar_step_s")]
    for entries, message in bad:
        with pytest.raises(ValueError, match=message):
            ChoiceTable(entries)
    with pytest.raises(ValueError, match="margin"):
        ChoiceTable([], margin=1.5)
    with pytest.raises(ValueError, match="table_method"):
        MeasuredChoiceController(table=table)
    with pytest.raises(FileNotFoundError, match="no such file"):
        ChoiceTable.load(tmp_path / "missing.json")
    (tmp_path / "other.json").write_text(json.dumps({"entries": []}))
    with pytest.raises(ValueError, match="not a jaxspec choice table"):
        ChoiceTable.load(tmp_path / "other.json")
