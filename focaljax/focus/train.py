"""FocusLLM training (configs/focus.py): the candidate adapter learns, the base stays frozen.

The task train/loop.py runs, as it runs the language model's: the trained params are the adapter
(replicated; a copy of the base's projections at step 0), the frozen params the base's (cast once
to train.compute_dtype and sharded like a model's; the loss closes over them, so they are never
differentiated, in the optimizer or saved), the batches focus/samples.py's (one chunk size per
step, one compile per chunk size; a pure function of (seed, step, process), so a resumed run
replays the same stream without iterator state). The loss is `focus.target_nll`'s leak-free
objective over the last `num_targets` local tokens. Checkpoints hold the adapter, its optimizer
state and focus/adapter.py's meta; the base workdir is only read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from focaljax import config as config_lib
from focaljax import sharding
from focaljax.evaluation import loading
from focaljax.focus import adapter as adapter_lib
from focaljax.focus import model as focus
from focaljax.focus import samples as samples_lib
from focaljax.train import checkpoint
from focaljax.train import loop
from focaljax.train import optim


def answer_nll_sum(nll_BQ, key_at_B):
  """Σ over drills of the NLL of targets key_at.. (the answer " K."); rows with key_at = -1 add 0."""
  in_answer_BQ = (jnp.arange(nll_BQ.shape[1])[None] >= key_at_B[:, None]) & (key_at_B[:, None] >= 0)
  return jnp.where(in_answer_BQ, nll_BQ, 0.0).sum()


def loss(adapter, base_params, batch, *, graphdef, cfg: focus.FocusConfig, num_targets: int):
  """(Σ target NLL, (targets, per-task sums)) of a batch (loop.LossFn)."""
  base = nnx.merge(graphdef, base_params)
  nll_BQ = focus.target_nll(adapter, base, batch["memory"], batch["tokens"], cfg, num_targets)
  nll_B, r_B = nll_BQ.mean(axis=1), batch["reconstruction"]
  # Per task (a batch may hold none of one). loss_key, the drills' NLL summed over the answer,
  # says whether the memory reaches the local decoder: about ln(90000) ≈ 11.4 is knowing only
  # that a 5-digit key comes, ~0 is reading it.
  sums = {"loss_continuation": ((nll_B * (1 - r_B)).sum(), (1 - r_B).sum()),
          "loss_reconstruction": ((nll_B * r_B).sum(), r_B.sum()),
          "loss_key": (answer_nll_sum(nll_BQ, batch["key_at"]),
                       (batch["key_at"] >= 0).sum().astype(jnp.float32))}
  return nll_BQ.sum(), (jnp.float32(nll_BQ.size), sums)


def _check_resume(f: config_lib.FocusTrainConfig, workdir: str) -> None:
  """A workdir with saved adapters must be resumed over the same base, on the same path."""
  if checkpoint.latest_step(workdir) is None:
    adapter_lib.check_not_legacy(workdir)
    return
  saved, step = checkpoint.read_meta(workdir, None)
  where = f"the adapter in {workdir}/checkpoints/{step}"
  if saved["base_workdir"] != f.base_workdir:
    raise config_lib.ConfigError(f"config field focus.base_workdir: {f.base_workdir} differs from "
                                 f"{saved['base_workdir']}, the base of {where}")
  if saved["focus"]["candidate_path"] != f.candidate_path:   # the adapters' leaves differ
    raise config_lib.ConfigError(
        f"config field focus.candidate_path: {f.candidate_path!r}, but {where} was trained with "
        f"{saved['focus']['candidate_path']!r}")


def task(cfg: config_lib.Config, workdir: str, mesh) -> loop.Task:
  """The loop.Task of a FocusLLM adapter run over the frozen base focus.base_workdir."""
  f = cfg.focus
  _check_resume(f, workdir)
  base = loading.load(f.base_workdir)
  graphdef, base_state = nnx.split(adapter_lib.with_attention(base.model, f.base_attention))
  base_sh = sharding.param_shardings(base_state, mesh)
  dtype = jnp.dtype(cfg.train.compute_dtype)
  base_params = jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, dtype),
                                            nnx.to_pure_dict(base_state)), base_sh)
  adapter = focus.init_adapter(base.model, f.candidate_path)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  adapter_sh = jax.tree.map(lambda _: replicated, adapter)
  rows = jax.sharding.NamedSharding(mesh, sharding.spec(("batch",)))
  batch_sh = {"memory": sharding.batch_sharding(mesh), "tokens": sharding.batch_sharding(mesh),
              "reconstruction": rows, "key_at": rows}
  B, T = cfg.data.global_batch, f.local_len
  sampler = samples_lib.Sampler(f, cfg.data, cfg.seed, base.tokenizer, jax.process_index(),
                                B // jax.process_count())

  def focus_cfg(chunk: int, prompt_len: int) -> focus.FocusConfig:
    return focus.FocusConfig(chunk, prompt_len=prompt_len, implementation=f.implementation,
                             candidate_path=f.candidate_path)

  def batches(start):
    ahead = samples_lib.prefetch(sampler, start, cfg.train.steps)
    try:
      for step, local in ahead:
        chunk, M = sampler.shape(step)
        yield loop.Batch(local, key=chunk, tokens=B * (M + T), info={"chunk_size": chunk})
    finally:
      ahead.close()

  def abstract_batches():   # each chunk size's longest memory: the peak
    longest = max(f.memory_tokens)
    shapes = lambda s: {"memory": (B, samples_lib.memory_len(s, longest)), "tokens": (B, T + 1),
                        "reconstruction": (B,), "key_at": (B,)}
    return {s: {k: jax.ShapeDtypeStruct(v, jnp.float32 if k == "reconstruction" else jnp.int32,
                                        sharding=batch_sh[k]) for k, v in shapes(s).items()}
            for s in f.chunk_sizes}

  served = focus_cfg(max(f.chunk_sizes), f.eval_prompt_len or f.prompt_len)
  return loop.Task(
      params=jax.device_put(adapter, replicated), param_sh=adapter_sh,
      tx=optim.make(cfg.optim, adapter),
      loss=lambda chunk: functools.partial(loss, graphdef=graphdef,
                                           cfg=focus_cfg(chunk, f.prompt_len),
                                           num_targets=f.num_targets),
      batch_sh=batch_sh, batches=batches, abstract_batches=abstract_batches,
      frozen=base_params, frozen_sh=base_sh,
      meta=adapter_lib.meta(served, trained_prompt_len=f.prompt_len, local_len=f.local_len,
                            base_workdir=f.base_workdir),
      evaluate_with=f"python eval.py --workdir {f.base_workdir} --focus_adapter {workdir}")


def train(cfg: config_lib.Config, workdir: str, *, dry_run: bool = False,
          stop_at: int | None = None) -> dict:
  """Trains the FocusLLM adapter `cfg.focus` describes in `workdir` (loop.run)."""
  return loop.run(cfg, workdir, task, dry_run=dry_run, stop_at=stop_at)
