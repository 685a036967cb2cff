"""pallas_kernels.condense.api (FocusLLM's candidate and local attention kernels) == their specs.

Invariants: on fresh random inputs the kernels' outputs and gradients equal the pure-JAX specs in
`condense.reference` (float32 and bfloat16, GQA/MQA/MHA, several chunk/row counts, lengths that
need padding, rows with no visible key, no candidates); gradients w.r.t. a subset of the inputs (the
training case: the cache closed over) take the reduced backward and still match; FocusLLM's loss,
its adapter gradient and generation give the same numbers with implementation="pallas" as "xla".
On CPU the kernels run in Pallas interpret mode; `test_lowers_to_triton` checks every launch
lowers through Pallas' Triton backend for CUDA; `TestCompiledGPU` repeats the comparison compiled
at realistic shapes when jax.default_backend() == "gpu".

Run: python -m pytest -q tests/kernels/condense/test_condense.py   (GPU only: -k Compiled)
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import focus as focus_config
from focaljax.model import attention as attn_lib
from focaljax import config as config_lib
from focaljax.focus import model as focus
from focaljax.focus import generate as focus_generate
from focaljax.model import decoder as model_lib
from pallas_kernels.condense import api as condense
from pallas_kernels.condense import reference as condense_ref

ON_GPU = jax.default_backend() == "gpu"
SMALL = condense.BlockSizes(block_k=16, split_k=32, block_q=16, block_kv=32, block_q_dkv=32,
                            block_kv_dkv=16, block_q_dq=32, block_kv_dq=16)
TOL = {jnp.float32: 2e-5, jnp.bfloat16: 2e-2}  # max|err| / max|ref|


@pytest.fixture
def strict_ranks():
  # Kernel tests only: the model code (the FocusLLM tests below) relies on rank promotion.
  with jax.numpy_rank_promotion("raise"):
    yield


def _normal(key, shape, dtype):
  return jax.random.normal(key, shape, jnp.float32).astype(dtype)


def _rel_err(a, b):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def _check_vjp(kernel, spec, args, wrt, do, dtype):
  """Output and the gradients w.r.t. args[i] for i in `wrt`: kernel vs spec, each one jit."""
  def out_and_grads(fn, *a):
    out, vjp = jax.vjp(lambda *d: fn(*[d[wrt.index(i)] if i in wrt else x
                                       for i, x in enumerate(a)]), *[a[i] for i in wrt])
    return (out,) + vjp(do)

  got = jax.jit(lambda *a: out_and_grads(kernel, *a))(*args)
  with jax.default_matmul_precision("highest"):  # the GPU reference must not use TF32 either
    want = jax.jit(lambda *a: out_and_grads(spec, *a))(*args)
  assert got[0].dtype == args[0].dtype and got[0].shape == args[0].shape
  errs = {f"d{i}" if j else "out": _rel_err(g, w)
          for j, (i, g, w) in enumerate(zip((None,) + tuple(wrt), got, want)) if w.size}
  bad = {n: e for n, e in errs.items() if not e <= TOL[dtype]}
  assert not bad, f"relative errors above {TOL[dtype]}: {bad} (all: {errs})"


def _compare_candidate(seed, *, R, Q, S, N, K, D=16, dtype=jnp.float32, self_kv=True,
                       wrt=(0, 1, 2, 4, 5), blocks=SMALL, interpret=True):
  ks = jax.random.split(jax.random.key(seed), 7)
  q = _normal(ks[0], (R, Q, N, D), dtype)
  k, v = _normal(ks[1], (R, S, K, D), dtype), _normal(ks[2], (R, S, K, D), dtype)
  sk = _normal(ks[3], (R, Q, K, D), dtype) if self_kv else None
  sv = _normal(ks[4], (R, Q, K, D), dtype) if self_kv else None
  vlen = jax.random.randint(ks[5], (R, Q), 0, S + 1).at[0, 0].set(0).at[-1, -1].set(S)
  do = _normal(ks[6], (R, Q, N, D), dtype)
  kernel = lambda q, k, v, vl, sk, sv: condense.candidate_attention(
      q, k, v, vl, sk, sv, scale=0.3, interpret=interpret, block_sizes=blocks)
  spec = lambda q, k, v, vl, sk, sv: condense_ref.candidate_attention_reference(
      q, k, v, vl, sk, sv, scale=0.3)
  if not self_kv:
    wrt = tuple(i for i in wrt if i < 4)
  _check_vjp(kernel, spec, (q, k, v, vlen, sk, sv), wrt, do, dtype)


def _compare_local(seed, *, R, T, C, N, K, D=16, dtype=jnp.float32, wrt=(0, 1, 2, 3, 4),
                   blocks=SMALL, interpret=True):
  ks = jax.random.split(jax.random.key(seed), 6)
  q = _normal(ks[0], (R, T, N, D), dtype)
  k, v = _normal(ks[1], (R, T, K, D), dtype), _normal(ks[2], (R, T, K, D), dtype)
  ck, cv = _normal(ks[3], (R, C, K, D), dtype), _normal(ks[4], (R, C, K, D), dtype)
  do = _normal(ks[5], (R, T, N, D), dtype)
  kernel = lambda *a: condense.local_attention(*a, scale=0.3, interpret=interpret,
                                               block_sizes=blocks)
  spec = lambda *a: condense_ref.local_attention_reference(*a, scale=0.3)
  _check_vjp(kernel, spec, (q, k, v, ck, cv), wrt, do, dtype)


@pytest.mark.parametrize("kw", [
    dict(R=3, Q=5, S=40, N=4, K=2),                                 # S padded, 2 splits, G=2
    dict(R=6, Q=1, S=64, N=8, K=2, dtype=jnp.bfloat16, wrt=(0, 4, 5), blocks=None),  # generation
    dict(R=2, Q=3, S=48, N=2, K=1, self_kv=False),                  # no self key: empty rows -> 0
])
@pytest.mark.usefixtures("strict_ranks")
def test_candidate_matches_reference(kw):
  _compare_candidate(1, **kw)


@pytest.mark.parametrize("kw", [
    dict(R=2, T=40, C=5, N=4, K=2),                                 # T and C padded, GQA
    dict(R=3, T=64, C=16, N=4, K=1, dtype=jnp.bfloat16, blocks=None),  # MQA, default tiles
    dict(R=2, T=32, C=0, N=2, K=2),                                 # no memory: causal only
])  # Gradients w.r.t. the candidates alone (layer 0 in training): the FocusLLM test below.
@pytest.mark.usefixtures("strict_ranks")
def test_local_matches_reference(kw):
  _compare_local(2, **kw)


@pytest.mark.usefixtures("strict_ranks")
def test_candidate_mass_is_the_local_attentions_weight_on_each_candidate():
  """With candidate c's value the one-hot e_c and zero local values, local_attention's output at
  position t is exactly the mass that t puts on each candidate."""
  R, T, C, N, K, D = 2, 24, 5, 4, 2, 16
  ks = jax.random.split(jax.random.PRNGKey(3), 3)
  q = _normal(ks[0], (R, T, N, D), jnp.float32)
  k = _normal(ks[1], (R, T, K, D), jnp.float32)
  ck = _normal(ks[2], (R, C, K, D), jnp.float32)
  cv = jnp.broadcast_to(jnp.eye(C, D)[None, :, None], (R, C, K, D))
  out_RTND = condense_ref.local_attention_reference(q, k, jnp.zeros_like(k), ck, cv, scale=0.3)
  at = jnp.array([0, 17])
  mass_RNC = condense_ref.candidate_mass_reference(q[jnp.arange(R), at], k, ck, at, scale=0.3)
  np.testing.assert_allclose(mass_RNC, out_RTND[jnp.arange(R), at][..., :C], rtol=1e-5,
                             atol=1e-6)
  assert mass_RNC.shape == (R, N, C) and float(mass_RNC.sum(-1).max()) <= 1 + 1e-6


def test_lowers_to_triton():
  """Forward + backward of both kernels lower through Pallas' Triton backend for CUDA (no GPU
  needed; PTX is not compiled). The cache-gradient variant only appears when asked for."""
  sds = jax.ShapeDtypeStruct
  q, k = sds((4, 16, 8, 64), jnp.bfloat16), sds((4, 256, 2, 64), jnp.bfloat16)
  sk, vl = sds((4, 16, 2, 64), jnp.bfloat16), sds((4, 16), jnp.int32)
  lq, lk = sds((4, 128, 8, 64), jnp.bfloat16), sds((4, 128, 2, 64), jnp.bfloat16)
  ck = sds((4, 64, 2, 64), jnp.bfloat16)

  def names(fn, argnums, *args):
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))
    text = jax.jit(jax.grad(loss, argnums)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    return set(re.findall(r'name = "(condense_[a-z_]+)"', text))

  cand = lambda q, k, v, sk, sv, vl: condense.candidate_attention(q, k, v, vl, sk, sv, scale=0.1)
  assert names(cand, (0, 3, 4), q, k, k, sk, sk, vl) == {"condense_candidate_fwd",
                                                          "condense_candidate_bwd"}
  assert names(cand, (0, 1), q, k, k, sk, sk, vl) == {"condense_candidate_fwd",
                                                       "condense_candidate_bwd_dkv"}
  local = lambda *a: condense.local_attention(*a, scale=0.1)
  assert names(local, (0, 1, 2, 3, 4), lq, lk, lk, ck, ck) == {
      "condense_local_fwd", "condense_local_dq", "condense_local_dkv", "condense_local_dkv_cand"}
  assert names(local, (3,), lq, lk, lk, ck, ck) == {"condense_local_fwd",
                                                    "condense_local_dkv_cand"}


@pytest.mark.usefixtures("strict_ranks")
def test_contracts_raise_naming_the_field():
  q = jnp.zeros((1, 2, 4, 16), jnp.float32)
  k = jnp.zeros((1, 32, 2, 16), jnp.float32)
  vl = jnp.zeros((1, 2), jnp.int32)
  with pytest.raises(ValueError, match="k_RSKD must share q's dtype"):
    condense.candidate_attention(q, k.astype(jnp.bfloat16), k, vl, scale=0.1, interpret=True)
  with pytest.raises(ValueError, match="visible_len_RQ"):
    condense.candidate_attention(q, k, k, vl[:, :1], scale=0.1, interpret=True)
  with pytest.raises(ValueError, match="head dim"):
    condense.local_attention(q[..., :12], k[:, :2, :, :12], k[:, :2, :, :12], k[:, :1, :, :12],
                             k[:, :1, :, :12], scale=0.1, interpret=True)
  with pytest.raises(ValueError, match="BlockSizes.split_k"):
    condense.BlockSizes(split_k=24)
  with pytest.raises(ValueError, match="FocusConfig.implementation.*pallas"):
    focus.FocusConfig(chunk_size=8, implementation="triton")
  config = focus_config.get_config("size=small")
  config.focus.implementation = "triton"
  with pytest.raises(config_lib.ConfigError, match="focus.implementation.*pallas"):
    config_lib.focus_config(config, context=4096)


# ------------------------------------------------------------------------- the FocusLLM model


def _tiny_base():
  cfg = model_lib.ModelConfig(
      vocab_size=97, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
      d_ff=64, max_seq_len=32, qk_norm=True,
      attention=attn_lib.AttentionConfig(layers=attn_lib.parse_pattern("softmax:rope,focal:rope",
                                                                       2)))
  base = model_lib.Transformer(cfg, nnx.Rngs(0))
  adapter = focus.init_adapter(base)
  leaves, tree = jax.tree.flatten(adapter)
  keys = jax.random.split(jax.random.key(5), len(leaves))
  adapter = jax.tree.unflatten(tree, [w + 0.3 * jnp.std(w) * jax.random.normal(k, w.shape)
                                      for w, k in zip(leaves, keys)])
  return base, adapter


def test_focus_loss_and_adapter_gradient_match_xla():
  """Covers the reduced backward passes too: layer 0's local q/k/v and every chunk cache are
  unperturbed (the base is closed over), so only the candidates' dk/dv and dq run there."""
  base, adapter = _tiny_base()
  graphdef, base_state = nnx.split(base)
  tokens = lambda seed, shape: jax.random.randint(jax.random.key(seed), shape, 1, 97)
  memory, seq = tokens(1, (2, 24)), tokens(2, (2, 13))   # 3 chunks of 8; 4 targets

  def loss_and_grad(impl):
    cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, implementation=impl)
    loss = lambda a, s: focus.loss(a, nnx.merge(graphdef, s), memory, seq, cfg, num_targets=4)
    return jax.jit(jax.value_and_grad(loss))(adapter, base_state)

  (l_xla, g_xla), (l_pal, g_pal) = loss_and_grad("xla"), loss_and_grad("pallas")
  np.testing.assert_allclose(l_pal, l_xla, rtol=1e-5, atol=1e-5)
  errs = jax.tree.map(_rel_err, g_pal, g_xla)
  assert max(jax.tree.leaves(errs)) < 1e-4, errs


