"""The declarative parameter layout and the attention-backend registry (tiny configs, no compiles)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxspec.config import ATTENTION_BACKENDS, ModelConfig, preset
from jaxspec.models import attention, params as P
from jaxspec.models.cache import init_cache
from jaxspec.models.memory import weight_bytes_per_device

TINY = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=24, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=4, attention_bias=True, dtype="float32")


@pytest.mark.parametrize("bias, tied", [(True, False), (False, True)])
def test_everything_derives_from_one_declaration(bias, tied):
    config = TINY.replace(attention_bias=bias, tie_word_embeddings=tied)
    params = P.init_params(config, jax.random.PRNGKey(0))
    info = P.model_info(config)
    # init, shapes, axes and counts have the declaration's tree structure, leaf for leaf
    structure = jax.tree.structure(params)
    assert jax.tree.structure(P.abstract_params(config)) == structure
    axes = P.logical_axes(config)
    is_axes = lambda x: isinstance(x, tuple) and all(a is None or isinstance(a, str) for a in x)  # noqa: E731
    assert jax.tree.structure(axes, is_leaf=is_axes) == structure
    for array, item in zip(jax.tree.leaves(params), jax.tree.leaves(info, is_leaf=lambda x: isinstance(x, P.ArrayInfo))):
        assert array.shape == item.shape and array.dtype == item.dtype and len(item.logical_axes) == array.ndim
    assert P.num_params(config) == P.param_count(params)
    assert (params.layers[0].bq is None) == (not bias) and (params.lm_head is None) == tied
    np.testing.assert_array_equal(np.asarray(params.head), np.asarray(params.embed.T if tied else params.lm_head))
    assert set(P.expected_param_shapes(config)) == set(P.flatten_params(params))
    # one-device weight bytes = the bytes init allocates
    assert weight_bytes_per_device(config, (1, 1)) == P.param_bytes(params)
    # flat form round-trips
    back = P.unflatten_params(P.flatten_params(params), config)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)))


def test_num_params_of_a_real_shape():
    config = preset("smollm2-135m-shape")  # tied embeddings, no bias: the published 134,515,008 parameters
    assert P.num_params(config) == 134_515_008


def test_check_param_shapes_names_the_parameter():
    params = P.init_params(TINY, jax.random.PRNGKey(0))
    P.check_param_shapes(params, TINY)
    with pytest.raises(ValueError, match=r"parameter 'layers.0.w_gate' has shape \(16, 24\); config .* expects "
                                         r"\(16, 32\)"):
        P.check_param_shapes(params, TINY.replace(intermediate_size=32))
    with pytest.raises(ValueError, match="'layers.0.bq' .* is not part of config"):
        P.check_param_shapes(params, TINY.replace(attention_bias=False))
    with pytest.raises(ValueError, match="parameter 'lm_head' is missing"):
        P.check_param_shapes(params.replace(lm_head=None), TINY)
    with pytest.raises(ValueError, match="must be a jaxspec.models.params.ModelParams, got dict"):
        P.check_param_shapes({"embed": params.embed}, TINY)


def test_attention_registry():
    assert tuple(attention.BACKENDS) + (attention.AUTO_BACKEND,) == ATTENTION_BACKENDS
    xla, pallas = attention.get_backend("xla"), attention.get_backend("pallas-interpret")
    assert xla.capacity_multiple == 1 and pallas.capacity_multiple == 64
    assert init_cache(TINY, 1, 70).capacity == 70
    assert init_cache(TINY.replace(attention_backend="pallas-interpret"), 1, 70).capacity == 128
    assert attention.batchable_config(TINY.replace(attention_backend="pallas")).attention_backend == "xla"
    with pytest.raises(ValueError, match=r"attention_backend='flash'; valid: \['pallas', 'pallas-interpret', "
                                         r"'pallas-tpu', 'pallas-tpu-interpret', 'xla', 'auto'\]"):
        attention.get_backend("flash")
    with pytest.raises(ValueError, match=r"attention_backend='flash'"):
        TINY.replace(attention_backend="flash")
    with pytest.raises(ValueError, match=r"'pallas' needs a GPU .* this platform is 'cpu'. Valid here: "
                                         r"\['xla', 'pallas-interpret', 'pallas-tpu-interpret'\]"):
        attention.get_backend("pallas").check_platform("cpu")
    attention.get_backend("pallas").check_platform("gpu")
    xla.check_platform("cpu")
    assert [b.name for b in attention.BACKENDS.values() if b.runs_on("cpu")] == ["xla", "pallas-interpret",
                                                                                 "pallas-tpu-interpret"]
