"""The language model's training task: a focaljax Transformer on packed text (train/loop.py runs it).

State is (params, opt_state): pure dicts of float32 arrays, sharded by the logical-axis rules;
compute runs in train.compute_dtype. The batches come from the Grain pipeline, whose iterator is
checkpointed with the state; validation loss every train.eval_every steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time

import jax
import jax.numpy as jnp
from etils import epath
from flax import nnx

from focaljax import config as config_lib
from focaljax import sharding
from focaljax.data import pipeline as data_lib
from focaljax.data import sources
from focaljax.data import tokenizer as tokenizer_lib
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.train import loop
from focaljax.train import loss as loss_lib
from focaljax.train import metrics
from focaljax.train import optim
from focaljax.train import saved_config
from focaljax.train import workdir as workdir_lib


def loss(params, frozen, batch, *, graphdef, dtype):
  """(Σ weight·nll, (Σ weight, {})) over a batch, float32 (loop.LossFn)."""
  del frozen
  model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
  logits_BTV = model(batch["inputs"], positions_BT=batch["positions"],
                     segment_ids_BT=batch.get("segment_ids"), dtype=dtype)
  with jax.named_scope("loss"):
    nll_BT = loss_lib.nll(logits_BTV, batch["targets"])
  w_BT = batch["weights"].astype(jnp.float32)
  return (nll_BT * w_BT).sum(), (w_BT.sum(), {})


def train_step(params, opt_state, batch, *, graphdef, tx, cfg: loop.StepConfig):
  """The language model's optimizer step, as train.py runs it (bench/train_step.py times it)."""
  return loop.step(params, opt_state, None, batch, tx=tx, cfg=cfg, loss_fn=functools.partial(
      loss, graphdef=graphdef, dtype=cfg.compute_dtype))


def init_params(model_cfg, key, param_sh) -> dict:
  """The Transformer's parameters (nnx.to_pure_dict's layout, sharded by `param_sh`), made by one
  small jit per distinct layer spec, run once per block, and one for the embedding, final norm and
  head. One jit over the whole model compiles in time that grows with its depth (over a minute
  at 1.3B on a GPU) to run for milliseconds. The key is an argument: a jit with no inputs lets XLA
  constant-fold the RNG. Block i draws from fold_in(key, i)."""
  def pure(make):
    return lambda k: nnx.to_pure_dict(nnx.split(make(nnx.Rngs(params=k)))[1])
  layers = model_cfg.attention.layers
  outer = dataclasses.replace(model_cfg, attention=dataclasses.replace(model_cfg.attention,
                                                                       layers=()))
  params = jax.jit(pure(lambda r: model_lib.Transformer(outer, r)), out_shardings={
      k: v for k, v in param_sh.items() if k != "blocks"})(jax.random.fold_in(key, len(layers)))
  block_fns = {}
  params["blocks"] = {}
  for i, spec in enumerate(layers):
    if spec not in block_fns:
      block_fns[spec] = jax.jit(pure(lambda r, spec=spec: model_lib.Block(model_cfg, spec, r)),
                                out_shardings=param_sh["blocks"][i])
    params["blocks"][i] = block_fns[spec](jax.random.fold_in(key, i))
  return params


def init_state(model_cfg, tx, param_sh, mesh, key, *, abstract: bool = False):
  """(params, opt_state, opt_shardings): params by init_params, the optimizer state by a jit with
  the moments' shardings (they never pass through the host or a replicated layout). `abstract`:
  their ShapeDtypeStructs, sharded, allocating nothing (a dry run)."""
  abstract_params = jax.eval_shape(lambda k: init_params(model_cfg, k, param_sh), key)
  with jax.set_mesh(mesh):
    opt_sh = sharding.opt_state_shardings(tx, abstract_params, param_sh, mesh)
    if abstract:
      with_sh = lambda tree, sh: jax.tree.map(   # noqa: E731
          lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sh)
      return (with_sh(abstract_params, param_sh),
              with_sh(jax.eval_shape(tx.init, abstract_params), opt_sh), opt_sh)
    params = init_params(model_cfg, key, param_sh)
    opt_state = jax.jit(tx.init, out_shardings=opt_sh)(params)
  return params, opt_state, opt_sh


