"""A workdir's saved config.json, read in today's fields: the one place that knows older layouts."""

from __future__ import annotations

import json

import ml_collections
from etils import epath

from focaljax.train import checkpoint

# Fields it may lack (written before they existed), with the value such a run had, and fields
# removed since (speed variants and FocusLLM arms that lost), ignored.
_ADDED = {"model.remat_policy": "nothing", "model.attention.checkpoint_rows": 1024,
          "model.qkv_bias": False, "model.sliding_window": 0,
          "model.rope_scaling": dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                     original_max_position_embeddings=0),
          "data.tokenize": "stream", "data.token_cache": "", "data.retrieval_mix": 0.0,
          "data.jsonl_field": "text", "data.tfds_data_dir": "", "data.shards": 0,
          "optim.schedule_steps": 0, "optim.mu_dtype": "float32", "train.micro_batch": 0,
          "train.wandb_project": "", "train.init_from": "", "focus.retrieval_mix": 0.0,
          "focus.memory_tokens": "", "focus.eval_prompt_len": 0, "focus.candidate_path": "adapter"}
_REMOVED = ("optim.grad_accum", "model.fuse_matmuls", "model.norm_backward",
            "model.qk_rope_backward", "model.mlp_backward", "model.add_norm", "train.cross_entropy",
            "model.attention.mask_pieces",
            "focus.candidate_positions", "focus.candidate_bias", "focus.sink",
            "focus.drill_in_window", "focus.answer_weight", "focus.base_attention")


def read(workdir: str) -> ml_collections.ConfigDict:
  """A workdir's config.json as a ConfigDict in today's fields."""
  path = epath.Path(workdir) / checkpoint.CONFIG_FILE
  try:
    saved = json.loads(path.read_text())
  except ValueError as e:   # not JSON, or not UTF-8
    saved = e
  if not isinstance(saved, dict):
    why = saved if isinstance(saved, ValueError) else "not a JSON object"
    raise checkpoint.CorruptCheckpoint(f"{path} is not a run's config ({why}); restore it "
                                       "from a copy, or train in another --workdir")
  return upgrade(saved)


def upgrade(saved: dict) -> ml_collections.ConfigDict:
  """A saved config (config.json's dict) in today's fields."""
  def parent(dotted):
    *path, name = dotted.split(".")
    node = saved
    for part in path:
      node = node.get(part, {})
    return node, name
  for dotted, value in _ADDED.items():
    node, name = parent(dotted)
    if node:   # a section the config has (focus.* only in FocusLLM runs)
      node.setdefault(name, value)
  for dotted in _REMOVED:
    node, name = parent(dotted)
    node.pop(name, None)
  train = saved.get("train", {})
  if train.get("eval_batches", 1) < 1:   # once accepted (it logged val_loss 0.0): the default
    train["eval_batches"] = 4
  attention = saved.get("model", {}).get("attention", {})
  if "pattern" in attention:   # empty entries, accepted before the parser refused them
    attention["pattern"] = ",".join(p for p in attention["pattern"].split(",") if p.strip())
  return ml_collections.ConfigDict(saved)
