"""focaljax -> HF (`python -m focaljax.convert focaljax-to-hf CKPT OUT_DIR`).

Writes config.json, model.safetensors (sharded past --max_shard_gb), the tokenizer files and a
README.md. A model whose every layer is softmax or constant-temperature focal attention with RoPE
exports as a stock class: LLaMA, or Qwen3 with qk_norm, Qwen2 with q/k/v biases, Mistral with a
sliding window (one of the three at most). The temperature t is folded into the weights (q scaled
by 1/t turns HF's 1/√d into our 1/(t·√d); into the q-norm gain under qk_norm, which would undo a
q_proj scale), and our NTK scaling past the trained context is HF's rope "dynamic", factor 1
(Llama 3's rope bands replace it). Any other model (learned τ, dilution, layers without RoPE,
mixes) exports with its own modeling code, `modeling_focaljax.py` (focaljax/interop/
hf_modeling.py) and `configuration_focaljax.py`, named in config.json's auto_map: load it with
`AutoModelForCausalLM.from_pretrained(OUT_DIR, trust_remote_code=True)`. Either way config.json's
"focaljax" entry records the pattern. A layer neither can compute is refused, naming it.
"""

from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tokenizers
from etils import epath
from flax import nnx, traverse_util

from focaljax import config as config_lib
from focaljax.interop import safetensors_file
from focaljax.interop.hf import _ARCHS, _copy_tokenizer, _name_map, _out_dir, _tokenizer
from focaljax.model import attention as attn_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import saved_config

