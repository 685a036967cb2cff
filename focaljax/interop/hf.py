"""Hugging Face LLaMA-family checkpoints <-> focaljax workdirs.

  python -m focaljax.convert hf-to-focaljax HF_DIR OUT_DIR [--replace]
  python -m focaljax.convert focaljax-to-hf CKPT OUT_DIR [--dtype bfloat16] [--max_shard_gb 5]
                                            [--replace]

hf-to-focaljax reads config.json and model.safetensors (or the shards of
model.safetensors.index.json) of a LlamaForCausalLM, MistralForCausalLM without a sliding window,
or Qwen3ForCausalLM (its per-head q/k RMSNorm is our qk_norm), and writes a workdir for
`focaljax.load`: config.json (configs/base.py's layout; data.seq_len = max_position_embeddings),
the tokenizer files and an Orbax `params` item at checkpoints/0 in the source dtype.

focaljax-to-hf writes config.json (LlamaConfig fields, Qwen3's for qk_norm, plus a "focaljax"
entry recording the pattern), model.safetensors (sharded past --max_shard_gb), the tokenizer files
and a README.md, such that stock `transformers` computes focaljax's logits: a constant focal
temperature t is folded into the weights (q scaled by 1/t turns HF's 1/√d into our 1/(t·√d); in
the q-norm gain under qk_norm, which would undo a q_proj scale), and layers a stock model cannot
compute (dilution, learned τ, no RoPE) are refused. Our NTK scaling past the trained context is
HF's rope "dynamic", factor 1. What cannot be converted stops the command with one line naming
the field, tensor or layer, and exit status 2; so does a non-empty OUT_DIR without --replace.

Layout: HF stores a linear layer [out, in]; ours is [in, out] with heads split out (q_proj
[N·D, E] -> wq [E, N, D], o_proj [E, N·D] -> wo [N, D, E]). Both sides apply rotate-half RoPE
per head, so q/k rows need no permutation. Neither direction needs torch, and both stream one
tensor at a time: the peak is one converted copy of the weights plus one tensor.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import warnings

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tokenizers
from etils import epath
from flax import nnx
from flax import traverse_util

from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax import config as config_lib
from focaljax.interop import safetensors_file
from focaljax.data import tokenizer as tokenizer_lib

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_ARCHS = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
          "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}

# (HF name under model.layers.<i>., our path under blocks.<i>., leading "in" dims of ours).
# n_in = None: copied as is; otherwise ours = hf.T reshaped, hf = ours reshaped to [in, out].T.
_LAYER = (
    ("input_layernorm.weight", "attn_norm.scale", None),
    ("self_attn.q_proj.weight", "attn.wq", 1),
    ("self_attn.k_proj.weight", "attn.wk", 1),
    ("self_attn.v_proj.weight", "attn.wv", 1),
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


def _rope(hf: dict) -> float:
  """rope_theta, accepting transformers 4 (rope_theta/rope_scaling) and 5 (rope_parameters)."""
  params = hf.get("rope_parameters") or {}
  theta = hf.get("rope_theta", params.get("rope_theta", 10000.0))
  scaling = hf.get("rope_scaling") or params
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  field = "rope_scaling" if hf.get("rope_scaling") else "rope_parameters"
  if kind == "dynamic":
    # Ours: θ·(L/T)^(D/(D-2)) past T; HF's dynamic NTK is the same formula when factor == 1.
    if scaling.get("factor", 1.0) != 1.0:
      warnings.warn(f"config.json {field}.factor={scaling['factor']}: focaljax's dynamic NTK "
                    "uses factor 1; logits past max_position_embeddings will differ")
  elif kind not in (None, "default"):
    raise ValueError(f"config.json {field}.rope_type={kind!r}: only 'default' and 'dynamic' "
                     "map onto focaljax's RoPE")
  if hf.get("partial_rotary_factor", 1.0) != 1.0:
    raise ValueError(f"config.json partial_rotary_factor={hf['partial_rotary_factor']}: "
                     "focaljax rotates the whole head dimension")
  return float(theta)


def _check_hf(hf: dict) -> None:
  if not isinstance(hf, dict):
    raise ValueError("config.json is not a JSON object")
  arch = (hf.get("architectures") or ["LlamaForCausalLM"])[0]
  if arch not in _ARCHS:
    raise ValueError(f"config.json architectures={arch!r} is not one of {list(_ARCHS)}")
  for field in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                "num_attention_heads", "max_position_embeddings"):
    if not isinstance(hf.get(field), int) or hf[field] <= 0:
      raise ValueError(f"config.json {field}={hf.get(field)!r}: a positive integer is required")
  for field in ("attention_bias", "mlp_bias"):
    if hf.get(field):
      raise ValueError(f"config.json {field}=true: focaljax layers have no biases")
  if hf.get("hidden_act", "silu") != "silu":
    raise ValueError(f"config.json hidden_act={hf['hidden_act']!r}: our MLP is SwiGLU (silu)")
  # Mistral's window is on unless sliding_window is null; Qwen's only with use_sliding_window.
  window = hf.get("sliding_window") if hf.get("use_sliding_window") is not False else None
  if window and "sliding_attention" in (hf.get("layer_types") or ["sliding_attention"]):
    raise ValueError(f"config.json sliding_window={window}: focaljax attends to the full prefix "
                     "and has no sliding window, so logits past the window would differ")


def _base_config():
  """configs/base.py's full layout: the file train.py reads (configs/ is not a package import
  of focaljax, so it is loaded by path, as config files are)."""
  path = os.path.join(_ROOT, "configs", "base.py")
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found: run from a focaljax checkout")
  if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)   # base.py imports configs.sizes
  spec = importlib.util.spec_from_file_location("focaljax_base_config", path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def hf_config_to_focaljax(hf: dict, tensors=()):
  """A full run ConfigDict (configs/base.py layout) for the HF model config `hf`."""
  _check_hf(hf)
  c = _base_config()
  heads = hf["num_attention_heads"]
  tied = hf.get("tie_word_embeddings", "lm_head.weight" not in tensors)
  if not tied and tensors and "lm_head.weight" not in tensors:
    raise ValueError("config.json tie_word_embeddings=false but there is no lm_head.weight")
  c.model.update(dict(
      vocab_size=hf["vocab_size"], d_model=hf["hidden_size"], num_layers=hf["num_hidden_layers"],
      num_heads=heads, num_kv_heads=hf.get("num_key_value_heads") or heads,
      head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, d_ff=hf["intermediate_size"],
      tie_embeddings=bool(tied), qk_norm="model.layers.0.self_attn.q_norm.weight" in tensors,
      rope_theta=_rope(hf), norm_eps=float(hf.get("rms_norm_eps", 1e-6))))
  c.model.attention.pattern = "softmax:rope"
  c.data.seq_len = hf["max_position_embeddings"]
  return c


def _tokenizer_file(workdir: str, run: config_lib.Config) -> str:
  path = os.path.join(workdir, checkpoint.TOKENIZER_FILE)
  if not os.path.isfile(path) and run.data.tokenizer == "bundled":
    return str(tokenizer_lib.BUNDLED_FILE)
  return path


def _eos(src_dir: str) -> str:
  """The eos named by HF's tokenizer_config.json (LLaMA's "</s>"), else focaljax's."""
  path = os.path.join(src_dir, "tokenizer_config.json")
  eos = _read_json(path).get("eos_token") if os.path.isfile(path) else None
  return (eos.get("content") if isinstance(eos, dict) else eos) or tokenizer_lib.EOS_TOKEN


