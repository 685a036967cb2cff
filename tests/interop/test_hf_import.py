"""HF -> focaljax for the fields beyond plain Llama: Qwen2's q/k/v biases, Llama 3's "llama3" RoPE
scaling and Mistral's sliding window. Tiny random `transformers` models are saved, imported and
loaded with `focaljax.load`; logits agree past the window and past the original context."""

import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from focaljax import config as config_lib  # pylint: disable=wrong-import-position
from focaljax import convert as convert_cli  # pylint: disable=wrong-import-position
from focaljax.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position
from focaljax.evaluation import loading  # pylint: disable=wrong-import-position
from focaljax.interop import hf_import  # pylint: disable=wrong-import-position

VOCAB = tokenizer_lib.bundled().vocab_size
_LLAMA3 = {"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 32}
# Each case: (model class, config class, config fields, what the import must record).
CASES = {
    "qwen2_bias": ("Qwen2ForCausalLM", "Qwen2Config", {}, {"qkv_bias": True}),
    # theta 5000, head_dim 16: wavelengths from 6 to 10^4 positions fall in all three bands.
    "llama3_rope": ("LlamaForCausalLM", "LlamaConfig", {"rope_parameters": {
        "rope_theta": 5000.0, **_LLAMA3}}, {"rope_scaling": _LLAMA3}),
    "mistral_window": ("MistralForCausalLM", "MistralConfig", {"sliding_window": 16},
                       {"sliding_window": 16}),
}


def _tiny(path, model_cls, config_cls, fields):
  torch.manual_seed(0)
  kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-6, tie_word_embeddings=False)
  model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**{**kw, **fields}))
  with torch.no_grad():
    # Norm gains start at 1 and biases at 0: perturb everything, or a dropped one goes unnoticed.
    for name, p in model.named_parameters():
      p.add_(0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
  model.save_pretrained(path)
  shutil.copyfile(tokenizer_lib.BUNDLED_FILE, os.path.join(path, "tokenizer.json"))
  return model.float().eval()


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_past_window_and_original_context(tmp_path, case):
  model_cls, config_cls, fields, want = CASES[case]
  model = _tiny(tmp_path / "hf", model_cls, config_cls, fields)
  assert convert_cli.main(["hf-to-focaljax", str(tmp_path / "hf"), str(tmp_path / "work")]) == 0
  m = loading.load(str(tmp_path / "work"))
  cfg = m.config
  got = {"qkv_bias": cfg.qkv_bias, "sliding_window": cfg.attention.sliding_window,
         "rope_scaling": cfg.rope_scaling and {"rope_type": "llama3", **vars(cfg.rope_scaling)}}
  assert {k: got[k] for k in want} == want
  # 80 positions: past the window (16) and the original context (32), inside the 128 trained.
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 80)).astype(np.int32)
  ours = np.asarray(m.logits(tokens))
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long()).logits.numpy()
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  print(f"{case}: max relative logit error {rel:.2e}")
  assert rel < 1e-5


def _hf(**fields):
  return {"architectures": ["MistralForCausalLM"], "vocab_size": 256, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 64, **fields}


@pytest.mark.parametrize("fields,window", [
    (dict(sliding_window=16), 16),
    (dict(sliding_window=None), 0),
    # LlamaConfig has no window: transformers ignores the field, and so do we.
    (dict(architectures=["LlamaForCausalLM"], sliding_window=16), 0),
    # Qwen's window is off unless use_sliding_window, and then from layer max_window_layers on.
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=16), 0),
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
          max_window_layers=0), 16),
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
          layer_types=["full_attention"] * 2), 0),
])
def test_sliding_window_is_recorded_where_transformers_applies_it(fields, window):
  assert hf_import.hf_config_to_focaljax(_hf(**fields)).model.sliding_window == window


@pytest.mark.parametrize("fields,match", [
    (dict(architectures=["Qwen2ForCausalLM"], sliding_window=16, use_sliding_window=True,
          max_window_layers=1), r"layer_types=\['full_attention', 'sliding_attention'\]"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "rope_scaling.low_freq_factor"),
    (dict(rope_scaling={**_LLAMA3, "high_freq_factor": 0.5}), "model.rope_scaling: need factor"),
    (dict(attention_bias=True), "attention_bias=true.*o_proj"),
])
def test_what_cannot_be_imported_names_the_field(fields, match):
  with pytest.raises(ValueError, match=match):
    config_lib.parse(hf_import.hf_config_to_focaljax(_hf(**fields)))
