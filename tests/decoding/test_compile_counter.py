"""The timed run of a warm-up pair reports the compiles it still made (``timed_compiles``)."""

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import ModelConfig
from jaxspec.decoding.autoregressive import CompileCounter, generate, run_with_warmup
from jaxspec.models.llama import init_params

TARGET = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=5, num_heads=4, num_kv_heads=2,
                     head_dim=16, dtype="float32")
PROMPTS = [np.random.RandomState(0).randint(0, 97, n).tolist() for n in (5, 17, 40)]


def test_a_new_program_in_the_timed_run_is_counted_and_a_warm_one_is_not():
    calls = [0]

    def run():  # the second call compiles a program of a new shape, as a timed run taking a new path would
        calls[0] += 1
        x = jnp.arange(3 + 1000 * calls[0], dtype=jnp.float32)
        jax.jit(lambda v: jnp.sin(v) * 2.0)(x).block_until_ready()
        return None, {"prefill_s": 0.0, "decode_s": 0.0}

    _, timings = run_with_warmup(run, warmup=True)
    assert timings["timed_compiles"] >= 1 and timings["timed_compile_s"] > 0

    warm = jax.jit(lambda v: jnp.cos(v) + 1.0)

    def same():  # the same program both times: the warm-up compiled it
        warm(jnp.ones(7)).block_until_ready()
        return None, {"prefill_s": 0.0, "decode_s": 0.0}

    _, timings = run_with_warmup(same, warmup=True)
    assert timings["timed_compiles"] == 0 and timings["timed_compile_s"] == 0.0
    _, timings = run_with_warmup(same, warmup=False)  # no pair: nothing to report
    assert "timed_compiles" not in timings


def test_the_counter_stops_listening_when_left_and_ar_decoding_compiles_nothing_when_timed():
    with CompileCounter() as counter:
        jax.jit(lambda v: v * 3.0 - 1.0)(jnp.ones(11)).block_until_ready()
    assert counter.count >= 1
    before = counter.count
    jax.jit(lambda v: v * 5.0 - 2.0)(jnp.ones(13)).block_until_ready()
    assert counter.count == before  # unregistered on exit
    params = init_params(TARGET, jax.random.PRNGKey(0), scale=0.2)
    result = generate(params, TARGET, PROMPTS, 6, warmup=True)
    assert result.timings["timed_compiles"] == 0, result.timings
    assert np.all(result.num_generated == 6)