def _copy_tokenizer(src: str, out_dir: str, eos: str):
  if not os.path.isfile(src):
    raise FileNotFoundError(f"{src} not found: a fast tokenizer (tokenizer.json) is required")
  shutil.copyfile(src, os.path.join(out_dir, checkpoint.TOKENIZER_FILE))
  # HF's own file for naming the eos; a LLaMA tokenizer's is "</s>", not <|endoftext|>.
  with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
    json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos}, f, indent=2)


def _read_json(path: str):
  if not os.path.isfile(path):
    raise FileNotFoundError(f"{path} not found")
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise ValueError(f"{path} is not valid JSON: {e}") from None


def _out_dir(out_dir: str, source: str, replace: bool, *, clear: bool = False) -> None:
  """Refuses a non-empty out_dir unless `replace`; `clear` then empties it (once the input has
  been checked, so a refused conversion deletes nothing). Never the source's own directory."""
  if os.path.exists(out_dir) and not os.path.isdir(out_dir):
    raise ValueError(f"{out_dir} exists and is not a directory")
  if not os.path.isdir(out_dir) or not os.listdir(out_dir):
    return
  if not replace:
    raise ValueError(f"{out_dir} exists and is not empty: pass --replace to overwrite it")
  out, src = os.path.realpath(out_dir), os.path.realpath(source)
  if src == out or src.startswith(out + os.sep):
    raise ValueError(f"{out_dir} holds the source {source}: choose another output directory")
  if clear:
    shutil.rmtree(out_dir)


