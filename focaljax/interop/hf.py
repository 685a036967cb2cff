"""Hugging Face LLaMA-family checkpoints <-> focaljax workdirs: what both directions share
(hf_import and hf_export each do one).

Layout: HF stores a linear layer [out, in]; ours is [in, out] with heads split out (q_proj
[N·D, E] -> wq [E, N, D], o_proj [E, N·D] -> wo [N, D, E]). Both sides apply rotate-half RoPE
per head, so q/k rows need no permutation. Neither direction needs torch, and both stream one
tensor at a time: the peak is one converted copy of the weights plus one tensor. What cannot be
converted stops the command with one line naming the field, tensor or layer, and exit status 2;
so does a non-empty OUT_DIR without --replace.
"""

from __future__ import annotations

import json
import os

from etils import epath

from focaljax.data import tokenizer as tokenizer_lib
from focaljax.train import checkpoint

_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


# (HF name under model.layers.<i>., our path under blocks.<i>., leading "in" dims of ours).
# n_in = None: copied as is (reshaped: a bias [N·D] is our [N, D]); otherwise ours = hf.T
# reshaped, hf = ours reshaped to [in, out].T.
_LAYER = (
    ("input_layernorm.weight", "attn_norm.scale", None),
    ("self_attn.q_proj.weight", "attn.wq", 1),
    ("self_attn.k_proj.weight", "attn.wk", 1),
    ("self_attn.v_proj.weight", "attn.wv", 1),
    ("self_attn.q_proj.bias", "attn.bq", None),
    ("self_attn.k_proj.bias", "attn.bk", None),
    ("self_attn.v_proj.bias", "attn.bv", None),
    ("self_attn.o_proj.weight", "attn.wo", 2),
    ("self_attn.q_norm.weight", "attn.q_norm.scale", None),
    ("self_attn.k_norm.weight", "attn.k_norm.scale", None),
    ("post_attention_layernorm.weight", "mlp_norm.scale", None),
    ("mlp.gate_proj.weight", "mlp.w_gate", 1),
    ("mlp.up_proj.weight", "mlp.w_up", 1),
    ("mlp.down_proj.weight", "mlp.w_down", 1),
    ("self_attn.w_tau", "attn.w_tau", None),   # learned-τ layers: the custom export only
)
_TOP = (("model.embed_tokens.weight", "embed", None),
        ("model.norm.weight", "final_norm.scale", None), ("lm_head.weight", "lm_head", 1))


def _name_map(num_layers: int):
  """(hf name, our path tuple, n_in) for every tensor either side may hold."""
  out = [(hf, tuple(ours.split(".")), n_in) for hf, ours, n_in in _TOP]
  for i in range(num_layers):
    out += [(f"model.layers.{i}.{hf}", ("blocks", i, *ours.split(".")), n_in)
            for hf, ours, n_in in _LAYER]
  return out


def _tokenizer(src_dir: str, bundled: bool = False) -> tuple[str, str]:
  """(src_dir's tokenizer.json, or the bundled one if `bundled` and it has none; the eos named by
  its tokenizer_config.json (LLaMA's "</s>"), else focaljax's)."""
  src = epath.Path(src_dir)
  path = src / checkpoint.TOKENIZER_FILE
  if not path.is_file() and bundled:
    path = tokenizer_lib.BUNDLED_FILE
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found: a fast tokenizer (tokenizer.json) is required")
  config = src / "tokenizer_config.json"
  eos = _read_json(config).get("eos_token") if config.is_file() else None
  eos = (eos.get("content") if isinstance(eos, dict) else eos) or tokenizer_lib.EOS_TOKEN
  return str(path), eos


def _copy_tokenizer(src: str, out_dir: str, eos: str):
  out_dir = epath.Path(out_dir)
  epath.Path(src).copy(out_dir / checkpoint.TOKENIZER_FILE, overwrite=True)
  # HF's own file for naming the eos; a LLaMA tokenizer's is "</s>", not <|endoftext|>.
  (out_dir / "tokenizer_config.json").write_text(json.dumps(
      {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, indent=2))


def _read_json(path: str):
  path = epath.Path(path)
  if not path.is_file():
    raise FileNotFoundError(f"{path} not found")
  try:
    return json.loads(path.read_text())
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None


def _out_dir(out_dir: str, source: str, replace: bool, *, create: bool = False) -> epath.Path:
  """Refuses a non-empty out_dir unless `replace`, and never the source's own directory; `create`
  then empties and creates it (once the input has been checked, so a refused conversion deletes
  nothing)."""
  path = epath.Path(out_dir)
  if path.exists() and not path.is_dir():
    raise ValueError(f"{out_dir} exists and is not a directory")
  if path.is_dir() and any(path.iterdir()):
    if not replace:
      raise ValueError(f"{out_dir} exists and is not empty: pass --replace to overwrite it")
    real = lambda p: str(p) if "://" in str(p) else os.path.realpath(p)   # URLs have no links
    out, src = real(out_dir).rstrip("/"), real(source).rstrip("/")
    if src == out or src.startswith(out + "/"):
      raise ValueError(f"{out_dir} holds the source {source}: choose another output directory")
    if create:
      path.rmtree()
  if create:
    path.mkdir(parents=True, exist_ok=True)
  return path
