"""HF <-> focaljax conversion: logits agree with `transformers`; HF -> focaljax -> HF is bitwise."""

import json
import os
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from focaljax.interop import hf as convert  # pylint: disable=wrong-import-position
from focaljax.evaluation import loading  # pylint: disable=wrong-import-position
from focaljax.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position

VOCAB = tokenizer_lib.bundled().vocab_size
ASSET = str(tokenizer_lib.BUNDLED_FILE)


def tiny_hf(path, *, tied=False, qk_norm=False, shard=None, dtype=None, seed=0):
  """A random 2-layer GQA model saved with save_pretrained, with the bundled tokenizer.json."""
  torch.manual_seed(seed)
  kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
            rms_norm_eps=1e-6, rope_theta=5000.0, tie_word_embeddings=tied)
  if qk_norm:
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(head_dim=16, **kw))
  else:
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw))
  with torch.no_grad():
    # Norm gains start at 1: perturb them, or a swapped norm would go unnoticed.
    for name, p in model.named_parameters():
      p.add_(0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
  model.to(dtype or torch.float32).save_pretrained(
      path, **({"max_shard_size": shard} if shard else {}))
  if dtype is not None:
    # Reloaded in float32 as we load it (.float() would keep RoPE's inv_freq rounded to bf16).
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
  model = model.float().eval()
  shutil.copyfile(ASSET, os.path.join(path, "tokenizer.json"))
  return model


def _tensors(hf_dir):
  out = {}
  for f in sorted(os.listdir(hf_dir)):
    if f.endswith(".safetensors"):
      out.update(safetensors_torch.load_file(os.path.join(hf_dir, f)))
  return out


CASES = {"untied": {}, "tied": {"tied": True}, "sharded": {"shard": "100KB"},
         "qwen3_qk_norm": {"qk_norm": True, "tied": True}, "bf16": {"dtype": torch.bfloat16}}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers_and_round_trip_is_bitwise(tmp_path, case):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  model = tiny_hf(hf_dir, **CASES[case])
  if case == "sharded":
    assert os.path.isfile(hf_dir / "model.safetensors.index.json")
  tokens = np.random.default_rng(0).integers(0, VOCAB, (2, 24)).astype(np.int32)

  convert.main(["hf-to-focaljax", str(hf_dir), str(work)])
  m = loading.load(str(work))
  assert m.config.vocab_size == VOCAB and m.config.max_seq_len == 32
  ours = np.asarray(m.logits(tokens))
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long()).logits.numpy()
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  print(f"{case}: max relative logit error {rel:.2e}")
  assert rel < 1e-4

  convert.main(["focaljax-to-hf", str(work), str(back), "--max_shard_gb", "0.0001"])
  src, out = _tensors(hf_dir), _tensors(back)
  assert sorted(out) == sorted(src)
  for name, t in src.items():
    assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
  # The export is a valid HF checkpoint: transformers loads it and computes the same logits,
  # also past the trained context (32), where both NTK-scale RoPE (HF "dynamic", factor 1).
  again = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
  long = np.random.default_rng(1).integers(0, VOCAB, (1, 48)).astype(np.int32)
  with torch.no_grad():
    np.testing.assert_array_equal(again(torch.from_numpy(tokens).long()).logits.numpy(), ref)
    ref_long = again(torch.from_numpy(long).long()).logits.numpy()
  ours_long = np.asarray(m.logits(long))
  assert np.abs(ours_long - ref_long).max() / np.abs(ref_long).max() < 1e-4


def test_focal_export_is_flagged(tmp_path):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir)
  convert.hf_to_focaljax(str(hf_dir), str(work))
  with open(work / "config.json") as f:
    c = json.load(f)
  c["model"]["attention"]["pattern"] = "softmax:rope,focal:rope"
  with open(work / "config.json", "w") as f:
    json.dump(c, f)
  convert.focaljax_to_hf(str(work), str(back))
  with open(back / "config.json") as f:
    extra = json.load(f)["focaljax"]
  assert extra["pattern"] == "softmax:rope,focal:rope" and extra["temperature"] == 0.4
  assert extra["non_hf_layers"] == ["layer 1: focal:rope"]
  assert "focal:rope" in (back / "README.md").read_text()


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("attention_bias", True, "attention_bias"),
    ("architectures", ["GPT2LMHeadModel"], "architectures"),
])
def test_unsupported_hf_config_names_the_field(field, value, match):
  hf = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32)
  hf[field] = value
  with pytest.raises(ValueError, match=match):
    convert.hf_config_to_focaljax(hf)


def test_llama_style_eos_travels_both_ways(tmp_path):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir)
  # A LLaMA-style tokenizer: its eos is "</s>" (named in tokenizer_config.json), no <|endoftext|>.
  tok = (hf_dir / "tokenizer.json").read_text().replace(tokenizer_lib.EOS_TOKEN, "</s>")
  (hf_dir / "tokenizer.json").write_text(tok)
  (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  convert.hf_to_focaljax(str(hf_dir), str(work))
  assert json.loads((work / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
  assert tokenizer_lib.Tokenizer.load(work).eos_token == "</s>"  # what focaljax.load reads
  convert.focaljax_to_hf(str(work), str(back))
  hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(back)
  assert hf_tok.eos_token == "</s>"
  assert json.loads((back / "config.json").read_text())["eos_token_id"] == hf_tok.eos_token_id
