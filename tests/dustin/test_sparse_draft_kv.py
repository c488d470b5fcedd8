"""Dustin with a sparse draft KV (docs/methods.md §5.1): the draft reads sinks + window or the previous round's
I_verify + window of its cache, K/V writes and s_D still over the full cache (tiny random models)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.baselines import MagicDecDraft
from jaxspec.baselines.streaming import streaming_indices
from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SeparateDraft, parse_skip_spec
from jaxspec.decoding.sampling import SamplingConfig
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.dustin import DustinConfig, dustin_policies
from jaxspec.dustin.policy import draft_history_indices
from jaxspec.models.llama import init_params

TARGET = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
DRAFT = TARGET.replace(hidden_size=32, intermediate_size=64, head_dim=8)
PROMPTS = [np.random.RandomState(7).randint(0, 128, n).tolist() for n in (220, 150, 40)]
ENGINE = EngineConfig(gamma=3, max_new_tokens=16)


@pytest.fixture(scope="module")
def models():
    return init_params(TARGET, jax.random.PRNGKey(0), scale=0.2), init_params(DRAFT, jax.random.PRNGKey(5), scale=0.2)


@pytest.fixture(scope="module")
def reference(models):
    target_params, draft_params = models
    classic = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=SeparateDraft(DRAFT),
                                   draft_params=draft_params, engine=ENGINE)
    assert classic.rows() == generate(target_params, TARGET, PROMPTS, 16).rows()
    return classic


def _config(budget, draft_kv="full", **changes):
    return DustinConfig(budget=budget, m=changes.pop("m", 30), target_layer=1, target_heads=(0, 1, 2, 3),
                        draft_layers=(0, 1), draft_heads=((0, 1, 2, 3), (1, 3)), draft_kv=draft_kv, **changes)


def _run(models, config, skip=None, **kwargs):
    target_params, draft_params = models
    draft, verify = dustin_policies(config, TARGET, None if skip is not None else DRAFT)
    state = dict(draft_state=draft.initial_state(parse_skip_spec(skip, 2))) if skip is not None else \
        dict(draft_params=draft_params)
    return speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, verify_policy=verify,
                                engine=kwargs.pop("engine", ENGINE), **state, **kwargs)


def test_config_fields_and_errors():
    assert _config(512, "streaming").draft_window_size == 508 and _config(512, "verify-set").draft_window_size == 64
    assert _config(512, "verify-set", draft_window=16).draft_window_size == 16 and _config(512).draft_window_size == 0
    assert DustinConfig.from_dict(_config(256, "streaming").to_dict()) == _config(256, "streaming")
    assert "draft_kv" not in _config(256).to_dict()  # full KV: the dict of the paper's config, unchanged
    with pytest.raises(ValueError, match="draft_kv='half'"):
        _config(256, "half")
    with pytest.raises(ValueError, match="draft_window=0"):
        _config(256, "streaming", draft_window=0)
    with pytest.raises(ValueError, match="valid: full, streaming, verify-set"):
        draft_history_indices("half", jnp.array([5]), sinks=1, window=2)
    with pytest.raises(TypeError, match="needs the verify policy's I_verify"):
        draft_history_indices("verify-set", jnp.array([5]), sinks=1, window=2)


def test_history_indices_sets():
    lengths = jnp.array([3, 10, 40, 0])
    streaming = np.asarray(draft_history_indices("streaming", lengths, sinks=4, window=8))
    reference = np.asarray(streaming_indices(lengths, sinks=4, window=8))
    for row, n in enumerate(np.asarray(lengths)):
        got = streaming[row][streaming[row] >= 0]
        assert len(set(got)) == len(got) and set(got) == set(reference[row][reference[row] >= 0])
        assert (got < n).all()
    previous = jnp.array([[0, 5, 7, 9, -1], [1, 2, 30, 35, 38], [0, 1, 2, 3, 4], [-1, -1, -1, -1, -1]])
    union = np.asarray(draft_history_indices("verify-set", lengths, sinks=4, window=8, feedback=previous))
    expected = [{0, 1, 2}, {1, 2} | set(range(2, 10)), {0, 1, 2, 3, 4} | set(range(32, 40)), set()]
    for row in range(4):
        got = union[row][union[row] >= 0]
        assert len(set(got)) == len(got) and set(got) == expected[row]


@pytest.mark.parametrize("draft_kv,skip", [("verify-set", None), ("streaming", "mlp:1")])
def test_budget_beyond_context_equals_classic(models, reference, draft_kv, skip):
    """k >= context: I_verify and the draft's view are the whole history: the output is ClassicSD's (and AR's);
    a separate draft then drafts exactly as with its full cache (the same acceptance)."""
    result = _run(models, _config(512, draft_kv), skip)
    assert result.rows() == reference.rows()
    if skip is None:
        assert result.metrics["accepted_histogram"] == reference.metrics["accepted_histogram"]


def test_streaming_draft_drafts_as_magicdec(models):
    """A streaming draft KV reads the StreamingLLM set: with the verification dense (k >= context) its
    drafts, and so its acceptance, are MagicDec's with the same sinks and window."""
    target_params, draft_params = models
    result = _run(models, _config(512, "streaming", draft_window=24))
    magicdec = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=MagicDecDraft(DRAFT, sinks=4,
                                                                                               window=24),
                                    draft_params=draft_params, engine=ENGINE)
    assert result.rows() == magicdec.rows()
    assert result.metrics["accepted_histogram"] == magicdec.metrics["accepted_histogram"]