def check_source(cfg: config_lib.Config) -> str:
  """The workdir of a fresh fine-tune's train.init_from, checked: a language model's, holding a
  checkpoint of this config's parameter shapes (the pattern may change: its variants share them)."""
  source = config_lib.checkpointed(cfg.train.init_from, "train.init_from")[0]
  saved = saved_config.read(source)
  if "focus" in saved:
    raise config_lib.ConfigError(f"config field train.init_from: {source} is a FocusLLM adapter "
                                 "run; fine-tune its base")
  fields = [f for f in workdir_lib.SHAPE_FIELDS if f != "model.attention.pattern"]
  if diff := workdir_lib.differences(saved.to_dict(), json.loads(cfg.config_json), fields):
    raise config_lib.ConfigError(
        f"config field train.init_from: {source}'s parameters have other shapes: "
        f"{', '.join(diff)}; keep its model fields (configs/finetune.py takes them)")
  return source


def restore_from(path: str, abstract_params) -> dict:
  """train.init_from's params (a workdir's latest or a checkpoints/<step>) into `abstract_params`
  (sharded ShapeDtypeStructs, float32): ConfigError when they are another model's."""
  try:
    return checkpoint.restore_params(*checkpoint.resolve(path), abstract_params)[0]
  except checkpoint.CorruptCheckpoint as e:
    raise config_lib.ConfigError(
        f"config field train.init_from: {str(e).split('; evaluate')[0]}") from None