_EXPORT_DTYPES = {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def _param_reader(workdir: str, step: int | None):
  """(step, {key path: metadata}, read(keys) -> np.ndarray): one stored tensor per read, in its
  stored dtype (no device copy, no float32 cast), so an export holds one tensor at a time.
  CorruptCheckpoint if any array differs from the checksums training recorded."""
  step = checkpoint.latest_step(workdir) if step is None else step
  if step is None:
    raise FileNotFoundError(f"no checkpoint under {workdir}/checkpoints")
  path = epath.Path(workdir) / "checkpoints" / str(step) / "params"
  # The item's handler, not a Checkpointer: that looks for a step's metadata in the item's
  # directory and logs a warning when it is (rightly) not there.
  ckpt = ocp.PyTreeCheckpointHandler()
  flat = traverse_util.flatten_dict(ckpt.metadata(path).tree)

  def read(keys):
    item, args = flat[keys], ocp.RestoreArgs(restore_type=np.ndarray)
    for k in reversed(keys):
      item, args = {k: item}, {k: args}
    out = ckpt.restore(path, args=ocp.args.PyTreeRestore(item=item, restore_args=args,
                                                         partial_restore=True))
    return traverse_util.flatten_dict(out)[keys]

  # Every array against training's checksums before anything is written (one at a time).
  want, where = checkpoint.param_checksums(workdir, step), f"{workdir}/checkpoints/{step}"
  for keys in flat if want else ():
    checkpoint.verify_param(want, keys, read(keys), where)
  return step, flat, read


def _layer_plan(cfg) -> dict:
  """Per layer: RoPE or not, dilution or not, learned τ or not, and the constant score scale
  (1/√d, or 1/(t·√d) for focal; unused under learned τ). A layer neither export can compute is
  refused."""
  a = cfg.attention
  plan = {"layer_rope": [], "layer_dilution": [], "layer_learned_tau": [], "layer_scale": []}
  for i, spec in enumerate(a.layers):
    learned = attn_lib.uses_learned_tau(a, spec)
    if learned and a.tau_mean is attn_lib.TauMean.SEQUENCE:
      raise ValueError(f"layer {i} ({spec.variant.value}:{spec.position.value}) cannot be "
                       "exported: model.attention.tau_mean='sequence' averages τ over the whole "
                       "document, future tokens included, which cached generation cannot see "
                       "(tau_mean causal or token export)")
    plan["layer_rope"].append(spec.position is attn_lib.Position.ROPE)
    plan["layer_dilution"].append(attn_lib.FAMILY[spec.variant].demand)
    plan["layer_learned_tau"].append(learned)
    plan["layer_scale"].append(
        cfg.head_dim**-0.5 if learned
        else float(attn_lib.FAMILY[spec.variant].scale(a, cfg.head_dim, None)))
  return plan


# (qk_norm, q/k/v biases, sliding window) -> the stock class whose layers are ours.
_STOCK = {(False, False, False): "LlamaForCausalLM", (True, False, False): "Qwen3ForCausalLM",
          (False, True, False): "Qwen2ForCausalLM", (False, False, True): "MistralForCausalLM"}


def _stock_arch(cfg, plan) -> str | None:
  """The stock transformers class that computes the model, or None: every layer softmax (any
  constant scale) with RoPE, and at most one of QK-norm, q/k/v biases and a sliding window."""
  if (not all(plan["layer_rope"]) or any(plan["layer_dilution"])
      or any(plan["layer_learned_tau"])
      or cfg.attention.sliding_window == 1):   # transformers' window cache keeps every key at 1
    return None
  return _STOCK.get((cfg.qk_norm, cfg.qkv_bias, bool(cfg.attention.sliding_window)))


def _q_scales(cfg, plan) -> list[float]:
  """Per layer, the factor on q that makes HF's 1/√d scores ours (stock export only): 1 for
  softmax, 1/t for a constant focal temperature."""
  if _stock_arch(cfg, plan) is None:
    return [1.0] * cfg.num_layers
  factors = [s * cfg.head_dim**0.5 for s in plan["layer_scale"]]
  # 1/√d·√d can round off 1: softmax layers must stay bit for bit.
  return [1.0 if abs(f - 1.0) < 1e-12 else f for f in factors]


def _focaljax_entry(cfg, q_scales) -> dict:
  """The pattern (the shortest that parse_pattern cycles into the layers) and the folded t."""
  names = [f"{s.variant.value}:{s.position.value}" for s in cfg.attention.layers]
  period = next(p for p in range(1, len(names) + 1)
                if all(n == names[i % p] for i, n in enumerate(names)))
  folded = [i for i, f in enumerate(q_scales) if f != 1.0]
  return {"pattern": ",".join(names[:period]),
          **({"temperature": cfg.attention.temperature, "folded_layers": folded,
              "folded_into": ", ".join(_fold_into(cfg))} if folded else {})}


def _fold_into(cfg) -> tuple[str, ...]:
  """Where 1/t goes: q_proj (and its bias), or the q-norm gain under qk_norm (the norm would
  undo a q_proj scale)."""
  if cfg.qk_norm:
    return ("self_attn.q_norm.weight",)
  return ("self_attn.q_proj.weight",) + (("self_attn.q_proj.bias",) if cfg.qkv_bias else ())

# The custom export's modeling code (copied) and its configuration module (re-exports the config).
_MODELING_SRC = epath.Path(__file__).parent / "hf_modeling.py"
_CONFIGURATION_PY = ('"""FocaljaxConfig, defined next to the model in modeling_focaljax.py."""\n\n'
                     "from .modeling_focaljax import FocaljaxConfig  # noqa: F401\n")
_AUTO_MAP = {"AutoConfig": "configuration_focaljax.FocaljaxConfig",
             "AutoModelForCausalLM": "modeling_focaljax.FocaljaxForCausalLM"}


def focaljax_hf_config(cfg, eos_id: int | None, dtype: str, q_scales, plan) -> dict:
  """config.json: the fields of _stock_arch's class, or where none computes the model those of
  FocaljaxConfig (hf_modeling.py): the same shape fields plus the per-layer plan."""
  shape = {
      "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model, "intermediate_size": cfg.d_ff,
      "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
      "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
      "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps,
      "rope_theta": cfg.rope_theta, "tie_word_embeddings": cfg.tie_embeddings,
      "eos_token_id": eos_id, "torch_dtype": dtype, "dtype": dtype,
  }
  fj, a = _focaljax_entry(cfg, q_scales), cfg.attention
  llama3 = dataclasses.asdict(cfg.rope_scaling) if cfg.rope_scaling else None
  arch = _stock_arch(cfg, plan)
  if arch is None:
    return {"architectures": ["FocaljaxForCausalLM"], "model_type": "focaljax",
            "auto_map": _AUTO_MAP, **shape, "qk_norm": cfg.qk_norm, "qkv_bias": cfg.qkv_bias,
            "sliding_window": a.sliding_window, "rope_llama3": llama3, **plan,
            "tau_min": a.tau_min, "tau_max": a.tau_max, "tau_init": a.tau_init,
            "tau_per_token": a.tau_mean is attn_lib.TauMean.TOKEN, "dilution_eps": a.eps,
            "focaljax": fj}
  # Past the trained context focaljax NTK-scales θ: HF's "dynamic" with factor 1 is the same.
  # Llama 3's bands replace it (focaljax applies both past max_position_embeddings).
  rope = {"rope_type": "llama3", **llama3} if llama3 else {"rope_type": "dynamic", "factor": 1.0}
  extra = ({"use_sliding_window": False, "sliding_window": None} if cfg.qkv_bias else
           {"sliding_window": a.sliding_window, "attention_bias": False, "mlp_bias": False})
  return {"architectures": [arch], "model_type": _ARCHS[arch], **shape, "hidden_act": "silu",
          "rope_scaling": rope, **extra, "bos_token_id": None, "focaljax": fj}


def _readme(hf_config: dict, source: str) -> str:
  fj = hf_config["focaljax"]
  text = f"# Exported from focaljax ({source})\n\nAttention pattern `{fj['pattern']}`. "
  if "auto_map" in hf_config:
    return text + (
        "Stock `transformers` has no layer that computes it: the model is "
        "`modeling_focaljax.py`, shipped here.\n\n```python\nmodel = transformers."
        "AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)\n```\n")
  return (text + "Stock `transformers` computes focaljax's logits from these weights.\n" +
          (f"\nThe focal temperature t={fj['temperature']} of layers {fj['folded_layers']} is "
           f"folded into `{fj['folded_into']}` (scaled by 1/t).\n"
           if "folded_layers" in fj else ""))


def focaljax_to_hf(path: str, out_dir: str, *, dtype: str | None = None,
                   max_shard_gb: float = 5.0, replace: bool = False) -> str:
  """Exports a focaljax workdir (latest step) or checkpoints/<step> dir as an HF directory."""
  workdir, step = checkpoint.resolve(path)
  saved = saved_config.read(workdir)
  if "focus" in saved:   # as focaljax.load says it: its params are an adapter, not a model
    raise ValueError(f"{workdir} is a FocusLLM adapter run, not a language model; export its "
                     f"base (focus.base_workdir {saved.focus.get('base_workdir', '?')}) instead")
  _out_dir(out_dir, workdir, replace)
  run = config_lib.parse(saved)
  plan = _layer_plan(run.model)
  q_scales = _q_scales(run.model, plan)
  tok_file, eos = _tokenizer(workdir, bundled=run.data.tokenizer == "bundled")
  # The raw HF tokenizer: its eos may be "</s>", which focaljax's Tokenizer does not require here.
  hf_tok = tokenizers.Tokenizer.from_file(tok_file)
  cfg = run.with_vocab(hf_tok.get_vocab_size(with_added_tokens=True)).model
  step, tree, read = _param_reader(workdir, step)
  # The params a model of cfg has (abstract: nothing is allocated).
  state = model_lib.abstract_model(cfg)[1]
  want = {tuple(map(str, k)) for k in traverse_util.flatten_dict(nnx.to_pure_dict(state))}
  missing = sorted(want - set(tree))
  if missing:
    raise ValueError(f"checkpoint has no param {'.'.join(missing[0])}, which the model its "
                     "config.json describes needs")
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
    if hf_name.endswith(".bias"):   # our [N, D] is HF's [N·D]
      hf_shape = (int(np.prod(shape)),)
    make = ((lambda k=keys, s=hf_shape: read(k).reshape(s)) if n_in is None else
            (lambda k=keys, s=hf_shape: read(k).reshape(s[::-1]).T))
    factor = q_scales[our_path[1]] if hf_name.endswith(_fold_into(cfg)) else 1.0
    if factor != 1.0:
      make = lambda m=make, f=factor: m().astype(np.float32) * np.float32(f)
    specs.append((hf_name, hf_shape, out_dtype, make))
    exported.add(keys)
  missed = sorted(set(tree) - exported)
  if missed:
    raise ValueError(f"checkpoint param {'.'.join(missed[0])} has no Hugging Face counterpart")
  out = _out_dir(out_dir, workdir, replace, create=True)
  safetensors_file.write_dir(out_dir, specs, int(max_shard_gb * 2**30))
  hf_config = focaljax_hf_config(cfg, hf_tok.token_to_id(eos), str(out_dtype), q_scales, plan)
  (out / "config.json").write_text(json.dumps(hf_config, indent=2))
  if "auto_map" in hf_config:
    _MODELING_SRC.copy(out / "modeling_focaljax.py", overwrite=True)
    (out / "configuration_focaljax.py").write_text(_CONFIGURATION_PY)
  _copy_tokenizer(tok_file, out_dir, eos)
  (out / "README.md").write_text(_readme(hf_config, f"{workdir} step {step}"))
  return out_dir
