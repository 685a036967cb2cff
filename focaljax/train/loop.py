"""The training loop, one for every model: what differs between them is a `Task`.

A Task holds the trained params and their shardings (a language model's, focaljax/train/lm.py; a
FocusLLM adapter's, focaljax/focus/train.py), the frozen params its loss reads and nothing trains
(FocusLLM's base), the loss of one step, the batches, and what a checkpoint records besides. The
loop does the rest alike: a pure, jitted step with explicit shardings and donated buffers,
gradient accumulation under `lax.scan`, Orbax checkpoints and resume (checkpoint.py), SIGTERM,
metrics. The host fetches step N's metrics after dispatching step N+1, so the device never waits
for Python; at a checkpoint step it reads them first, and saves only a step whose loss, gradient
norm, updated parameters and validation loss are finite (a NaN never reaches a checkpoint).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import signal
import time
from typing import Any, Callable, Hashable, Iterator

import jax
import jax.numpy as jnp
import numpy as np
import optax

from focaljax import config as config_lib
from focaljax import dispatch
from focaljax import sharding
from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.train import memory
from focaljax.train import metrics
from focaljax.train import optim
from focaljax.train import startup
from focaljax.train import workdir as workdir_lib


# A finite loss above this has exploded: it stops (or, with train.nonfinite=skip, skips) a step
# like a NaN. A fresh model's loss is about ln(vocab size), below 12 for any vocabulary we use.
MAX_LOSS = 1e4
# train.nonfinite=skip gives up after this many consecutive skipped steps: the run is diverging.
MAX_SKIPPED = 10


class NonFiniteLoss(FloatingPointError):
  """Training stopped at a NaN/Inf or exploded step; no checkpoint holds its state."""


@dataclasses.dataclass(frozen=True)
class StepConfig:
  compute_dtype: jnp.dtype
  grad_accum: int
  skip_nonfinite: bool
  max_loss: float = MAX_LOSS


# loss(params, frozen, batch) -> (Σ loss, (Σ weight, {metric: (Σ value, count)})), float32. The
# step minimises Σ loss / Σ weight; each metric is logged as Σ value / count over the interval.
LossFn = Callable[[Any, Any, dict], tuple]


@dataclasses.dataclass
class Batch:
  """One step's input on this process, and what the loop logs of it."""
  arrays: dict
  key: Hashable = None    # picks the step's loss (Task.loss): one compile per key
  tokens: int = 0         # tokens the step reads, for tokens/s
  info: dict = dataclasses.field(default_factory=dict)   # logged as is (FocusLLM: chunk_size)


@dataclasses.dataclass
class Task:
  """What a run trains; `run` does the rest."""
  params: Any                          # the trained params, placed in param_sh
  param_sh: Any
  tx: optax.GradientTransformation
  loss: Callable[[Hashable], LossFn]   # Batch.key -> the step's loss
  batch_sh: Any                        # a global batch's shardings (one, or one per array)
  batches: Callable[[int], Iterator[Batch]]   # this process's batches from a step on
  abstract_batches: Callable[[], dict]        # key -> a global batch's ShapeDtypeStructs
  opt_state: Any = None                # tx.init(params), made with them (None: the loop does)
  # Set: params and opt_state are their sharded ShapeDtypeStructs and init() makes both; the
  # loop runs it while the step compiles, and not at all when it resumes from a checkpoint.
  init: Callable[[], tuple] | None = None
  opt_sh: Any = None
  frozen: Any = None                   # read by the loss; never trained, never saved
  frozen_sh: Any = None
  data_iter: Any = None                # saved with the state (None: batches follow the step)
  meta: dict = dataclasses.field(default_factory=dict)   # JSON kept in every checkpoint
  evaluate: Callable[[Any], dict] | None = None   # params -> scalars, every train.eval_every
  flops_per_token: float | None = None             # model FLOPs per token: MFU
  notes: str = ""                                  # set-up details for the log
  evaluate_with: str = ""                          # the command that evaluates the result
  seconds: dict = dataclasses.field(default_factory=dict)   # data / init set-up, for the log


