"""The fused projection layout (docs/methods.md §2, fused projections): q/k/v as one matrix, gate/up as one.
The same numbers as the separate layout, three fewer matrix products per layer in the compiled program,
lossless speculative decoding on it, and clear refusals where the layout cannot go (a mesh, mixed layers)."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import generate
from jaxspec.decoding.policies import SelfDraft, parse_skip_spec
from jaxspec.decoding.speculative import EngineConfig, speculative_generate
from jaxspec.models import params as P
from jaxspec.models.cache import init_cache
from jaxspec.models.llama import forward, fuse_projections, init_params, unfuse_projections

CONFIG = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32", attention_bias=True)


@pytest.mark.parametrize("bias", [True, False])
def test_fused_layout_holds_the_same_numbers(bias):
    config = CONFIG.replace(attention_bias=bias)
    params = init_params(config, jax.random.PRNGKey(0), scale=0.2)
    fused = fuse_projections(params)
    assert P.is_fused(fused) and not P.is_fused(params)
    assert fuse_projections(fused).layers[0] is fused.layers[0]  # already fused: as it is
    layer = fused.layers[0]
    assert layer.wq is None and layer.w_up is None and layer.wqkv.shape == (64, 4 * 16 + 2 * 2 * 16)
    assert layer.w_gate_up.shape == (64, 2 * 96) and (layer.bqkv is None) == (not bias)
    P.check_param_shapes(fused, config)
    # the declaration of the fused layout matches what fusing built, leaf for leaf
    info = P.model_info(config, fused=True)
    for array, item in zip(jax.tree.leaves(fused), jax.tree.leaves(info, is_leaf=lambda x: isinstance(x, P.ArrayInfo))):
        assert array.shape == item.shape and array.dtype == item.dtype
    assert P.param_bytes(fused) == P.param_bytes(params)
    back = unfuse_projections(fused, config)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert unfuse_projections(params, config).layers[0] is params.layers[0]  # separate: as they are
    # a forward of several tokens on a cache: the same logits and the same K/V written
    cache = init_cache(config, 2, 32)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, 97, (2, 7)))
    a, b = forward(params, tokens, cache, config=config), forward(fused, tokens, cache, config=config)
    np.testing.assert_allclose(np.asarray(a.logits), np.asarray(b.logits), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.cache.keys[2]), np.asarray(b.cache.keys[2]), rtol=1e-5, atol=1e-5)
    # cast keeps the layout
    assert P.is_fused(P.cast_params(fused, config.replace(dtype="bfloat16")))


def test_fused_layout_runs_three_fewer_products_per_layer():
    """The compiled one-token step: q/k/v in one product instead of three, gate/up in one instead of two."""
    params = init_params(CONFIG, jax.random.PRNGKey(0), scale=0.2)
    cache = init_cache(CONFIG, 2, 32)
    token = jnp.zeros((2, 1), jnp.int32)

    def products(p):
        step = jax.jit(lambda pp, t, c: forward(pp, t, c, config=CONFIG).logits)
        text = step.lower(p, token, cache).compile().as_text()
        return len(re.findall(r" dot\(", text))

    separate, fused = products(params), products(fuse_projections(params))
    assert separate - fused == 3 * CONFIG.num_layers, (separate, fused)


def test_greedy_speculative_on_fused_params_equals_ar():
    params = fuse_projections(init_params(CONFIG, jax.random.PRNGKey(1), scale=0.2))
    prompts = [np.random.RandomState(3).randint(0, 97, n).tolist() for n in (5, 17, 40)]
    ar = generate(params, CONFIG, prompts, 20).rows()
    policy = SelfDraft(CONFIG)
    spec = speculative_generate(params, CONFIG, prompts, draft_policy=policy,
                                draft_state=policy.initial_state(parse_skip_spec("attn:1;mlp:2", 3)),
                                engine=EngineConfig(gamma=3, max_new_tokens=20))
    assert spec.rows() == ar and spec.metrics["tau"] > 1.0


def test_fused_layout_refusals():
    from jaxspec.models.sharding import shard_params
    from jaxspec.parallel import make_mesh

    params = init_params(CONFIG, jax.random.PRNGKey(0), scale=0.2)
    fused = fuse_projections(params)
    mixed = fused.replace(layers=(params.layers[0],) + fused.layers[1:])
    with pytest.raises(ValueError, match="mix the fused and the separate projection layout"):
        P.check_param_shapes(mixed, CONFIG)
    with pytest.raises(ValueError, match="parameter 'layers.0.w_down' has shape \\(96, 64\\)"):
        P.check_param_shapes(fused, CONFIG.replace(intermediate_size=32))
    with pytest.raises(ValueError, match="fused projection layout.*unfuse_projections"):
        shard_params(fused, CONFIG, make_mesh(1, 1))
    with pytest.raises(ValueError, match="wqkv has 128 columns and w_gate_up 192; config .* expects 128 and 64"):
        unfuse_projections(fused, CONFIG.replace(intermediate_size=32))
    with pytest.raises(ValueError, match="params must be a ModelParams, got dict"):
        fuse_projections({"embed": params.embed})


def test_knapspec_dp_over_stacked_fused_layers_equals_ar():
    """KnapSpec's DP stacks the layers and scans over them: on fused params its plans and greedy output hold
    (output equals AR on the same params)."""
    from jaxspec.knapspec import latency
    from jaxspec.knapspec.policy import KnapSpecConfig, knapspec_generate

    config = CONFIG.replace(num_layers=4, attention_bias=False)
    params = fuse_projections(init_params(config, jax.random.PRNGKey(0), scale=0.2))
    prompts = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (9, 14)]
    knap = KnapSpecConfig(gamma_max=4, plan_interval=4, plan_round=2, reference_rounds=2, max_plan_fraction=None,
                          probe_rounds=None, dp_layers="scan")
    result = knapspec_generate(params, config, prompts, latency=latency.LatencyModel(c1=1.0, c2=0.01, c3=0.5),
                               knapspec=knap, max_new_tokens=16)
    assert result.rows() == generate(params, config, prompts, 16).rows() and result.metrics["knapspec_plans"]
