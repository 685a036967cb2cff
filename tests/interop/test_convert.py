"""HF <-> focaljax conversion: logits agree with `transformers`; HF -> focaljax -> HF is bitwise."""

import json
import os
import re
import shutil

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from focaljax import convert as convert_cli  # pylint: disable=wrong-import-position
from focaljax.interop import hf_export  # pylint: disable=wrong-import-position
from focaljax.interop import hf_import  # pylint: disable=wrong-import-position
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

  convert_cli.main(["hf-to-focaljax", str(hf_dir), str(work)])
  m = loading.load(str(work))
  assert m.config.vocab_size == VOCAB and m.config.max_seq_len == 32
  ours = np.asarray(m.logits(tokens))
  with torch.no_grad():
    ref = model(torch.from_numpy(tokens).long()).logits.numpy()
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  print(f"{case}: max relative logit error {rel:.2e}")
  assert rel < 1e-4

  convert_cli.main(["focaljax-to-hf", str(work), str(back), "--max_shard_gb", "0.0001"])
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


def _set(work, **fields):
  """Edits model.attention fields of a workdir's config.json (a model trained that way)."""
  c = json.loads((work / "config.json").read_text())
  c["model"]["attention"].update(fields)
  (work / "config.json").write_text(json.dumps(c))


def _convert(capsys, *argv):
  """main's exit status and its stderr, which must be one line when it fails."""
  capsys.readouterr()   # drop what set-up printed (transformers' progress bars)
  rc = convert_cli.main([str(a) for a in argv])
  err = capsys.readouterr().err.strip()
  if rc:
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
  return rc, err


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3_qk_norm"])
def test_constant_focal_temperature_folds_into_stock_transformers(tmp_path, capsys, qk_norm):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir, qk_norm=qk_norm)
  hf_import.hf_to_focaljax(str(hf_dir), str(work))
  _set(work, pattern="softmax:rope,focal:rope", temperature=0.4)
  assert _convert(capsys, "focaljax-to-hf", work, back)[0] == 0
  fj = json.loads((back / "config.json").read_text())["focaljax"]
  assert fj["pattern"] == "softmax:rope,focal:rope" and fj["folded_layers"] == [1]
  assert fj["folded_into"] == ("self_attn.q_norm.weight" if qk_norm else "self_attn.q_proj.weight")
  # Past the trained context (32): both NTK-scale RoPE, and focal is no longer plain softmax.
  tokens = np.random.default_rng(2).integers(0, VOCAB, (2, 48)).astype(np.int32)
  ours = np.asarray(loading.load(str(work)).logits(tokens))
  hf = transformers.AutoModelForCausalLM.from_pretrained(back).float().eval()
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
  rel = np.abs(ours - ref).max() / np.abs(ref).max()
  print(f"focal t=0.4 qk_norm={qk_norm}: max relative logit error {rel:.2e}")
  assert rel < 1e-5
  # The fold is not a no-op: the unfolded (softmax) weights compute other logits.
  hf_softmax = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).float().eval()
  with torch.no_grad():
    assert np.abs(hf_softmax(torch.from_numpy(tokens).long()).logits.numpy() - ref).max() > 1e-3


@pytest.mark.parametrize("fields,match", [
    # The export's modeling code has no whole-document τ: cached generation only has a prefix.
    (dict(pattern="focal:rope", learned=True, tau_mean="sequence"),
     "layer 0 (focal:rope).*tau_mean='sequence'"),
    # A config that asks for learned τ, over a checkpoint trained without it.
    (dict(pattern="softmax:rope,focal:rope", learned=True), "no param blocks.1.attn.w_tau"),
])
def test_export_refuses_what_it_cannot_compute(tmp_path, capsys, fields, match):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir)
  hf_import.hf_to_focaljax(str(hf_dir), str(work))
  _set(work, **fields)
  rc, err = _convert(capsys, "focaljax-to-hf", work, back)
  assert rc == 2 and re.search(re.escape(match).replace(r"\.\*", ".*"), err), err
  assert not back.exists()


