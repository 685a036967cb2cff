"""FocusLLM decoding as one program: the fused per-layer step equals the frozen step followed by
the candidates, the compiled loop generates the tokens that recomputing every prompt from scratch
predicts, and the consumed state refuses steps past the buffer. Helpers from test_focus."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from focaljax.focus import evaluate as focus_eval
from focaljax.focus import generate as focus_generate
from focaljax.focus import model as focus
from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib
from test_focus import jitted, perturbed, split, tiny_base, tokens


@pytest.mark.parametrize("path,dtype", [("adapter", jnp.float32), ("frozen", jnp.float32),
                                        ("adapter", jnp.bfloat16)])
def test_decode_step_is_frozen_step_then_candidates(path, dtype):
  base = tiny_base(qk_norm=True, head_dim=16)
  graphdef, state = nnx.split(base)
  base = nnx.merge(graphdef, focus_eval.cast(state, dtype))
  adapter = jax.tree.map(lambda w: w.astype(dtype), perturbed(focus.init_adapter(base, path), 1.0))
  seq_RN = tokens(21, (3, 12))
  theta, pos = base.cfg.rope_theta, 12
  caches = focus.frozen_prefill(base, seq_RN, 16, theta)
  prev_R, token_R = tokens(22, (3,)), tokens(23, (3,))
  kw = dict(implementation="xla", path=path)

  @jax.jit
  def two_pass(caches):
    caches = focus.frozen_step(base, caches, prev_R[:, None], pos, theta)
    return (caches, *focus.candidates(adapter, base, caches, token_R[:, None],
                                      jnp.full((3, 1), pos + 1), theta, **kw))

  fused = jax.jit(lambda c: focus.decode_step(adapter, base, c, prev_R, token_R, pos, theta,
                                              **kw))(caches)
  tol = dict(atol=1e-5, rtol=1e-5) if dtype == jnp.float32 else dict(atol=3e-2, rtol=3e-2)
  for got, want in zip(jax.tree.leaves(fused), jax.tree.leaves(two_pass(caches))):
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)


@pytest.mark.parametrize("window", [None, 6])
def test_compiled_loop_generates_what_recomputation_predicts(window):
  base = tiny_base(qk_norm=True)
  if window:   # the frozen token's keys are windowed: generation keeps the two-pass step
    # Three layers: a window in layer 0 changes the layer-1 cache, which reaches the local
    # decoder only through layer 2's candidate keys.
    attention = attn_lib.AttentionConfig(layers=attn_lib.parse_pattern("softmax:rope", 3),
                                         sliding_window=window)
    base = model_lib.Transformer(dataclasses.replace(base.cfg, num_layers=3,
                                                     attention=attention), nnx.Rngs(0))
  adapter = perturbed(focus.init_adapter(base), scale=1.0)
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4)
  memory, prompt = tokens(31, (2, 24)), tokens(32, (2, 10))
  graphdef, params = split(base, adapter)
  new = 5
  out = focus_generate.generate(adapter, base, memory, prompt, cfg, max_new_tokens=new)
  state, logits_BV = focus_generate.prefill(adapter, base, memory, prompt, cfg, new)
  for t in range(new):
    # From scratch: the dynamic prompt is the last 4 + t tokens (it grows; its start is fixed).
    grown = dataclasses.replace(cfg, prompt_len=4 + t)
    want_BV = jitted(graphdef, focus.logits, cfg=grown)(params, memory, out[:, :10 + t])[:, -1]
    np.testing.assert_array_equal(jnp.argmax(want_BV, -1), out[:, 10 + t])
    np.testing.assert_allclose(logits_BV, want_BV, atol=1e-5, rtol=1e-5)
    if t < new - 1:
      state, logits_BV = focus_generate.step(adapter, base, state, out[:, 10 + t])
  np.testing.assert_array_equal(state["tokens"], out[:, :-1])


def test_decode_refuses_steps_past_the_buffer():
  base = tiny_base()
  adapter = focus.init_adapter(base)
  cfg = focus.FocusConfig(chunk_size=8, prompt_len=4)
  state, logits_BV = focus_generate.prefill(adapter, base, tokens(41, (1, 16)),
                                            tokens(42, (1, 6)), cfg, max_new_tokens=3)
  with pytest.raises(ValueError, match="room for 2"):
    focus_generate.decode(adapter, base, state, logits_BV, 3)
  state, _, _ = focus_generate.decode(adapter, base, state, logits_BV, 2)
  with pytest.raises(ValueError, match="room for 0"):
    focus_generate.step(adapter, base, state, jnp.zeros((1,), jnp.int32))
