"""A focaljax -> HF export computes what focaljax computes, for every attention family: logits at
twice the trained context, and greedy generation with transformers' KV-cached `generate` (stock
LLaMA / Qwen3, or the exported modeling_focaljax.py with its dilution demand and τ sums)."""

import json

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from configs import smoke  # pylint: disable=wrong-import-position
from focaljax import config as config_lib  # pylint: disable=wrong-import-position
from focaljax import convert as convert_cli  # pylint: disable=wrong-import-position
from focaljax.evaluation import generate as gen_lib  # pylint: disable=wrong-import-position
from focaljax.evaluation import loading  # pylint: disable=wrong-import-position
from focaljax.interop import hf_modeling  # pylint: disable=wrong-import-position
from focaljax.train import lm  # pylint: disable=wrong-import-position

# case: (model.attention fields, other model fields, the architecture the export names)
CASES = {
    "softmax": (dict(pattern="softmax:rope"), {}, "LlamaForCausalLM"),
    "focal": (dict(pattern="focal:rope", temperature=0.4), {}, "LlamaForCausalLM"),
    "focal_qk_norm": (dict(pattern="focal:rope", temperature=0.4), dict(qk_norm=True),
                      "Qwen3ForCausalLM"),
    # A narrow clip around tau_init (all three given: the defaults scale with head dim): a few
    # steps move x·w_τ by ~1e-2, so τ is clipped on some tokens and follows the mean on others.
    "focal_learned": (dict(pattern="focal:rope", learned=True, tau_min=7.495, tau_max=7.505,
                           tau_init=7.5), {}, "FocaljaxForCausalLM"),
    "dilution": (dict(pattern="dilution:none"), {}, "FocaljaxForCausalLM"),
    "hybrid": (dict(pattern="softmax:rope,dilution:none"), {}, "FocaljaxForCausalLM"),
    # A stock Mistral's cached generate keeps every key at window 1 (transformers 5): ours.
    "window_1": (dict(pattern="softmax:rope"), dict(sliding_window=1), "FocaljaxForCausalLM"),
}
PROMPT, NEW = 16, 32


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
  """case -> (focaljax.load's model, the HF export dir): the smoke model (2 layers, 64-token
  context) trained three optimizer steps on CPU, once per case, then exported."""
  done = {}

  def get(case):
    if case not in done:
      attention, model_fields, _ = CASES[case]
      root = tmp_path_factory.mktemp(case)
      c = smoke.get_config()
      c.model.attention.update(**attention)
      c.model.update(**model_fields)
      c.train.update(steps=3, log_every=3, eval_every=0, ckpt_every=3)
      lm.train(config_lib.parse(c), str(root / "work"))
      assert convert_cli.main(["focaljax-to-hf", str(root / "work"), str(root / "hf")]) == 0
      done[case] = loading.load(str(root / "work")), root / "hf"
    return done[case]
  return get


def _rel(ours, ref):
  return float(np.abs(np.asarray(ours) - ref).max() / np.abs(ref).max())


def _hf_greedy(hf, prompt_BT, max_new, **kw):
  """transformers' cached greedy decoding: (tokens [B, T + new], each step's logits [B, new, V])."""
  hf.generation_config.eos_token_id = None   # run all max_new steps, as focaljax's generate does
  hf.generation_config.pad_token_id = 0
  with torch.no_grad():
    out = hf.generate(torch.from_numpy(prompt_BT).long(), max_new_tokens=max_new, do_sample=False,
                      return_dict_in_generate=True, output_logits=True, **kw)
  return out.sequences.numpy(), torch.stack(out.logits, 1).float().numpy()