def hf_to_focaljax(hf_dir: str, out_dir: str, *, replace: bool = False) -> str:
  """Converts an HF checkpoint directory into a focaljax workdir; returns out_dir."""
  _out_dir(out_dir, hf_dir, replace)
  hf = _read_json(os.path.join(hf_dir, "config.json"))
  _check_hf(hf)
  tensors = safetensors_file.read_dir(hf_dir)
  biases = [n for n in tensors if n.endswith(".bias")]
  if biases:
    raise ValueError(f"tensor {biases[0]} (and {len(biases) - 1} more): focaljax's linear layers "
                     "have no biases, so checkpoints with biases (e.g. Qwen2) are not supported")
  run_config = hf_config_to_focaljax(hf, tensors)
  run_config.data.tokenizer = os.path.abspath(os.path.join(out_dir, checkpoint.TOKENIZER_FILE))
  cfg = config_lib.parse(run_config).with_vocab(hf["vocab_size"]).model
  # The exact tree load() restores into, as ShapeDtypeStructs: its keys and shapes are the spec.
  want = traverse_util.flatten_dict(nnx.to_pure_dict(model_lib.abstract_model(cfg)[1]))
  params, used = {}, set()
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
    used.add(hf_name)
  if cfg.tie_embeddings:
    used.add("lm_head.weight")   # tie_word_embeddings=true: HF ignores a stored lm_head too
  unused = sorted(n for n in set(tensors) - used if not n.endswith("rotary_emb.inv_freq"))
  if unused:
    raise ValueError(f"{hf_dir}: tensor {unused[0]} (and {len(unused) - 1} more) has no focaljax "
                     "counterpart")
  del tensors
  tok_file, eos = os.path.join(hf_dir, checkpoint.TOKENIZER_FILE), _eos(hf_dir)
  if not os.path.isfile(tok_file):
    raise FileNotFoundError(f"{tok_file} not found: a fast tokenizer (tokenizer.json) is required")
  _out_dir(out_dir, hf_dir, replace, clear=True)
  os.makedirs(out_dir, exist_ok=True)
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
  registry = ocp.type_handlers.create_type_handler_registry(
      (np.ndarray, ocp.type_handlers.NumpyHandler(deepcopy_host_arrays=False)))
  manager = ocp.CheckpointManager(
      epath.Path(out_dir).absolute() / "checkpoints",
      item_handlers={"params": ocp.PyTreeCheckpointHandler(type_handler_registry=registry,
                                                           use_compression=False),
                     "meta": ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False))
  manager.save(0, args=ocp.args.Composite(
      params=ocp.args.PyTreeSave(params),
      meta=ocp.args.JsonSave(meta)))
  manager.wait_until_finished()
  manager.close()


def _param_reader(workdir: str, step: int | None):
  """(step, {key path: metadata}, read(keys) -> np.ndarray): one stored tensor per read, in its
  stored dtype (no device copy, no float32 cast), so an export holds one tensor at a time."""
  manager = ocp.CheckpointManager(epath.Path(workdir) / "checkpoints",
                                  item_names=checkpoint.ITEMS)
  step = manager.latest_step() if step is None else step
  manager.close()
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  path = epath.Path(workdir) / "checkpoints" / str(step) / "params"
  ckpt = ocp.PyTreeCheckpointer()
  flat = traverse_util.flatten_dict(ckpt.metadata(path).item_metadata.tree)

  def read(keys):
    item, args = flat[keys], ocp.RestoreArgs(restore_type=np.ndarray)
    for k in reversed(keys):
      item, args = {k: item}, {k: args}
    out = ckpt.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                         partial_restore=True))
    return traverse_util.flatten_dict(out)[keys]
  return step, flat, read


def _q_scales(cfg) -> list[float]:
  """Per layer, the factor on q that makes HF's 1/√d scores ours: 1 for softmax, 1/t for a
  constant focal temperature. A layer a stock softmax + RoPE model cannot compute is refused."""
  a, scales = cfg.attention, []
  for i, spec in enumerate(a.layers):
    name, why = f"{spec.variant.value}:{spec.position.value}", None
    if attn_lib.FAMILY[spec.variant].demand:
      why = "dilution attention is not softmax attention"
    elif attn_lib.uses_learned_tau(a, spec):
      why = "its learned τ (model.attention.learned=true) depends on the input"
    elif spec.position is not attn_lib.Position.ROPE:
      why = "it has no RoPE, which transformers applies in every layer"
    if why:
      raise ValueError(f"layer {i} ({name}) cannot be exported: {why}, and stock transformers "
                       "has no equivalent")
    scales.append(float(attn_lib.FAMILY[spec.variant].scale(a, cfg.head_dim, None)
                        * cfg.head_dim**0.5))
  return scales