def test_layers_stock_transformers_lacks_export_with_their_modeling_code(tmp_path, capsys):
  """Dilution and RoPE-less layers: config.json names modeling_focaljax.py in its auto_map, and
  the model trust_remote_code loads computes focaljax's logits (tests/interop/test_hf_export.py
  checks every family on trained models, generation included)."""
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir)
  hf_import.hf_to_focaljax(str(hf_dir), str(work))
  _set(work, pattern="softmax:none,dilution:rope")
  assert _convert(capsys, "focaljax-to-hf", work, back)[0] == 0
  hf_config = json.loads((back / "config.json").read_text())
  assert hf_config["architectures"] == ["FocaljaxForCausalLM"]
  assert hf_config["layer_rope"] == [False, True] and hf_config["layer_dilution"] == [False, True]
  assert "trust_remote_code=True" in (back / "README.md").read_text()
  tokens = np.random.default_rng(3).integers(0, VOCAB, (2, 48)).astype(np.int32)
  hf = transformers.AutoModelForCausalLM.from_pretrained(back, trust_remote_code=True).eval()
  with torch.no_grad():
    ref = hf(torch.from_numpy(tokens).long()).logits.numpy()
  ours = np.asarray(loading.load(str(work)).logits(tokens))
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


_LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}


@pytest.mark.parametrize("family,extra,pattern,arch", [
    ("Qwen2", {}, "softmax:rope,focal:rope", "Qwen2ForCausalLM"),    # 1/t folds into q's bias too
    ("Qwen2", {}, "softmax:none,dilution:rope", "FocaljaxForCausalLM"),
    ("Mistral", {"sliding_window": 16}, None, "MistralForCausalLM"),
    ("Mistral", {"sliding_window": 16}, "softmax:none,focal:rope", "FocaljaxForCausalLM"),
    ("Llama", {"rope_scaling": _LLAMA3}, None, "LlamaForCausalLM"),
    ("Llama", {"rope_scaling": _LLAMA3}, "softmax:rope,dilution:none", "FocaljaxForCausalLM"),
], ids=["qwen2", "qwen2_custom", "mistral", "mistral_custom", "llama3", "llama3_custom"])
def test_biases_windows_and_llama3_rope_export(tmp_path, family, extra, pattern, arch):
  """Each imported feature exports to its stock class, or with the modeling code once a layer
  needs it; the custom model also past the trained context (32), where focaljax NTK-scales θ on
  top of Llama 3's bands (stock transformers does not, so it is checked within the context)."""
  torch.manual_seed(0)
  kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, **extra)
  model = getattr(transformers, f"{family}ForCausalLM")(
      getattr(transformers, f"{family}Config")(**kw))
  with torch.no_grad():
    for name, p in model.named_parameters():
      p.add_(0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0, 0.1)
  model.save_pretrained(tmp_path / "hf")
  shutil.copyfile(ASSET, tmp_path / "hf" / "tokenizer.json")
  hf_import.hf_to_focaljax(str(tmp_path / "hf"), str(tmp_path / "work"))
  if pattern:
    _set(tmp_path / "work", pattern=pattern)
  hf_export.focaljax_to_hf(str(tmp_path / "work"), str(tmp_path / "back"))
  assert json.loads((tmp_path / "back" / "config.json").read_text())["architectures"] == [arch]
  hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", trust_remote_code=True)
  T = 32 if arch == "LlamaForCausalLM" else 48
  tokens = np.random.default_rng(4).integers(0, VOCAB, (2, T)).astype(np.int32)
  with torch.no_grad():
    ref = hf.float().eval()(torch.from_numpy(tokens).long()).logits.numpy()
  ours = np.asarray(loading.load(str(tmp_path / "work")).logits(tokens))
  assert np.abs(ours - ref).max() / np.abs(ref).max() < 1e-5


@pytest.mark.parametrize("field,value,match", [
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type='yarn'"),
    ("attention_bias", True, "attention_bias"),
    ("architectures", ["GPT2LMHeadModel"], "architectures"),
    ("hidden_size", None, "hidden_size=None"),
])
def test_unsupported_hf_config_names_the_field(field, value, match):
  hf = dict(architectures=["LlamaForCausalLM"], vocab_size=256, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32)
  hf[field] = value
  with pytest.raises(ValueError, match=match):
    hf_import.hf_config_to_focaljax(hf)


def test_windowless_mistral_and_qwen_window_off_are_accepted():
  hf = dict(architectures=["MistralForCausalLM"], vocab_size=256, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            max_position_embeddings=32, sliding_window=None)
  assert hf_import.hf_config_to_focaljax(hf).model.d_model == 64
  hf.update(architectures=["Qwen3ForCausalLM"], sliding_window=16, use_sliding_window=False)
  assert hf_import.hf_config_to_focaljax(hf).model.d_model == 64


@pytest.fixture(scope="module")
def hf_src(tmp_path_factory):
  path = tmp_path_factory.mktemp("src") / "hf"
  tiny_hf(path, shard="100KB")
  return path


def _truncate(d):
  f = sorted(d.glob("*.safetensors"))[-1]
  f.write_bytes(f.read_bytes()[:-100])


def _drop_shard(d):
  sorted(d.glob("*.safetensors"))[0].unlink()