@pytest.mark.parametrize("case", list(CASES))
def test_export_matches_focaljax_logits_and_cached_generation(exported, case):
  arch = CASES[case][2]
  m, out = exported(case)
  hf_config = json.loads((out / "config.json").read_text())
  assert hf_config["architectures"] == [arch]
  custom = "auto_map" in hf_config
  assert custom == (out / "modeling_focaljax.py").exists() == (arch == "FocaljaxForCausalLM")
  hf = transformers.AutoModelForCausalLM.from_pretrained(
      out, dtype=torch.float32, **({"trust_remote_code": True} if custom else {})).eval()

  L, V = m.trained_len, m.config.vocab_size
  tokens = np.random.default_rng(0).integers(0, V, (2, 2 * L)).astype(np.int32)
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
  rel = _rel(m.logits(tokens), ref)
  print(f"{case}: max relative logit error at {2 * L} tokens {rel:.2e}")
  assert rel <= 1e-5

  prompt = tokens[:, :PROMPT]
  ours = np.asarray(m.generate(prompt, max_new_tokens=NEW, stop_at_eos=False))
  seq, step_logits = _hf_greedy(hf, prompt, NEW)
  np.testing.assert_array_equal(seq, ours)
  # Every cached step's logits, not only their argmax: a barely trained model repeats tokens.
  full = np.asarray(m.logits(ours))[:, PROMPT - 1:-1]
  assert _rel(full, step_logits) <= 1e-5


def test_custom_generation_past_the_context_with_one_rope_length(exported):
  """rope_length=<final length> gives every position focaljax generate's one NTK-scaled θ."""
  m, out = exported("hybrid")
  hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True,
                                                         dtype=torch.float32).eval()
  T = m.trained_len - 8
  prompt = np.random.default_rng(1).integers(0, m.config.vocab_size, (1, T)).astype(np.int32)
  ours = np.asarray(m.generate(prompt, max_new_tokens=NEW, stop_at_eos=False))
  seq, step_logits = _hf_greedy(hf, prompt, NEW, rope_length=T + NEW)
  np.testing.assert_array_equal(seq, ours)
  full = np.asarray(gen_lib.logits(m.model, ours, rope_length=T + NEW))[:, T - 1:-1]
  assert _rel(full, step_logits) <= 1e-5


def _random_model(**overrides):
  torch.manual_seed(0)
  config = hf_modeling.FocaljaxConfig(
      vocab_size=50, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=8,
      layer_rope=[True, False, True], layer_dilution=[False, True, True],
      layer_learned_tau=[True, False, False], layer_scale=[0.3, 0.35, 0.4], tau_min=1.0,
      tau_max=4.0, tau_init=2.0, **overrides)
  model = hf_modeling.FocaljaxForCausalLM(config).eval()
  with torch.no_grad():
    for p in model.parameters():
      p.normal_(0, 0.3)
  return model


@pytest.mark.parametrize("tau_per_token", [False, True], ids=["running_mean", "per_token"])
def test_modeling_chunked_cache_equals_one_forward(tau_per_token):
  """Prefill in two chunks, then single steps, past the trained context (8): each cached call
  gives the logits of one forward over the whole sequence (dilution demand, τ sums, RoPE)."""
  model = _random_model(tau_per_token=tau_per_token)
  ids = torch.randint(0, 50, (2, 14))
  with torch.no_grad():
    full = model(ids, use_cache=False, rope_length=14).logits
    cache, parts = None, []
    for a, b in [(0, 5), (5, 9)] + [(t, t + 1) for t in range(9, 14)]:
      out = model(ids[:, a:b], cache=cache, rope_length=14)
      cache = out.cache if hasattr(out, "cache") else out.past_key_values
      parts.append(out.logits)
  torch.testing.assert_close(torch.cat(parts, 1), full, rtol=1e-5, atol=1e-5)
  assert cache.get_seq_length() == 14 and cache.layers[1]["demand"].shape == (2, 4, 14)


def test_modeling_refuses_padding_and_foreign_caches():
  model = _random_model()
  ids = torch.randint(0, 50, (2, 4))
  with pytest.raises(ValueError, match="attention_mask has zeros"):
    model(ids, attention_mask=torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]))
  with pytest.raises(ValueError, match="cache is a DynamicCache"):
    model(ids, cache=transformers.DynamicCache())