def _focaljax_entry(cfg, q_scales) -> dict:
  """The pattern (the shortest that parse_pattern cycles into the layers) and the folded t."""
  names = [f"{s.variant.value}:{s.position.value}" for s in cfg.attention.layers]
  period = next(p for p in range(1, len(names) + 1)
                if all(n == names[i % p] for i, n in enumerate(names)))
  folded = [i for i, f in enumerate(q_scales) if f != 1.0]
  return {"pattern": ",".join(names[:period]),
          **({"temperature": cfg.attention.temperature, "folded_layers": folded,
              "folded_into": _FOLD_INTO[cfg.qk_norm]} if folded else {})}


# Where 1/t goes: q_proj, or the q-norm gain under qk_norm (the norm would undo a q_proj scale).
_FOLD_INTO = {False: "self_attn.q_proj.weight", True: "self_attn.q_norm.weight"}


def focaljax_hf_config(cfg, eos_id: int | None, dtype: str, q_scales) -> dict:
  """LlamaConfig fields (Qwen3's for qk_norm: its per-head q/k RMSNorm is ours)."""
  arch = "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"
  return {
      "architectures": [arch], "model_type": _ARCHS[arch], "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta,
      # focaljax NTK-scales θ past the trained context: HF's "dynamic" with factor 1 is the same.
      "rope_scaling": {"rope_type": "dynamic", "factor": 1.0},
      "tie_word_embeddings": cfg.tie_embeddings, "attention_bias": False, "mlp_bias": False,
      "bos_token_id": None, "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype,
      "focaljax": _focaljax_entry(cfg, q_scales),
  }


def _readme(fj: dict, source: str) -> str:
  return (f"# Exported from focaljax ({source})\n\nAttention pattern `{fj['pattern']}`. Stock "
          "`transformers` computes focaljax's logits from these weights.\n" +
          (f"\nThe focal temperature t={fj['temperature']} of layers {fj['folded_layers']} is "
           f"folded into `{fj['folded_into']}` (scaled by 1/t).\n"
           if "folded_layers" in fj else ""))


def focaljax_to_hf(path: str, out_dir: str, *, dtype: str | None = None,
                   max_shard_gb: float = 5.0, replace: bool = False) -> str:
  """Exports a focaljax workdir (latest step) or checkpoints/<step> dir as an HF directory."""
  workdir, step = checkpoint.resolve(path)
  _out_dir(out_dir, workdir, replace)
  run = config_lib.parse(config_lib.read_run_config(workdir))
  q_scales = _q_scales(run.model)
  tok_file, eos = _tokenizer_file(workdir, run), _eos(workdir)
  # The raw HF tokenizer: its eos may be "</s>", which focaljax's Tokenizer does not require here.
  hf_tok = tokenizers.Tokenizer.from_file(tok_file)
  cfg = run.with_vocab(hf_tok.get_vocab_size(with_added_tokens=True)).model
  step, tree, read = _param_reader(workdir, step)
  stored = {str(meta.dtype) for meta in tree.values()}
  dtype = dtype or (stored.pop() if len(stored) == 1 else "float32")
  if dtype not in _EXPORT_DTYPES:
    raise ValueError(f"--dtype {dtype!r} is not one of {list(_EXPORT_DTYPES)}")
  out_dtype = np.dtype(_EXPORT_DTYPES[dtype])
  specs, exported = [], set()
  for hf_name, our_path, n_in in _name_map(cfg.num_layers):
    keys = tuple(map(str, our_path))
    if keys not in tree:
      continue
    shape = tuple(tree[keys].shape)
    hf_shape = shape if n_in is None else (int(np.prod(shape[n_in:])), int(np.prod(shape[:n_in])))
    # Read when written (default arguments bind this tensor's keys); HF's [out, in] is a transpose.
    make = ((lambda k=keys: read(k)) if n_in is None else
            (lambda k=keys, s=hf_shape: read(k).reshape(s[::-1]).T))
    factor = q_scales[our_path[1]] if hf_name.endswith(_FOLD_INTO[cfg.qk_norm]) else 1.0
    if factor != 1.0:
      make = lambda m=make, f=factor: m().astype(np.float32) * np.float32(f)
    specs.append((hf_name, hf_shape, out_dtype, make))
    exported.add(keys)
  missed = sorted(set(tree) - exported)
  if missed:
    raise ValueError(f"checkpoint param {'.'.join(missed[0])} has no Hugging Face counterpart")
  _out_dir(out_dir, workdir, replace, clear=True)
  os.makedirs(out_dir, exist_ok=True)
  safetensors_file.write_dir(out_dir, specs, int(max_shard_gb * 2**30))
  hf_config = focaljax_hf_config(cfg, hf_tok.token_to_id(eos), str(out_dtype), q_scales)
  with open(os.path.join(out_dir, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
  _copy_tokenizer(tok_file, out_dir, eos)
  with open(os.path.join(out_dir, "README.md"), "w") as f:
    f.write(_readme(hf_config["focaljax"], f"{workdir} step {step}"))
  return out_dir
