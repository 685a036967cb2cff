"""focaljax -> HF (`python -m focaljax.convert focaljax-to-hf CKPT OUT_DIR`).

Writes config.json (LlamaConfig fields, Qwen3's for qk_norm, plus a "focaljax" entry recording
the pattern), model.safetensors (sharded past --max_shard_gb), the tokenizer files and a
README.md, such that stock `transformers` computes focaljax's logits: a constant focal
temperature t is folded into the weights (q scaled by 1/t turns HF's 1/√d into our 1/(t·√d); in
the q-norm gain under qk_norm, which would undo a q_proj scale), and layers a stock model cannot
compute (dilution, learned τ, no RoPE) are refused. Our NTK scaling past the trained context is
HF's rope "dynamic", factor 1.
"""

from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tokenizers
from etils import epath
from flax import traverse_util

from focaljax import config as config_lib
from focaljax.interop import safetensors_file
from focaljax.interop.hf import (_ARCHS, _copy_tokenizer, _eos, _name_map, _out_dir,
                                 _tokenizer_file)
from focaljax.model import attention as attn_lib
from focaljax.train import checkpoint

_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


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
