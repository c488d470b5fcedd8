"""The measured choice with a choice table (docs/methods.md §5.2): decisions from whole-run speed-ups measured
earlier, no probe where the table holds the key, a probe where it does not; the output stays AR's."""

import json

import jax
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.arbitration import ChoiceTable, MeasuredChoiceController
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SelfDraft, parse_skip_spec
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.models.llama import init_params

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(1).randint(0, 97, n).tolist() for n in (5, 17, 40)]  # mean 20.7: bucket 32
NEW = 20


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2)


@pytest.fixture(scope="module")
def ar_rows(params):
    return generate(params, TARGET, PROMPTS, NEW).rows()


def _entry(speedup, bucket=32, batch=3, method="self", **extra):
    return dict(method=method, context_bucket=bucket, batch=batch, speedup=speedup, **extra)


def _run(params, controller, warmup=False):
    policy = SelfDraft(TARGET)
    return speculative_generate(params, TARGET, PROMPTS, draft_policy=policy,
                                draft_state=policy.initial_state(parse_skip_spec("mlp:1", 3)),
                                engine=EngineConfig(gamma=3, max_new_tokens=NEW), controller=controller,
                                warmup=warmup)


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


def test_tail_check_runs_on_the_tables_step_price(params, ar_rows):
    """A speculative decision from the table with the tail check on: the plain step's price comes from the
    table (no probe measured one). Priced absurdly cheap, plain decoding finishes sooner at the first check."""
    table = ChoiceTable([_entry(1.4, ar_step_s=1e-9)])
    controller = MeasuredChoiceController(probe_rounds=2, remember=False, tail_check=1, table=table,
                                          table_method="self")
    result = _run(params, controller)
    assert result.rows() == ar_rows
    events = result.metrics["arbitration"]["events"]
    assert events[0]["reason"] == "table" and events[0]["choice"] == "speculative"
    assert events[1]["reason"] == "tail" and events[1]["after_rounds"] == 1
    assert result.metrics["ar_tokens"] > 0


def test_a_timed_run_with_a_table_compiles_nothing(params, ar_rows):
    """The warm-up run compiles both modes whatever the table decides, so the timed run (speculating, then
    switching to plain decoding at the tail check) builds no program."""
    compiles = []
    listener = lambda name, seconds, **_: compiles.append(name) if name.endswith("backend_compile_duration") else None
    table = ChoiceTable([_entry(1.4, ar_step_s=1e-9)])
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
    assert result.rows() == ar_rows and result.metrics["ar_tokens"] > 0
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
