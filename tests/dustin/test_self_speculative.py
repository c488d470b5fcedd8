"""Self-speculative sparse verification under KnapSpec re-planning (docs/methods.md §5.5): the DP keeps the
draft SRH layers' Attention executed (exact against exhaustive search), every plan does, and with k >= the
context Dustin verification is dense, so greedy output is AR's token for token (tiny random model, float32)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.dustin import BudgetError, DustinConfig
from jaxspec.dustin.self_speculative import knapspec_dustin_config, knapspec_dustin_generate
from jaxspec.knapspec import dp, latency
from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate
from jaxspec.models.llama import init_params
from tests.conftest import check_scan_dp_against_brute_force, decomposable_dp_instance

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=6, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(3).randint(0, 97, n).tolist() for n in (9, 30, 60)]
SRH = (2, 3)
# gamma* >= 1 (the grid has no plain decoding), so every plan drafts and Dustin verifies every round
KNAP = KnapSpecConfig(gamma_max=4, plan_interval=3, plan_round=2, reference_rounds=2, max_plan_fraction=None,
                      probe_rounds=None, gammas=(1, 2, 3, 4))
LATENCY = latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5)  # attention ~ MLP: both worth skipping


def _dustin(budget=512, **changes):
    return DustinConfig(budget=budget, **{"m": 30, "target_layer": 4, "target_heads": (0, 1, 2, 3),
                                          "draft_layers": SRH, "draft_heads": ((0, 1), (2, 3)), **changes})


@pytest.fixture(scope="module")
def params():
    return init_params(TARGET, jax.random.PRNGKey(1), scale=0.2)


# ---------------------------------------------------------------------------- the constrained DP
@pytest.mark.parametrize("w_attn,w_mlp,keep", [(1, 1, (2,)), (2, 1, (2, 3)), (1, 3, (1, 4))])
def test_constrained_dp_equals_brute_force(w_attn, w_mlp, keep):
    """With keep_attention the scan DP's value and mask for every skipped weight equal the exhaustive
    optimum over the skip sets that execute those Attention sub-layers; no candidate skips them."""
    num_layers = 6
    instance = decomposable_dp_instance(num_layers, seed=w_attn + 3 * w_mlp)
    can_skip = dp.scan_can_skip(num_layers, keep)
    assert can_skip.shape == (num_layers - 1, 2) and not can_skip[-1].any()
    assert [k + 1 for k in range(num_layers - 1) if not can_skip[k, 0]] == sorted(set(keep) | {num_layers - 1})
    run = check_scan_dp_against_brute_force(*instance, can_skip, num_layers=num_layers, w_attn=w_attn, w_mlp=w_mlp,
                                            tau=0.6)
    assert len(run.slots) > 2
    for mask in run.masks:
        assert not mask[list(keep), 0].any()
    # the constraint bites: unconstrained, some optimum skips a kept Attention
    free = run.brute(dp.scan_can_skip(num_layers), 0.6)
    assert any((layer + 1 in keep and col == 0) for _, skips in free.values() for layer, col in skips)
    # the Python-loop DP takes the same per-sub-layer can_skip
    loop_trace, _ = dp.dp_loop(run.single, run.layers, instance[0], run.targets, can_skip, run.token_mask,
                               w_attn=w_attn, w_mlp=w_mlp, budget=run.budget, tau=0.6)
    np.testing.assert_array_equal(loop_trace.valid, run.trace.valid)
    np.testing.assert_array_equal(loop_trace.skipped, run.trace.skipped)


def test_constrained_model_dp_matches_loop_and_keeps_layers(params):
    """On the model: knapsack_dp with keep_attention equals its Python-loop reference and never skips the kept
    Attention sub-layers; a kept layer outside the model is refused."""
    from jaxspec.models.cache import init_cache
    from jaxspec.models.llama import forward_jit

    rng = np.random.RandomState(0)
    seq = rng.randint(0, 97, (1, 28))
    cache = forward_jit(params, jnp.asarray(seq), init_cache(TARGET, 1, 64), config=TARGET).cache
    prefix = jnp.asarray([20], jnp.int32)
    tokens = jnp.asarray(seq[:, 20:28])
    states = dp.boundary_states(params, TARGET, tokens, cache, prefix)
    fast = dp.knapsack_dp(params, TARGET, cache, prefix, states, w_attn=1, w_mlp=1, keep_attention=SRH)
    ref = dp.knapsack_dp_reference(params, TARGET, cache, prefix, states, w_attn=1, w_mlp=1, keep_attention=SRH)
    np.testing.assert_array_equal(fast.masks, ref.masks)
    assert len(fast) > 2 and not fast.masks[:, list(SRH), 0].any()
    free = dp.knapsack_dp(params, TARGET, cache, prefix, states, w_attn=1, w_mlp=1)
    assert free.masks[:, list(SRH), 0].any()  # without the constraint the DP does skip them
    with pytest.raises(ValueError, match=r"keep_attention layers \[6\] out of range: the model has layers 0..5"):
        dp.knapsack_dp(params, TARGET, cache, prefix, states, w_attn=1, w_mlp=1, keep_attention=(6,))


# ---------------------------------------------------------------------------- end to end
def test_knapspec_dustin_full_budget_equals_ar_and_keeps_srh(params):
    """k = 512 >= every context: I_verify is the whole history, so greedy output equals AR for every row, across
    several re-plans whose masks differ; no plan skips the Attention of an SRH layer; the draft signal is used."""
    expected = generate(params, TARGET, PROMPTS, 20).rows()
    dustin = _dustin()
    assert dustin.uses_draft_signal
    result = knapspec_dustin_generate(params, TARGET, PROMPTS, dustin=dustin, latency=LATENCY, knapspec=KNAP,
                                      max_new_tokens=20)
    assert result.rows() == expected
    plans = result.metrics["knapspec_plans"]
    masks = {(tuple(p["skip_attn"]), tuple(p["skip_mlp"])) for p in plans}
    assert len(plans) >= 3 and len(masks) >= 2, [(p["skip_attn"], p["skip_mlp"], p["gamma"]) for p in plans]  # the mask really changes
    assert all(not set(p["skip_attn"]) & set(SRH) for p in plans)
    assert any(p["skip_attn"] for p in plans)  # attention of other layers is skipped
    assert result.metrics["keep_attention"] == list(SRH)
    assert not np.asarray(result.metrics["final_skip_mask"])[list(SRH), 0].any()
    assert result.metrics["draft_steps"] > 0
    # the unconstrained planner on the same run skips an SRH layer's attention at some plan
    free = knapspec_generate(params, TARGET, PROMPTS, latency=LATENCY, knapspec=dataclasses.replace(KNAP, early_exit=None),
                             max_new_tokens=20)
    assert free.rows() == expected
    assert any(set(p["skip_attn"]) & set(SRH) for p in free.metrics["knapspec_plans"])


def test_knapspec_dustin_sparse_budget_runs(params):
    """k = 128 < the longest context (60 + 20 tokens fit, so use a longer prompt): a sparse run completes with the
    SRH layers kept; the short row (dense) equals AR."""
    prompts = [np.random.RandomState(5).randint(0, 97, 200).tolist(), PROMPTS[0]]
    result = knapspec_dustin_generate(params, TARGET, prompts, dustin=_dustin(128), latency=LATENCY, knapspec=KNAP,
                                      max_new_tokens=12)
    rows = result.rows()
    assert [len(r) for r in rows] == [12, 12]
    assert rows[1] == generate(params, TARGET, prompts[1:], 12).rows()[0]
    assert all(not set(p["skip_attn"]) & set(SRH) for p in result.metrics["knapspec_plans"])


def test_bad_configs_are_refused():
    with pytest.raises(ValueError, match="draft SRH layer 6 out of range: the model has layers 0..5"):
        knapspec_dustin_config(KNAP, _dustin(draft_layers=(2, 6)), TARGET)
    with pytest.raises(ValueError, match=r"draft SRH heads \[7\] out of range"):
        knapspec_dustin_config(KNAP, _dustin(draft_heads=((0, 7), (1,))), TARGET)
    with pytest.raises(BudgetError, match="k=100 is not supported"):
        _dustin(100)
    with pytest.raises(ValueError, match="exceed the budget k=128"):
        _dustin(128, sinks=100)
    with pytest.raises(ValueError, match="coupled=True"):
        KnapSpecConfig(keep_attention=(2,), coupled=True)
    knap = knapspec_dustin_config(KNAP, _dustin(), TARGET)
    assert knap.keep_attention == SRH and knap.early_exit is None
    # Dustin-T reads no draft signal: nothing to keep
    assert knapspec_dustin_config(KNAP, _dustin(mode="target"), TARGET).keep_attention == ()
