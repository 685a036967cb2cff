"""HF -> focaljax (`python -m focaljax.convert hf-to-focaljax HF_DIR OUT_DIR [--replace]`).

Reads config.json and model.safetensors (or the shards of model.safetensors.index.json) of a
LlamaForCausalLM (Llama 3.1/3.2's "llama3" RoPE scaling is our model.rope_scaling),
MistralForCausalLM (its sliding_window is ours), Qwen2ForCausalLM (its q/k/v biases are our
qkv_bias) or Qwen3ForCausalLM (its per-head q/k RMSNorm is our qk_norm), and writes a workdir
for `focaljax.load`: config.json (configs/base.py's layout; data.seq_len =
max_position_embeddings), the tokenizer files and an Orbax `params` item at checkpoints/0 in the
source dtype.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
import warnings

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from flax import nnx
from flax import traverse_util

from focaljax import config as config_lib
from focaljax.interop import safetensors_file
from focaljax.interop.hf import _ARCHS, _copy_tokenizer, _name_map, _out_dir, _read_json, _tokenizer
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint


_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_LLAMA3 = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _rope(hf: dict) -> tuple[float, dict | None]:
  """(rope_theta, the "llama3" scaling fields or None), accepting transformers 4
  (rope_theta/rope_scaling) and 5 (rope_parameters)."""
  params = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  llama3 = None
  if kind == "dynamic":
    # Ours: θ·(L/T)^(D/(D-2)) past T; HF's dynamic NTK is the same formula when factor == 1.
    if scaling.get("factor", 1.0) != 1.0:
      warnings.warn(f"config.json {field}.factor={scaling['factor']}: focaljax's dynamic NTK "
                    "uses factor 1; logits past max_position_embeddings will differ")
  elif kind == "llama3":
    for key in _LLAMA3:
      if not isinstance(scaling.get(key), (int, float)) or scaling[key] <= 0:
        raise ValueError(f"config.json {field}.{key}={scaling.get(key)!r}: rope_type 'llama3' "
                         "needs a number > 0")
    llama3 = {k: (int if k.startswith("original") else float)(scaling[k]) for k in _LLAMA3}
  elif kind not in (None, "default"):
    raise ValueError(f"config.json {field}.rope_type={kind!r}: only 'default', 'dynamic' and "
                     "'llama3' map onto focaljax's RoPE")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"config.json partial_rotary_factor={hf['partial_rotary_factor']}: "
                     "focaljax rotates the whole head dimension")
  return float(theta), llama3


def _window(hf: dict, arch: str) -> int:
  """The sliding window of every layer (0: none). Mistral's is on unless null; Qwen's only with
  use_sliding_window, in the layers layer_types (or max_window_layers) makes sliding; LlamaConfig
  has none, so transformers ignores the field."""
  window = hf.get("sliding_window")
  if not window or arch == "llama" or (arch != "mistral" and not hf.get("use_sliding_window")):
    return 0
  kinds = set(hf.get("layer_types") or [
      "sliding_attention" if arch == "mistral" or i >= hf.get("max_window_layers", 28)
      else "full_attention" for i in range(hf["num_hidden_layers"])])
  if kinds == {"full_attention"}:
    return 0
  if kinds != {"sliding_attention"}:
    raise ValueError(f"config.json layer_types={sorted(kinds)}: focaljax applies sliding_window="
                     f"{window} to every layer or to none")
  if not isinstance(window, int) or window < 0:
    raise ValueError(f"config.json sliding_window={window!r}: a positive integer or null")
  return window


def _check_hf(hf: dict) -> str:
  """Refuses what cannot be imported, naming the field; returns _ARCHS's short name of the
  model class config.json names."""
  if not isinstance(hf, dict):
    raise ValueError("config.json is not a JSON object")
  arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
  if arch not in _ARCHS:
    raise ValueError(f"config.json architectures={arch!r} is not one of {list(_ARCHS)}")
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings"):
    if not isinstance(hf.get(field), int) or hf[field] <= 0:
      raise ValueError(f"config.json {field}={hf.get(field)!r}: a positive integer is required")
  if hf.get("attention_bias"):
    raise ValueError("config.json attention_bias=true: focaljax has q/k/v biases (Qwen2's) but "
                     "none on o_proj")
  if hf.get("mlp_bias"):
    raise ValueError("config.json mlp_bias=true: focaljax's MLP has no biases")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: our MLP is SwiGLU (silu)")
  return _ARCHS[arch]


def _base_config():
  """configs/base.py's full layout: the file train.py reads (configs/ sits next to focaljax/, so
  the checkout root goes on sys.path)."""
  if not os.path.isfile(os.path.join(_ROOT, "configs", "base.py")):
    raise FileNotFoundError(f"{_ROOT}/configs/base.py not found: run from a focaljax checkout")
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)
  return importlib.import_module("configs.base").get_config()


def hf_config_to_focaljax(hf: dict, tensors=()):
  """A full run ConfigDict (configs/base.py layout) for the HF model config `hf`."""
  arch = _check_hf(hf)
  window, (theta, llama3), c = _window(hf, arch), _rope(hf), _base_config()
  heads = hf["num_attention_heads"]
  tied = hf.get("tie_word_embeddings", "lm_head.weight" not in tensors)
  if not tied and tensors and "lm_head.weight" not in tensors:
    raise ValueError("config.json tie_word_embeddings=false but there is no lm_head.weight")
  c.model.update(dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, d_ff=hf["intermediate_size"],
      tie_embeddings=bool(tied), qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
      qkv_bias=arch == "qwen2", sliding_window=window, rope_theta=theta,
      norm_eps=float(hf.get("rms_norm_eps", 1e-6))))
  if llama3:
    c.model.rope_scaling.update(llama3)
  c.model.attention.pattern = "softmax:rope"
  c.data.seq_len = hf["max_position_embeddings"]
  return c


def hf_to_focaljax(hf_dir: str, out_dir: str, *, replace: bool = False) -> str:
  """Converts an HF checkpoint directory into a focaljax workdir; returns out_dir."""
  _out_dir(out_dir, hf_dir, replace)
  hf = _read_json(os.path.join(hf_dir, "config.json"))
  tensors = safetensors_file.read_dir(hf_dir)
  run_config = hf_config_to_focaljax(hf, tensors)
  run_config.data.tokenizer = str(epath.Path(checkpoint.absolute(out_dir)) /
                                  checkpoint.TOKENIZER_FILE)
  cfg = config_lib.parse(run_config).with_vocab(hf["vocab_size"]).model
  # The exact tree load() restores into, as ShapeDtypeStructs: its keys and shapes are the spec.
  want = traverse_util.flatten_dict(nnx.to_pure_dict(model_lib.abstract_model(cfg)[1]))
  params = {}
  for hf_name, path, n_in in _name_map(cfg.num_layers):
    if path not in want:
      continue
    if hf_name not in tensors:
      raise ValueError(f"{hf_dir}: tensor {hf_name} is missing")
    # pop: the tensor's mapping is released as soon as its converted copy exists.
    src = tensors.pop(hf_name)
    if src.size != np.prod(want[path].shape):
      raise ValueError(f"{hf_dir}: tensor {hf_name} has shape {list(src.shape)}, which config.json "
                       f"makes {list(want[path].shape)} (ours, as [in, heads..., out])")
    params[path] = np.ascontiguousarray(src if n_in is None else src.T).reshape(want[path].shape)
    del src
  if cfg.tie_embeddings:
    tensors.pop("lm_head.weight", None)   # tie_word_embeddings=true: HF ignores a stored one too
  unused = sorted(n for n in tensors if not n.endswith("rotary_emb.inv_freq"))
  if unused:
    raise ValueError(f"{hf_dir}: tensor {unused[0]} (and {len(unused) - 1} more) has no focaljax "
                     "counterpart")
  del tensors
  tok_file, eos = _tokenizer(hf_dir)
  _out_dir(out_dir, hf_dir, replace, create=True)
  checkpoint.write_config(out_dir, run_config)
  # tokenizer_config.json names the eos (LLaMA's "</s>"); focaljax.load's Tokenizer reads it.
  _copy_tokenizer(tok_file, out_dir, eos)
  _save_params(out_dir, checkpoint.to_str_keys(traverse_util.unflatten_dict(params)), {
      "step": 0, "tokens": 0, "converted_from": os.path.abspath(hf_dir),
      "architectures": hf.get("architectures"),
      "dtypes": sorted({str(v.dtype) for v in params.values()})})
  return out_dir


def _save_params(out_dir: str, params: dict, meta: dict):
  """checkpoints/0 with the params and meta items, in the layout checkpoint.restore_params reads.
  Without Orbax's deep copy and compression (each a second copy of the model in memory)."""
  # jax.Array's handler too, though nothing here is one: without it Orbax warns on every save.
  # Orbax releases before deepcopy_host_arrays copy (and accept no such argument).
  numpy_kw = ({"deepcopy_host_arrays": False} if "deepcopy_host_arrays" in
              inspect.signature(ocp.type_handlers.NumpyHandler).parameters else {})
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(**numpy_kw)),
      (jax.Array, ocp.type_handlers.ArrayHandler()))
  manager = ocp.CheckpointManager(
      epath.Path(checkpoint.absolute(out_dir)) / "checkpoints",
      item_handlers={"params": ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                                           use_compression=False),
                     "meta": ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
  manager.save(0, args=ocp.args.Composite(
      params=ocp.args.PyTreeSave(params),
      meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()
