"""Hugging Face LLaMA-family checkpoints <-> focaljax workdirs: what both directions share.

  python -m focaljax.convert hf-to-focaljax HF_DIR OUT_DIR [--replace]          (hf_import)
  python -m focaljax.convert focaljax-to-hf CKPT OUT_DIR [--dtype bfloat16] [--max_shard_gb 5]
                                            [--replace]                          (hf_export)

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

from focaljax import config as config_lib
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.train import checkpoint

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
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


def _tokenizer_file(workdir: str, run: config_lib.Config) -> str:
  path = epath.Path(workdir) / checkpoint.TOKENIZER_FILE
  if not path.is_file() and run.data.tokenizer == "bundled":
    return str(tokenizer_lib.BUNDLED_FILE)
  return str(path)


def _eos(src_dir: str) -> str:
  """The eos named by HF's tokenizer_config.json (LLaMA's "</s>"), else focaljax's."""
  path = epath.Path(src_dir) / "tokenizer_config.json"
  eos = _read_json(path).get("eos_token") if path.is_file() else None
  return (eos.get("content") if isinstance(eos, dict) else eos) or tokenizer_lib.EOS_TOKEN


def _copy_tokenizer(src: str, out_dir: str, eos: str):
  src, out_dir = epath.Path(src), epath.Path(out_dir)
  if not src.is_file():
    raise FileNotFoundError(f"{src} not found: a fast tokenizer (tokenizer.json) is required")
  src.copy(out_dir / checkpoint.TOKENIZER_FILE, overwrite=True)
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


def _out_dir(out_dir: str, source: str, replace: bool, *, clear: bool = False) -> None:
  """Refuses a non-empty out_dir unless `replace`; `clear` then empties it (once the input has
  been checked, so a refused conversion deletes nothing). Never the source's own directory."""
  path = epath.Path(out_dir)
  if path.exists() and not path.is_dir():
    raise ValueError(f"{out_dir} exists and is not a directory")
  if not path.is_dir() or not any(path.iterdir()):
    return
  if not replace:
    raise ValueError(f"{out_dir} exists and is not empty: pass --replace to overwrite it")
  real = lambda p: str(p) if "://" in str(p) else os.path.realpath(p)   # URLs have no links
  out, src = real(out_dir).rstrip("/"), real(source).rstrip("/")
  if src == out or src.startswith(out + "/"):
    raise ValueError(f"{out_dir} holds the source {source}: choose another output directory")
  if clear:
    path.rmtree()
