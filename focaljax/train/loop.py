"""The training loop: a pure, jitted, explicitly sharded step and an asynchronous host loop.

State is (params, opt_state): pure dicts of arrays, sharded by the logical-axis rules. The step
is jitted once with explicit in/out shardings and donated buffers; micro-batches (gradient
accumulation) run under `lax.scan`; compute runs in `train.compute_dtype` over float32 master
weights. The host fetches step N's metrics after dispatching step N+1, so the device never waits
for Python.
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from focaljax import sharding
from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.train import metrics
from focaljax.train import optim
from focaljax import config as config_lib
from focaljax.data import pipeline as data_lib
from focaljax.train import loss as loss_lib
from focaljax.model import decoder as model_lib


class NonFiniteLoss(FloatingPointError):
  pass


@dataclasses.dataclass(frozen=True)
class StepConfig:
  compute_dtype: jnp.dtype
  grad_accum: int
  skip_nonfinite: bool
  cross_entropy: str = "optax"  # train.cross_entropy: a key of loss.CROSS_ENTROPIES


def loss_sums(params, batch, graphdef, dtype, cross_entropy: str = "optax"):
  """(Σ weight·nll, Σ weight) over a batch; float32."""
  model = nnx.merge(graphdef, jax.tree.map(lambda p: p.astype(dtype), params))
  # No "segment_ids": every row is one document (unpacked data), so attention needs no mask.
  logits_BTV = model(batch["inputs"], positions_BT=batch["positions"],
                     segment_ids_BT=batch.get("segment_ids"), dtype=dtype)
  with jax.named_scope("loss"):
    nll_BT = loss_lib.CROSS_ENTROPIES[cross_entropy](logits_BTV, batch["targets"])
  w_BT = batch["weights"].astype(jnp.float32)
  return (nll_BT * w_BT).sum(), w_BT.sum()


def train_step(params, opt_state, batch, *, graphdef, tx, cfg: StepConfig):
  """One optimizer step over `grad_accum` micro-batches. Pure."""
  # Micro-batch m takes rows m, m+A, m+2A, ...: the batch axis stays sharded as it arrived.
  micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // cfg.grad_accum, cfg.grad_accum,
                                           *x.shape[1:]).swapaxes(0, 1), batch)
  grad_fn = jax.value_and_grad(loss_sums, has_aux=True)

  def body(carry, mb):
    g_acc, l_acc, w_acc = carry
    (l, w), g = grad_fn(params, mb, graphdef, cfg.compute_dtype, cfg.cross_entropy)
    return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, w_acc + w), None

  if cfg.grad_accum == 1:  # no scan, no zero-filled accumulator pass over every gradient
    (l_sum, w_sum), g_sum = grad_fn(params, batch, graphdef, cfg.compute_dtype, cfg.cross_entropy)
  else:
    zeros = jax.tree.map(jnp.zeros_like, params)
    (g_sum, l_sum, w_sum), _ = jax.lax.scan(body, (zeros, 0.0, 0.0), micro)
  denom = jnp.maximum(w_sum, 1.0)
  grads = jax.tree.map(lambda g: g / denom, g_sum)
  loss = l_sum / denom
  with jax.named_scope("optimizer"):
    grad_norm = optax.tree.norm(grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  if cfg.skip_nonfinite:
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
  return new_params, new_opt, {"loss": loss, "grad_norm": grad_norm, "finite": finite,
                               "tokens": w_sum}


def eval_step(params, batch, *, graphdef, dtype):
  return loss_sums(params, batch, graphdef, dtype)


class Preemption:
  """SIGTERM -> save a checkpoint at the next step boundary and exit.

  One process: a Python signal handler sets a flag. Several: every host must stop at the same
  step (Orbax saves collectively), so the decision comes from jax's preemption sync point, which
  the distributed runtime's coordination service agrees on across hosts.
  """

  def __init__(self):
    self.multi = jax.process_count() > 1
    self.requested = False
    if not self.multi:
      self._old = signal.signal(signal.SIGTERM, self._handle)

  def _handle(self, *_):
    self.requested = True

  def reached(self, step: int) -> bool:
    if self.multi:
      from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel
      self.requested = multihost_utils.reached_preemption_sync_point(step)
    return self.requested

  def restore(self):
    if not self.multi:
      signal.signal(signal.SIGTERM, self._old)


def build(config, workdir: str | None):
  """Tokenizer, model config, graphdef and abstract params for `config` (no compilation)."""
  data_cfg = config_lib.data_config(config)
  tokenizer = data_lib.load_tokenizer(data_cfg, workdir)
  config_lib.validate(config, vocab_size=tokenizer.vocab_size, process_count=jax.process_count())
  model_cfg = config_lib.model_config(config, tokenizer.vocab_size)
  abstract = nnx.eval_shape(lambda: model_lib.Transformer(model_cfg, nnx.Rngs(0)))
  graphdef, abstract_state = nnx.split(abstract)
  return tokenizer, model_cfg, graphdef, abstract_state


def init_state(model_cfg, tx, param_sh, mesh, key):
  """Fresh (params, opt_state, opt_shardings) under `mesh`: params in `param_sh`, the optimizer
  state sharded like them (sharding.opt_state_shardings)."""
  # The key is an argument: a jit with no inputs lets XLA constant-fold the whole RNG, which
  # takes minutes for a 400M model.
  init_fn = lambda k: nnx.to_pure_dict(nnx.split(
      model_lib.Transformer(model_cfg, nnx.Rngs(params=k)))[1])
  with jax.set_mesh(mesh):
    params = jax.jit(init_fn, out_shardings=param_sh)(key)
    opt_sh = sharding.opt_state_shardings(tx, params, param_sh, mesh)
    return params, jax.jit(tx.init, out_shardings=opt_sh)(params), opt_sh


def _global_batch(local, batch_sh):
  return {k: jax.make_array_from_process_local_data(batch_sh, np.asarray(v))
          for k, v in local.items()}


def train(config, workdir: str, *, dry_run: bool = False, stop_at: int | None = None) -> dict:
  """Trains per `config` in `workdir`, resuming from its latest checkpoint. Returns a summary.

  `stop_at`: save and return after this step (the schedule still spans train.steps), for
  time-limited jobs that resume later.
  """
  t_setup = time.perf_counter()
  distributed.initialize()
  config_lib.validate(config, process_count=jax.process_count())
  primary = distributed.is_primary()
  tokenizer, model_cfg, graphdef, abstract_state = build(config, workdir)
  if primary:
    checkpoint.write_config(workdir, config)
    tokenizer.save(workdir)

  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  param_sh = sharding.param_shardings(abstract_state, mesh)
  batch_sh = sharding.batch_sharding(mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  abstract_params = nnx.to_pure_dict(abstract_state)
  tx = optim.make(config_lib.optim_config(config), abstract_params)
  step_cfg = StepConfig(compute_dtype=jnp.dtype(config.train.compute_dtype),
                        grad_accum=config.optim.grad_accum,
                        skip_nonfinite=config.train.nonfinite == "skip",
                        cross_entropy=config.train.cross_entropy)

  # Compile and dispatch only: the init's device work overlaps the data set-up below.
  t_init = time.perf_counter()
  params, opt_state, opt_sh = init_state(model_cfg, tx, param_sh, mesh,
                                         jax.random.key(config.seed))
  t_init = time.perf_counter() - t_init
  with jax.set_mesh(mesh):
    step_fn = jax.jit(functools.partial(train_step, graphdef=graphdef, tx=tx, cfg=step_cfg),
                      in_shardings=(param_sh, opt_sh, batch_sh),
                      out_shardings=(param_sh, opt_sh, replicated), donate_argnums=(0, 1))
    eval_fn = jax.jit(functools.partial(eval_step, graphdef=graphdef,
                                        dtype=step_cfg.compute_dtype),
                      in_shardings=(param_sh, batch_sh), out_shardings=replicated)

  data_cfg = config_lib.data_config(config)
  pidx, pcount = jax.process_index(), jax.process_count()
  t_data = time.perf_counter()
  train_iter = data_lib.make_iterator(data_cfg, tokenizer, split="train",
                                      process_index=pidx, process_count=pcount,
                                      num_shards=config.data.shards or None)
  t_data = time.perf_counter() - t_data
  if dry_run:
    abstract_batch = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct((config.data.global_batch, *x.shape[1:]), x.dtype,
                                       sharding=batch_sh), next(iter(train_iter)))
    with jax.set_mesh(mesh):
      compiled = step_fn.lower(params, opt_state, abstract_batch).compile()
    mem = compiled.memory_analysis()
    print(f"dry run: compiled train step; memory analysis: {mem}")
    return {"dry_run": True, "memory": str(mem)}

  ckpt = checkpoint.Checkpointer(workdir, keep=config.train.keep_ckpts,
                                 async_save=config.train.async_ckpt)
  start = ckpt.latest_step() or 0
  if start:
    abs_p = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), params)
    abs_o = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), opt_state)
    params, opt_state, _ = ckpt.restore(start, abs_p, abs_o, train_iter)

  steps = config.train.steps
  writer = metrics.Writer(workdir, steps, start, enabled=primary)
  if start:
    writer.message(f"resumed from step {start} in {workdir}")
  # Where a run's first minutes go (twenty-second session, fresh H200: 68.4 s, 19.6 s of it
  # the train data, the rest not broken down); the first step's compile comes after.
  writer.message(f"set-up {time.perf_counter() - t_setup:.1f} s, of it the train data "
                 f"{t_data:.1f} s (data.tokenize={config.data.tokenize}) and the parameter and "
                 f"optimizer init {t_init:.1f} s")
  lr_at = optim.schedule(config_lib.optim_config(config))
  tokens_per_step = config.data.global_batch * config.data.seq_len
  peak = metrics.peak_flops_per_device()
  flops_tok = metrics.flops_per_token(model_cfg)
  preempt = Preemption()
  pending, t_last, step = None, time.perf_counter(), start
  summary = {"start_step": start}

  def finish_pending(pending):
    nonlocal t_last
    pstep, m = pending
    m = jax.device_get(m)
    if not m["finite"]:
      if not step_cfg.skip_nonfinite:
        raise NonFiniteLoss(f"non-finite loss ({m['loss']}) at step {pstep}; stopping "
                            "(train.nonfinite=skip would skip such steps)")
      writer.message(f"step {pstep}: non-finite loss ({m['loss']}); update skipped")
    summary["loss"] = float(m["loss"])
    if pstep % config.train.log_every == 0 or pstep == steps:
      now = time.perf_counter()
      n = config.train.log_every if pstep % config.train.log_every == 0 else 1
      tps = tokens_per_step * n / max(now - t_last, 1e-9)
      t_last = now
      scalars = {"loss": m["loss"], "grad_norm": m["grad_norm"], "lr": lr_at(pstep - 1),
                 "tokens_per_s": tps}
      if peak:
        scalars["mfu"] = tps * flops_tok / (peak * jax.device_count())
      writer.write(pstep, scalars)
      writer.progress(pstep, scalars)

  try:
    with jax.set_mesh(mesh):
      while step < steps:
        batch = _global_batch(next(train_iter), batch_sh)
        params, opt_state, m = step_fn(params, opt_state, batch)
        step += 1
        if pending is not None:
          finish_pending(pending)
        pending = (step, m)
        if config.train.eval_every and step % config.train.eval_every == 0:
          finish_pending(pending)
          pending = None
          val = evaluate_loss(config, tokenizer, params, eval_fn, batch_sh)
          summary["val_loss"] = val
          writer.write(step, {"val_loss": val})
          writer.message(f"step {step}: validation loss {val:.4f}")
        preempted = preempt.reached(step)
        stopping = preempted or step == stop_at
        if step % config.train.ckpt_every == 0 or step == steps or stopping:
          ckpt.save(step, params, opt_state, train_iter, {"step": step}, force=True)
        if preempted:
          writer.message(f"SIGTERM: saved step {step} to {workdir}; exiting")
          summary["preempted"] = True
          break
        if stopping:
          break
      if pending is not None:
        finish_pending(pending)
  finally:
    ckpt.close()
    writer.close()
    preempt.restore()
  summary["step"] = step
  if primary and not summary.get("preempted"):
    print(f"trained {step} steps; loss {summary.get('loss', float('nan')):.4f}. "
          f"Evaluate with: python eval.py --workdir {workdir}")
  return summary


def evaluate_loss(config, tokenizer, params, eval_fn, batch_sh) -> float:
  """Mean validation loss over the first `train.eval_batches` batches of the valid split."""
  it = data_lib.make_iterator(config_lib.data_config(config), tokenizer,
                              split="valid", process_index=jax.process_index(),
                              process_count=jax.process_count())
  l_sum = w_sum = 0.0
  for _ in range(config.train.eval_batches):
    try:
      local = next(it)
    except StopIteration:
      break
    l, w = eval_fn(params, _global_batch(local, batch_sh))
    l_sum, w_sum = l_sum + float(l), w_sum + float(w)
  return l_sum / max(w_sum, 1.0)