def test_verify_set_sparse_run(models, reference):
    """k = 128 < context: the verify state keeps each round's I_verify for the next draft; the rows stay
    within the prompt + generated tokens; a 40-token prompt is dense (equals ClassicSD)."""
    result = _run(models, _config(128, "verify-set", draft_window=16))
    rows = result.rows()
    assert [len(r) for r in rows] == [16, 16, 16] and rows[2] == reference.rows()[2]
    indices = np.asarray(result.final_state.verify_state["indices"])
    committed = np.asarray(result.final_state.committed)
    assert indices.shape == (3, 128)
    for row in range(3):
        kept = indices[row][indices[row] >= 0]
        assert len(set(kept)) == len(kept) and (kept < committed[row]).all() and {0, 1, 2, 3} <= set(kept)
    # a sampled self-draft reading the target cache through the same sets
    sampled = _run(models, _config(128, "verify-set"), "mlp:1", engine=EngineConfig(
        gamma=3, max_new_tokens=8, sampling=SamplingConfig(temperature=0.8)))
    assert [len(r) for r in sampled.rows()] == [8, 8, 8]


def test_streaming_self_draft_drafts_as_magicdec_self_draft(models):
    """The StreamingLLM self-draft with Dustin verification (docs/methods.md §5.5): DustinSelfDraft with
    draft_kv="streaming" reads the sinks + window of the target cache, so with the verification dense
    (k >= context) its drafts and acceptance are MagicDecSelfDraft's with the same sinks, window and skip
    mask, while it still returns the lookahead signal (the run with the draft signal in use completes)."""
    from jaxspec.baselines import MagicDecSelfDraft

    target_params, _ = models
    result = _run(models, _config(512, "streaming", draft_window=24), "mlp:1")
    policy = MagicDecSelfDraft(TARGET, sinks=4, window=24)
    magicdec = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=policy,
                                   draft_state=policy.initial_state(parse_skip_spec("mlp:1", 2)), engine=ENGINE)
    assert result.rows() == magicdec.rows()
    assert result.metrics["accepted_histogram"] == magicdec.metrics["accepted_histogram"]


def test_whole_target_streaming_self_draft_needs_no_mask(models, reference):
    """The whole target as its own draft over sinks + window (no sub-layer skipped): DustinSelfDraft
    builds its own state, ``{}`` (no mask traced), and at k >= context drafts and accepts exactly as
    MagicDec's self-draft, whose dense verification is greedy AR; a full-KV self-draft still needs a mask."""
    from jaxspec.baselines import MagicDecSelfDraft

    target_params, _ = models
    config = _config(512, "streaming", draft_window=24).replace(draft_layers=(1,), draft_heads=((0, 1, 2, 3),))
    draft, verify = dustin_policies(config, TARGET, None)
    assert draft.initial_state() == {} and draft.prefill(target_params, None, None, 0) == {}
    result = speculative_generate(target_params, TARGET, PROMPTS, draft_policy=draft, verify_policy=verify,
                                  engine=ENGINE)
    magicdec = speculative_generate(target_params, TARGET, PROMPTS,
                                    draft_policy=MagicDecSelfDraft(TARGET, sinks=4, window=24), engine=ENGINE)
    assert result.rows() == magicdec.rows() == reference.rows()
    assert result.metrics["accepted_histogram"] == magicdec.metrics["accepted_histogram"]
    full, _ = dustin_policies(config.replace(draft_kv="full"), TARGET, None)
    with pytest.raises(TypeError, match="initial_state"):
        full.prefill(target_params, None, None, 0)