def task(cfg: config_lib.Config, workdir: str, mesh, *, abstract: bool = False) -> loop.Task:
  """The loop.Task of a language-model run: tokenizer, params, data, validation. `abstract`: the
  params and optimizer state as sharded ShapeDtypeStructs (a dry run allocates nothing)."""
  # A fresh fine-tune reads train.init_from; a resume, its own checkpoints alone.
  resuming = checkpoint.latest_step(workdir) is not None
  source = cfg.train.init_from and not resuming and epath.Path(check_source(cfg))
  # Bad data (no text, an empty split, malformed files) stops here, before anything compiles
  # or is written: sources.DataError, one line naming the file or source.
  shards = cfg.data_shards or jax.process_count()   # each reads its own documents
  for split in ("train", "valid") if cfg.train.eval_every else ("train",):
    if (n := len(data_lib.documents(cfg.data, split))) < shards:
      raise sources.DataError(f"the {split} split of data.source={cfg.data.source!r} has {n} "
                              f"documents, fewer than the {shards} data shards (data.shards)")
  tokenizer = data_lib.load_tokenizer(cfg.data, workdir, save=not abstract)
  own = epath.Path(workdir) / tokenizer_lib.FILENAME   # the one the checkpoints trained with
  if resuming and own.exists() and not tokenizer.same_as(workdir):
    raise config_lib.ConfigError(
        f"config field data.tokenizer: {cfg.data.tokenizer!r} is not the tokenizer {workdir}'s "
        f"checkpoints trained with ({own}); resume with that file, or train in another --workdir")
  if source and (source / tokenizer_lib.FILENAME).exists() and not tokenizer.same_as(source):
    raise config_lib.ConfigError(
        f"config field data.tokenizer: {cfg.data.tokenizer!r} is not the tokenizer the params of "
        f"train.init_from trained with: set it to {source / tokenizer_lib.FILENAME}")
  cfg = cfg.with_vocab(tokenizer.vocab_size)
  graphdef, abstract_state = model_lib.abstract_model(cfg.model)
  try:
    param_sh = sharding.param_shardings(abstract_state, mesh)
  except ValueError as e:   # a mesh axis (-1 resolved too) that does not divide a weight
    raise config_lib.ConfigError(f"config field mesh: {e}") from None
  if distributed.is_primary() and not abstract:   # a dry run writes nothing
    tokenizer.save(workdir)
  batch_sh = sharding.batch_sharding(mesh)
  tx = optim.make(cfg.optim, nnx.to_pure_dict(abstract_state))
  dtype = jnp.dtype(cfg.train.compute_dtype)
  key = jax.random.key(cfg.seed)
  params, opt_state, opt_sh = init_state(cfg.model, tx, param_sh, mesh, key, abstract=True)
  seconds = {}

  def init():
    t0 = time.perf_counter()
    if cfg.train.init_from:   # fine-tuning: another run's params, a fresh optimizer state
      p = restore_from(cfg.train.init_from, params)
      with jax.set_mesh(mesh):
        state = jax.block_until_ready((p, jax.jit(tx.init, out_shardings=opt_sh)(p)))
    else:
      state = jax.block_until_ready(init_state(cfg.model, tx, param_sh, mesh, key)[:2])
    seconds["init"] = time.perf_counter() - t0
    return state

  pidx, pcount = jax.process_index(), jax.process_count()
  t_data = time.perf_counter()
  train_iter = data_lib.make_iterator(cfg.data, tokenizer, split="train", process_index=pidx,
                                      process_count=pcount, num_shards=cfg.data_shards or None)
  seconds["data"] = time.perf_counter() - t_data
  tokens = cfg.data.global_batch * cfg.data.seq_len
  loss_fn = functools.partial(loss, graphdef=graphdef, dtype=dtype)

  def eval_loss(params, batch):
    l_sum, (w_sum, _) = loss_fn(params, None, batch)
    return l_sum, w_sum

  with jax.set_mesh(mesh):
    eval_fn = jax.jit(eval_loss, in_shardings=(param_sh, batch_sh), out_shardings=(
        jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())))

  def batches(start):
    del start   # the restored iterator goes on where the checkpoint left it
    while True:
      yield loop.Batch(next(train_iter), tokens=tokens)

  def abstract_batches():   # data/pipeline.py's batch, without reading one
    shape = (cfg.data.global_batch, cfg.data.seq_len)
    return {None: {name: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sh) for name, dtype in
                   (("inputs", jnp.int32), ("targets", jnp.int32), ("segment_ids", jnp.int32),
                    ("positions", jnp.int32), ("weights", jnp.float32))}}

  def evaluate(params) -> dict:
    """Mean validation loss over the first train.eval_batches batches of the valid split."""
    it = data_lib.make_iterator(cfg.data, tokenizer, split="valid", process_index=pidx,
                                process_count=pcount, num_shards=cfg.data_shards or None)
    l_sum = w_sum = 0.0
    for _ in range(cfg.train.eval_batches):
      try:
        local = next(it)
      except StopIteration:
        break
      l, w = eval_fn(params, loop.global_batch(local, batch_sh))
      l_sum, w_sum = l_sum + float(l), w_sum + float(w)
    return {"val_loss": l_sum / max(w_sum, 1.0)}

  return loop.Task(
      params=params, param_sh=param_sh, opt_state=opt_state, opt_sh=opt_sh, tx=tx,
      loss=lambda key: loss_fn, batch_sh=batch_sh,
      batches=batches, abstract_batches=abstract_batches, data_iter=train_iter,
      evaluate=evaluate if cfg.train.eval_every else None,
      flops_per_token=metrics.flops_per_token(cfg.model),
      init=None if abstract else init,
      notes=f"data.tokenize={cfg.data.tokenize}", seconds=seconds,
      evaluate_with=f"python eval.py --workdir {workdir}")


def train(cfg: config_lib.Config, workdir: str, *, dry_run: bool = False,
          stop_at: int | None = None) -> dict:
  """Trains the language model `cfg` describes in `workdir` (loop.run)."""
  return loop.run(cfg, workdir, functools.partial(task, abstract=dry_run), dry_run=dry_run,
                  stop_at=stop_at)