def step(params, opt_state, frozen, batch, *, loss_fn: LossFn, tx, cfg: StepConfig):
  """One optimizer step over `grad_accum` micro-batches, differentiating `params` only. Pure."""
  grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
  if cfg.grad_accum == 1:  # no scan, no zero-filled accumulator pass over every gradient
    (l_sum, (w_sum, sums)), g_sum = grad_fn(params, frozen, batch)
  else:
    # Micro-batch m takes rows m, m+A, m+2A, ...: the batch axis stays sharded as it arrived.
    micro = jax.tree.map(lambda x: x.reshape(x.shape[0] // cfg.grad_accum, cfg.grad_accum,
                                             *x.shape[1:]).swapaxes(0, 1), batch)

    def body(carry, mb):
      g_acc, l_acc, w_acc = carry
      (l, (w, sums)), g = grad_fn(params, frozen, mb)
      return (jax.tree.map(jnp.add, g_acc, g), l_acc + l, w_acc + w), sums

    zeros = jax.tree.map(jnp.zeros_like, params)
    (g_sum, l_sum, w_sum), sums = jax.lax.scan(body, (zeros, 0.0, 0.0), micro)
    sums = jax.tree.map(lambda x: x.sum(0), sums)
  denom = jnp.maximum(w_sum, 1.0)
  grads, loss = jax.tree.map(lambda g: g / denom, g_sum), l_sum / denom
  with jax.named_scope("optimizer"):
    grad_norm = optax.tree.norm(grads)
    updates, new_opt = tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  exploded = finite & (loss > cfg.max_loss)
  out = {"loss": loss, "grad_norm": grad_norm, "finite": finite, "exploded": exploded,
         "sums": sums}
  if cfg.skip_nonfinite:
    out["params_finite"] = _all_finite(new_params)
    ok = finite & ~exploded & out["params_finite"]
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(ok, a, b), new, old)
    new_params, new_opt = keep(new_params, params), keep(new_opt, opt_state)
  return new_params, new_opt, out


def _all_finite(tree):
  return jax.tree.reduce(lambda acc, x: acc & jnp.isfinite(x).all(), tree, jnp.bool_(True))


def init_opt(tx, params, param_sh, mesh):
  """(opt_state, its shardings): sharded like the params (sharding.opt_state_shardings)."""
  with jax.set_mesh(mesh):
    opt_sh = sharding.opt_state_shardings(tx, params, param_sh, mesh)
    return jax.jit(tx.init, out_shardings=opt_sh)(params), opt_sh


def global_batch(local: dict, batch_sh) -> dict:
  """This process's rows -> global arrays (batch_sh: one sharding, or one per array)."""
  return {k: jax.make_array_from_process_local_data(
      batch_sh[k] if isinstance(batch_sh, dict) else batch_sh, np.asarray(v))
          for k, v in local.items()}


class PreemptedAtStartup(BaseException):
  """SIGTERM before training started: nothing new to save. A BaseException, as KeyboardInterrupt
  is, so that no fallback (checkpoint.restore_latest's) takes it for a failure to recover from."""


def sigterm_before_training(*_):
  """train.py's SIGTERM handler until `Preemption` takes over at the first step."""
  raise PreemptedAtStartup("SIGTERM before the first step: nothing new to save; run the same "
                           "command again")


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


def run(cfg: config_lib.Config, workdir: str, make_task, *, dry_run: bool = False,
        stop_at: int | None = None) -> dict:
  """Trains `make_task(cfg, workdir, mesh)` in `workdir`, resuming from its latest checkpoint;
  returns a summary. `stop_at`: save and return after this step (the schedule still spans
  train.steps), for time-limited jobs that resume later. `dry_run`: compile each step (one per
  batch key) on abstract inputs and report its memory per device (memory.report), train
  nothing. The micro-batch is train.micro_batch, or the largest that fits (memory.py)."""
  t_setup = time.perf_counter()
  distributed.initialize()
  if not dry_run:   # a dry run reads no checkpoint, so any workdir's will do
    workdir_lib.check(workdir, cfg.config_json)   # before anything in the workdir is written
  if why := dispatch.unavailable(cfg.model.attention.implementation):
    raise config_lib.ConfigError(f"config field model.attention.implementation: {why}")
  try:
    shape = dict(sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor).shape)
  except ValueError as e:   # the mesh does not fit the devices: the user's config
    raise config_lib.ConfigError(f"config field {e}") from None
  if cfg.data.global_batch % (shape["data"] * shape["fsdp"]):   # the batch's rows are split
    raise config_lib.ConfigError(   # over the data and fsdp axes
        f"config field data.global_batch: {cfg.data.global_batch} must be divisible by the "
        f"{shape['data'] * shape['fsdp']} devices that split it (mesh.data x mesh.fsdp)")
  if distributed.is_primary() and not dry_run:   # a dry run writes nothing
    workdir_lib.lock(workdir)   # one trainer per workdir; the kernel frees it if we die
  known = {}   # what an out-of-memory error can report (memory.oom_as_error)
  try:
    with memory.oom_as_error(known):
      return _run(cfg, workdir, make_task, dry_run=dry_run, stop_at=stop_at, t_setup=t_setup,
                  known=known)
  finally:
    workdir_lib.unlock(workdir)