def test_focus_generation_matches_xla():
  base, adapter = _tiny_base()
  memory = jax.random.randint(jax.random.key(3), (1, 16), 1, 97)
  prompt = jax.random.randint(jax.random.key(4), (1, 6), 1, 97)
  runs = {}
  for impl in ("xla", "pallas"):
    cfg = focus.FocusConfig(chunk_size=8, prompt_len=4, implementation=impl)
    state, logits_BV = focus_generate.prefill(adapter, base, memory, prompt, cfg, max_new_tokens=2)
    state, logits2_BV = focus_generate.step(adapter, base, state, jnp.argmax(logits_BV, -1))
    assert state["implementation"] == impl
    runs[impl] = (logits_BV, logits2_BV)
  for got, want in zip(runs["pallas"], runs["xla"]):
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- compiled (GPU)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU, reason="compiled Triton kernels need jax.default_backend()=='gpu'")
@pytest.mark.usefixtures("strict_ranks")
class TestCompiledGPU:
  """The comparisons compiled through Triton: small tiles, then FocusLLM-sized shapes with the
  default tiles (64 chunk rows x 2048 cached keys; a 512-token local window with 64 candidates)."""

  @pytest.mark.parametrize("kw", [dict(R=3, Q=5, S=40, N=4, K=2),
                                  dict(R=2, Q=3, S=48, N=2, K=1, self_kv=False)])
  def test_candidate_small_tiles(self, kw):
    _compare_candidate(10, interpret=False, **kw)

  @pytest.mark.parametrize("kw", [dict(R=2, T=40, C=5, N=4, K=2), dict(R=2, T=32, C=0, N=2, K=2)])
  def test_local_small_tiles(self, kw):
    _compare_local(11, interpret=False, **kw)

  @pytest.mark.parametrize("Q", [1, 16])
  @pytest.mark.parametrize("dtype, wrt", [(jnp.bfloat16, (0, 4, 5)),
                                          (jnp.float32, (0, 1, 2, 4, 5))])
  def test_candidate_realistic(self, Q, dtype, wrt):
    _compare_candidate(12 + Q, R=64, Q=Q, S=2048, N=16, K=4, D=64, dtype=dtype, wrt=wrt,
                       blocks=None, interpret=False)

  @pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
  def test_local_realistic(self, dtype):
    _compare_local(13, R=8, T=512, C=64, N=16, K=4, D=64, dtype=dtype, blocks=None,
                   interpret=False)