def _edit_config(**kw):
  def edit(d):
    c = json.loads((d / "config.json").read_text())
    c.update(kw)
    (d / "config.json").write_text(json.dumps(c))
  return edit


@pytest.mark.parametrize("damage,match", [
    (lambda d: (d / "config.json").write_text('{"vocab": 3,'), "config.json is not valid JSON"),
    (lambda d: (d / "config.json").unlink(), "config.json not found"),
    (_edit_config(architectures=["GPT2LMHeadModel"]), "architectures='GPT2LMHeadModel'"),
    (_edit_config(num_hidden_layers="two"), "num_hidden_layers='two'"),
    (_edit_config(intermediate_size=80), r"tensor model\.layers\.0\.mlp\.\w+\.weight has shape"),
    (_truncate, r"model-0000\d-of-0000\d.safetensors is truncated: tensor \S+ ends at byte"),
    (_drop_shard, "lists model-00001-of-0000\\d.safetensors, which is missing"),
    (lambda d: [f.unlink() for f in d.glob("model*")], "neither model.safetensors nor"),
    (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json not found"),
], ids=["bad_json", "no_config", "unknown_arch", "bad_field", "wrong_shape",
        "truncated", "missing_shard", "no_weights", "no_tokenizer"])
def test_import_errors_are_one_line_exit_2(tmp_path, capsys, hf_src, damage, match):
  src = tmp_path / "hf"
  shutil.copytree(hf_src, src)
  damage(src)
  rc, err = _convert(capsys, "hf-to-focaljax", src, tmp_path / "work")
  assert rc == 2 and re.search(match, err), err
  assert not (tmp_path / "work").exists()


def test_non_empty_out_dir_needs_replace(tmp_path, capsys, hf_src):
  work, back = tmp_path / "work", tmp_path / "back"
  for out in (work, back):
    out.mkdir()
    (out / "keep.txt").write_text("mine")
  rc, err = _convert(capsys, "hf-to-focaljax", hf_src, work)
  assert rc == 2 and "is not empty: pass --replace" in err and (work / "keep.txt").exists()
  assert _convert(capsys, "hf-to-focaljax", hf_src, work, "--replace")[0] == 0
  assert not (work / "keep.txt").exists() and (work / "config.json").exists()
  rc, err = _convert(capsys, "focaljax-to-hf", work, back)
  assert rc == 2 and "--replace" in err and (back / "keep.txt").exists()
  assert _convert(capsys, "focaljax-to-hf", work, back, "--replace")[0] == 0
  assert not (back / "keep.txt").exists() and (back / "model.safetensors").exists()
  # --replace never deletes the source it reads.
  rc, err = _convert(capsys, "focaljax-to-hf", work, work, "--replace")
  assert rc == 2 and "holds the source" in err and (work / "config.json").exists()


def test_a_focus_adapter_run_is_named_as_one(tmp_path, capsys):
  # What train.py writes for configs/focus.py: a config.json with a focus section.
  run = tmp_path / "focus_run"
  (run / "checkpoints" / "2").mkdir(parents=True)
  (run / "config.json").write_text(json.dumps({"focus": {"base_workdir": "runs/base"}}))
  for src in (run, run / "checkpoints" / "2"):
    rc, err = _convert(capsys, "focaljax-to-hf", src, tmp_path / "out")
    assert rc == 2 and err == (f"focaljax-convert: error: {run} is a FocusLLM adapter run, not a "
                               "language model; export its base (focus.base_workdir runs/base) "
                               "instead"), err
  assert not (tmp_path / "out").exists()


def test_llama_style_eos_travels_both_ways(tmp_path):
  hf_dir, work, back = tmp_path / "hf", tmp_path / "work", tmp_path / "back"
  tiny_hf(hf_dir)
  # A LLaMA-style tokenizer: its eos is "</s>" (named in tokenizer_config.json), no <|endoftext|>.
  tok = (hf_dir / "tokenizer.json").read_text().replace(tokenizer_lib.EOS_TOKEN, "</s>")
  (hf_dir / "tokenizer.json").write_text(tok)
  (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
  hf_import.hf_to_focaljax(str(hf_dir), str(work))
  assert json.loads((work / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
  assert tokenizer_lib.Tokenizer.load(work).eos_token == "</s>"  # what focaljax.load reads
  hf_export.focaljax_to_hf(str(work), str(back))
  hf_tok = transformers.PreTrainedTokenizerFast.from_pretrained(back)
  assert hf_tok.eos_token == "</s>"
  assert json.loads((back / "config.json").read_text())["eos_token_id"] == hf_tok.eos_token_id