def _run(cfg, workdir, make_task, *, dry_run, stop_at, t_setup, known) -> dict:
  primary, t = distributed.is_primary(), cfg.train
  done = checkpoint.latest_step(workdir)
  if done and done >= t.steps and not dry_run:   # before anything is built or compiled
    print(f"{workdir} holds the finished run (step {done} of train.steps={t.steps}): nothing "
          "to train; raise train.steps to train on")
    return {"start_step": done, "step": done, "saved_step": done, "finished": True}
  mesh = sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor)
  # A model whose state cannot fit the devices is refused before anything is allocated.
  known["memory"] = memory.device_memory()   # CPU: none; a real run checks the host's instead
  limit = known["memory"] or (None if dry_run else memory.host_memory_per_device())
  memory.check_fits(cfg, dict(mesh.shape), limit)
  task = make_task(cfg, workdir, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  params, opt_state, opt_sh = task.params, task.opt_state, task.opt_sh
  if opt_state is None:
    opt_state, opt_sh = init_opt(task.tx, params, task.param_sh, mesh)
  # The init's compiles and the step's overlap: XLA compiles without holding the GIL.
  pool = concurrent.futures.ThreadPoolExecutor(1)
  initialized = (pool.submit(task.init) if task.init is not None and not done and not dry_run
                 else None)

  @functools.cache
  def step_fn(key, accum):
    step_cfg = StepConfig(jnp.dtype(t.compute_dtype), accum, t.skip_nonfinite, MAX_LOSS)
    with jax.set_mesh(mesh):
      return jax.jit(functools.partial(step, loss_fn=task.loss(key), tx=task.tx, cfg=step_cfg),
                     in_shardings=(task.param_sh, opt_sh, task.frozen_sh, task.batch_sh),
                     out_shardings=(task.param_sh, opt_sh, replicated), donate_argnums=(0, 1))

  abstract_batches = task.abstract_batches()
  rows = memory.rows_per_device(abstract_batches, task.batch_sh)

  @functools.cache
  def compiled(key, micro):
    with jax.set_mesh(mesh):
      return step_fn(key, rows // micro).lower(params, opt_state, task.frozen,
                                               abstract_batches[key]).compile()

  t_fit = time.perf_counter()
  shape = dict(mesh.shape)
  guess_at = lambda mb: memory.estimate(cfg, micro_batch=mb, accum=rows // mb, tensor=shape[
      "tensor"], state_shards=shape["fsdp"] * shape["tensor"]).total
  micro, peak = memory.resolve_micro_batch(
      t.micro_batch, rows, lambda mb: max(memory.compiled_bytes(compiled(k, mb))
                                          for k in abstract_batches), known["memory"], guess_at)
  accum = rows // micro
  known.update(micro_batch=micro, accum=accum, **({"peak": peak} if peak else {}))
  if dry_run:
    return memory.report(cfg, mesh, micro, accum,
                         {k: compiled(k, micro) for k in abstract_batches}, params, opt_state)
  t_fit = time.perf_counter() - t_fit

  ckpt = checkpoint.Checkpointer(workdir, keep=t.keep_ckpts, async_save=t.async_ckpt)
  abstract = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
  # The newest intact checkpoint: damaged newer ones are set aside with a warning.
  start, *restored = ckpt.restore_latest(abstract(params), abstract(opt_state), task.data_iter)
  if primary:   # only now: a run refused above leaves an earlier run's config.json as it was
    checkpoint.write_config(workdir, cfg.config_json)
    workdir_lib.cut_metrics(workdir, start)
  if start:
    params, opt_state, _ = restored
  elif task.init is not None:   # nothing (intact) to resume from
    params, opt_state = (initialized or pool.submit(task.init)).result()
  pool.shutdown()
  writer = metrics.Writer(workdir, t.steps, start, enabled=primary,
                          wandb_project=t.wandb_project, config_json=cfg.config_json)
  if start:
    writer.message(f"resumed from step {start} in {workdir}")
  writer.message(f"set-up {time.perf_counter() - t_setup:.1f} s" +
                 (f"; {task.notes}" if task.notes else ""))
  interval = metrics.Interval(optim.schedule(cfg.optim), task.flops_per_token)
  preempt = Preemption()
  pending, step_no, summary = None, start, {"start_step": start}
  saved, skipped = [start or None], []   # the latest checkpoint; the current run of skipped steps
  all_finite = jax.jit(_all_finite)

  def stop(pstep, what, action="stopped"):
    raise NonFiniteLoss(f"{what} at step {pstep}; {action}; the latest checkpoint is "
                        f"{'step ' + str(saved[0]) if saved[0] else 'none'}")

  def finish(pending) -> bool:
    """Reads step `pending`'s metrics, stops or skips a bad step; False: its update was skipped."""
    pstep, m, batch = pending
    m = jax.device_get(m)
    bad = (f"non-finite loss ({m['loss']})" if not m["finite"] else
           f"exploded loss ({m['loss']:.4g} > {MAX_LOSS:g})" if m["exploded"] else
           "non-finite parameters after the update" if not m.get("params_finite", True) else "")
    if bad and not t.skip_nonfinite:
      stop(pstep, bad, "stopped (train.nonfinite=skip would skip such steps)")
    if bad:
      skipped.append(pstep)
      if len(skipped) >= MAX_SKIPPED:
        stop(pstep, f"{len(skipped)} consecutive skipped steps ({skipped[0]}-{pstep}, the last: "
             f"{bad})", "giving up (train.nonfinite=skip)")
      writer.message(f"step {pstep}: {bad}; update skipped")
    else:
      skipped.clear()
    summary["loss"] = float(m["loss"])
    interval.add(m, batch)
    lagging = pace.fetched(pstep)
    if lagging:
      writer.message(lagging)
    if pstep % t.log_every == 0 or pstep == t.steps:
      scalars = interval.scalars(pstep)
      writer.write(pstep, scalars)
      writer.progress(pstep, scalars)
    return not bad

  # The input alone, on a few batches the iterator then gives again: is it faster than the step?
  batches, first_batch_s, input_rate = startup.probe(task.batches, start, task.data_iter)
  pace, interval.t0 = startup.Pace(input_rate, start + 1), time.perf_counter()
  try:
    with jax.set_mesh(mesh):
      while step_no < t.steps:
        asked = time.perf_counter()
        batch = next(batches)
        interval.waited += time.perf_counter() - asked
        pace.add_wait(time.perf_counter() - asked)
        t_call = time.perf_counter()
        # The program the fit compiled (or compiles now): no second compile of the step.
        program = compiled(batch.key, micro)
        t_run = time.perf_counter()
        params, opt_state, m = program(params, opt_state, task.frozen,
                                       global_batch(batch.arrays, task.batch_sh))
        step_no += 1
        if step_no == start + 1:   # the first call may wait for the step to run: timed apart
          writer.message(startup.first_step_line(
              t_setup, task.seconds, first_batch_s, t_fit + t_run - t_call, t_run,
              time.perf_counter() - t_run, micro, rows))
        if pending is not None:
          finish(pending)   # after dispatching this step: the device never waits for the host
        pending = (step_no, m, batch)
        if task.evaluate and t.eval_every and step_no % t.eval_every == 0:
          finish(pending)
          pending = None
          scalars = task.evaluate(params)
          summary.update(scalars)
          writer.write(step_no, scalars)
          writer.message(f"step {step_no}: " + ", ".join(f"{k} {v:.4f}"
                                                         for k, v in scalars.items()))
          if bad := [f"{k} {v}" for k, v in scalars.items() if not abs(v) <= MAX_LOSS]:
            stop(step_no, f"non-finite or exploded {', '.join(bad)}", "stopped")   # not saved
        preempted = preempt.reached(step_no)   # one agreed step on every host
        stopping = preempted or step_no == stop_at
        if step_no % t.ckpt_every == 0 or step_no == t.steps or stopping:
          # Only a good step is saved: its metrics are read first (not one step late).
          good = finish(pending) if pending is not None else not skipped
          pending = None
          if good and not t.skip_nonfinite and not all_finite(params):
            stop(step_no, "non-finite parameters after the update")
          if good:
            ckpt.save(step_no, params, opt_state, task.data_iter, {"step": step_no, **task.meta})
            saved[0] = step_no
        if preempted:
          writer.message(f"SIGTERM: saved step {step_no} to {workdir}; exiting"
                         if saved[0] == step_no else f"SIGTERM at step {step_no}: the latest "
                         f"checkpoint is step {saved[0]} in {workdir}; exiting")
          summary["preempted"] = True
          break
        if stopping:
          break
      if pending is not None:
        finish(pending)
  finally:
    batches.close()
    ckpt.close()
    writer.close()
    preempt.restore()
  summary["step"], summary["saved_step"] = step_no, saved[0]
  if primary and not summary.get("preempted"):
    # A resumed run already at train.steps trains nothing and has no loss to report.
    loss = f"loss {summary['loss']:.4f}" if "loss" in summary else "nothing left to train"
    done = step_no - start
    print(f"trained {done} steps" + (f" (steps {start + 1}-{step_no})" if start and done else "")
          + f"; {loss}. Evaluate with: {task.evaluate_with}")
  return summary
