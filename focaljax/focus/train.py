"""FocusLLM training (configs/focus.py): the candidate adapter learns, the base stays frozen.

Samples: focus_samples.py (one chunk size and one memory length per step, from long documents;
continuation, reconstruction and passkey-drill samples). The loss is
`focus.target_nll`'s leak-free objective over the last `num_targets` local tokens (the official
code supervises one token per sample; the paper's Eq. 6 all of them).

The step differentiates w.r.t. the adapter only: the base params are an argument closed over by
the loss, never in the optimizer (so `optim.make` on the adapter alone; focus.py's docstring), and
they are cast once to `train.compute_dtype` since no float32 master copy is needed for them.

Workdir layout: config.json, metrics.jsonl (+ tb/), and adapter/<step>/ =
`focus_adapter.save_adapter` (adapter.npz, focus.json) + opt_state.npz. The base workdir is only
read. Sampling is a pure function of (seed, step, process), so resuming from adapter/<latest>
replays the same stream without any iterator state. Saves go to a temporary directory renamed
into place (a kill mid-save never leaves a partial latest); the newest `train.keep_ckpts` are kept.
"""

from __future__ import annotations

import functools
import os
import shutil
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from focaljax.train import checkpoint
from focaljax.train import distributed
from focaljax.focus import model as focus
from focaljax.focus import adapter as focus_adapter
from focaljax.focus import attention as focus_attention
from focaljax.focus import samples as focus_samples
from focaljax.train import metrics
from focaljax.train import optim
from focaljax import sharding
from focaljax.train import loop as trainer
from focaljax import config as config_lib

ADAPTER_DIR = "adapter"
_fail = focus_samples.fail


def base_context(config) -> int:
  """The base's trained context (its data.seq_len), after checking the workdir is trained."""
  path = config.focus.base_workdir
  if not path:
    _fail("base_workdir", "is required: a trained focaljax workdir (python train.py ...)")
  try:
    workdir, step = checkpoint.resolve(path)
  except FileNotFoundError as e:
    _fail("base_workdir", str(e))
  ckpts = os.path.join(workdir, "checkpoints")
  if step is None and not (os.path.isdir(ckpts) and any(d.isdigit() for d in os.listdir(ckpts))):
    _fail("base_workdir", f"{workdir} has no checkpoint under checkpoints/ (train it first)")
  return checkpoint.read_config(workdir).data.seq_len


# Fields newer than some saved workdir configs: their defaults are the paper's.
def _sink(f) -> str:
  return f.get("sink", "none")


def _candidate_path(f) -> str:
  return f.get("candidate_path", "adapter")


def validate(config, context: int) -> None:
  """Raises ConfigError naming the first invalid focus.* field; `context` = base max_seq_len."""
  f = config.focus
  if f.base_attention not in ("xla", "pallas"):
    _fail("base_attention", f"{f.base_attention!r} must be 'xla' or 'pallas' (the frozen chunk "
          f"prefill attends over a padded cache in the compute dtype; see "
          f"focus_adapter.with_attention)")
  if f.implementation not in focus_attention.IMPLEMENTATIONS:
    _fail("implementation", f"{f.implementation!r} must be one of "
          f"{sorted(focus_attention.IMPLEMENTATIONS)}")
  if f.candidate_positions not in focus.CANDIDATE_POSITIONS:
    _fail("candidate_positions", f"{f.candidate_positions!r} must be one of "
          f"{focus.CANDIDATE_POSITIONS}")
  if f.candidate_bias not in focus.CANDIDATE_BIASES:
    _fail("candidate_bias", f"{f.candidate_bias!r} must be one of {sorted(focus.CANDIDATE_BIASES)}")
  sink, path = _sink(f), _candidate_path(f)
  if sink not in focus.SINKS:
    _fail("sink", f"{sink!r} must be one of {list(focus.SINKS)}")
  if path not in focus.CANDIDATE_PATHS:
    _fail("candidate_path", f"{path!r} must be one of {sorted(focus.CANDIDATE_PATHS)}")
  if sink != "none" and f.candidate_bias != "none":
    _fail("sink", f"{sink!r} needs focus.candidate_bias='none' (got {f.candidate_bias!r})")
  sizes = focus_samples.chunk_sizes(config)
  for name in ("prompt_len", "doc_min_tokens"):
    if f[name] < 1:
      _fail(name, f"must be >= 1, got {f[name]}")
  if not 0.0 <= f.get("retrieval_mix", 0.0) < 1.0:
    _fail("retrieval_mix", f"must be in [0, 1), got {f.retrieval_mix}")
  if not 0.0 <= f.get("drill_in_window", 0.0) <= 1.0:
    _fail("drill_in_window", f"must be in [0, 1], got {f.drill_in_window}")
  if not f.get("answer_weight", 1.0) > 0:
    _fail("answer_weight", f"must be > 0 (1.0: every target counts the same), got "
          f"{f.answer_weight}")
  for name, off, acts in (("drill_in_window", 0.0, "places drills' needles"),
                          ("answer_weight", 1.0, "weights drills' answers")):
    if f.get(name, off) != off and not f.get("retrieval_mix", 0.0):
      _fail(name, f"{f[name]} {acts}, but focus.retrieval_mix is 0 (no drills)")
  if not 0.0 <= f.p_reconstruction <= 1.0:
    _fail("p_reconstruction", f"must be in [0, 1], got {f.p_reconstruction}")
  if f.doc_max_tokens < f.doc_min_tokens:
    _fail("doc_max_tokens", f"{f.doc_max_tokens} < focus.doc_min_tokens={f.doc_min_tokens}")
  if not 2 <= f.local_len <= context:
    _fail("local_len", f"{f.local_len} must be in [2, {context}] (the base's trained context "
          f"data.seq_len={context}: local positions run 0..local_len-1)")
  if not 1 <= f.num_targets <= f.local_len:
    _fail("num_targets", f"{f.num_targets} must be in [1, focus.local_len={f.local_len}]")
  if f.get("eval_prompt_len", 0) < 0:
    _fail("eval_prompt_len", f"must be >= 0 (0: focus.prompt_len), got {f.eval_prompt_len}")
  for s in sizes:
    served = min(f.get("eval_prompt_len", 0), s, f.local_len)   # 0: prompt_len, checked below
    if served and s + served + f.num_targets - 1 > context:
      # Training's bound (below) for the served prompt: its num_targets - 1 positions past the
      # prompt also hold the generated answer (the passkey's " K." needs 6 with this tokenizer).
      _fail("eval_prompt_len", f"chunk {s} + dynamic prompt {served} + num_targets-1 "
            f"({f.num_targets - 1}) exceeds the base's trained context data.seq_len={context}; "
            f"use <= {context - s - f.num_targets + 1}")
    # focus.check_positions for target_nll: chunk + prompt + the Q-1 later query points.
    prompt = min(f.prompt_len, s, f.local_len - f.num_targets + 1)
    if s + prompt + f.num_targets - 1 > context:
      _fail("chunk_sizes", f"chunk {s} + dynamic prompt {prompt} + num_targets-1 "
            f"({f.num_targets - 1}) = {s + prompt + f.num_targets - 1} positions exceed the "
            f"base's trained context data.seq_len={context} ({f.base_workdir}); use chunks <= "
            f"{context - prompt - f.num_targets + 1} or lower focus.prompt_len")
    for m in focus_samples.memory_tokens(config):
      _check_memory(config, context, s, m)


def _check_memory(config, context: int, s: int, m: int) -> None:
  """One (chunk size, memory length) pair of focus_samples: it fits the documents, holds a chunk
  and a reconstruction span, and in the "sequential" layout leaves room for the local window."""
  f = config.focus
  field = "memory_tokens" if f.get("memory_tokens", "") else "doc_min_tokens"
  if m > f.doc_min_tokens - f.local_len - 1:
    _fail("memory_tokens", f"{m} + local_len + 1 ({f.local_len + 1}) exceeds "
          f"focus.doc_min_tokens={f.doc_min_tokens}, the shortest document drawn; raise "
          f"doc_min_tokens or use shorter memories")
  M = focus_samples.memory_len(s, m)
  if M < max(s, f.local_len + 1):
    _fail(field, f"{getattr(f, field)} leaves a memory of {M} tokens for chunk {s} after the "
          f"local window (local_len + 1 = {f.local_len + 1}); need >= {max(s, f.local_len + 1)} "
          f"(one chunk, and room for a reconstruction span)")
  sink = _sink(f) != "none"   # one more key before the window
  if f.candidate_positions == "sequential" and M // s + sink + f.local_len > context:
    # "sequential": candidates at 0..C-1, then the window.
    _fail("candidate_positions", f"'sequential' puts {M // s} candidates (chunk {s}, memory {M}) "
          f"before focus.local_len={f.local_len}: over the base's data.seq_len={context} (the "
          f"official layout's memory limit); use larger chunks, shorter memories or 'shared'")


def focus_config(config, chunk: int) -> focus.FocusConfig:
  """The FocusConfig of config.focus for one chunk size (the train step's and the saved one)."""
  f = config.focus
  return focus.FocusConfig(chunk, prompt_len=f.prompt_len, implementation=f.implementation,
                           candidate_positions=f.candidate_positions,
                           candidate_bias=f.candidate_bias, sink=_sink(f),
                           candidate_path=_candidate_path(f))


def _in_answer(Q: int, key_at_B):
  """[B, Q] bool: the targets key_at.. of each memory drill (the answer " K."); none for -1."""
  return (jnp.arange(Q)[None] >= key_at_B[:, None]) & (key_at_B[:, None] >= 0)


def answer_nll_sum(nll_BQ, key_at_B):
  """Σ over drills of the NLL of targets key_at.. (the answer); rows with key_at = -1 add 0."""
  return jnp.where(_in_answer(nll_BQ.shape[1], key_at_B), nll_BQ, 0.0).sum()


def weighted_loss(nll_BQ, key_at_B, answer_weight: float):
  """The mean target NLL with each memory drill's answer targets counted `answer_weight` times
  (focus.answer_weight): a weighted mean, so 1.0 is the plain mean. Over a small base the answers
  carry the only signal that reaches the memory, and their share of the targets decided whether
  the adapter learned (FOCUSLLM.md, thirteenth session); the weight raises that share without
  dropping the paper's reconstruction samples or targets."""
  if answer_weight == 1.0:
    return nll_BQ.mean()
  w_BQ = jnp.where(_in_answer(nll_BQ.shape[1], key_at_B), answer_weight, 1.0)
  return (w_BQ * nll_BQ).sum() / w_BQ.sum()


def train_step(adapter, opt_state, base_params, batch, *, graphdef, tx, cfg: focus.FocusConfig,
               num_targets: int, skip_nonfinite: bool, answer_weight: float = 1.0):
  """One optimizer step on the adapter; the base is read, never returned. Pure."""
  base = nnx.merge(graphdef, base_params)

  def loss_fn(adapter):
    nll_BQ = focus.target_nll(adapter, base, batch["memory"], batch["tokens"], cfg, num_targets)
    return weighted_loss(nll_BQ, batch["key_at"], answer_weight), nll_BQ

  (loss, nll_BQ), grads = jax.value_and_grad(loss_fn, has_aux=True)(adapter)
  nll_B = nll_BQ.mean(axis=1)
  grad_norm = optax.tree.norm(grads)
  updates, new_opt = tx.update(grads, opt_state, adapter)
  new_adapter = optax.apply_updates(adapter, updates)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
  if skip_nonfinite:
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)
    new_adapter, new_opt = keep(new_adapter, adapter), keep(new_opt, opt_state)
  r_B = batch["reconstruction"]
  # Per-task sums (not means): a batch may hold no sample of one task; the host divides.
  out = {"loss": loss, "grad_norm": grad_norm, "finite": finite,
         "recon_sum": (nll_B * r_B).sum(), "recon_n": r_B.sum(),
         "cont_sum": (nll_B * (1 - r_B)).sum(), "cont_n": (1 - r_B).sum()}
  # The drills' NLL summed over the answer " K." (the last targets, from key_at on): does the
  # memory reach the local decoder at all? About ln(90000) ≈ 11.4 is knowing only that a 5-digit
  # key comes (a tokenizer may spell it digit by digit after a lone space, so no single token
  # tells); ~0 is reading it.
  out.update(key_sum=answer_nll_sum(nll_BQ, batch["key_at"]), key_n=(batch["key_at"] >= 0).sum())
  return new_adapter, new_opt, out


def _save(workdir: str, step: int, adapter, opt_state, cfg: focus.FocusConfig, base_wd: str,
          keep: int) -> str:
  root = os.path.join(workdir, ADAPTER_DIR)
  final, tmp = os.path.join(root, str(step)), os.path.join(root, f".tmp.{step}")
  shutil.rmtree(tmp, ignore_errors=True)
  focus_adapter.save_adapter(tmp, jax.device_get(adapter), cfg, base_workdir=base_wd)
  np.savez(os.path.join(tmp, "opt_state.npz"),
           *[np.asarray(x) for x in jax.tree.leaves(jax.device_get(opt_state))])
  shutil.rmtree(final, ignore_errors=True)
  os.replace(tmp, final)
  for old in saved_steps(workdir)[:-keep]:
    shutil.rmtree(os.path.join(root, str(old)), ignore_errors=True)
  return final


def _dry_run(config, step_fns, state, batch_sh, mesh) -> dict:
  B, T = config.data.global_batch, config.focus.local_len
  out = {"dry_run": True}
  longest = max(focus_samples.memory_tokens(config))
  for s, fn in step_fns.items():   # the longest memory of each chunk size: the peak
    shapes = {"memory": (B, focus_samples.memory_len(s, longest)), "tokens": (B, T + 1),
              "reconstruction": (B,), "key_at": (B,)}
    batch = {k: jax.ShapeDtypeStruct(v, jnp.float32 if k == "reconstruction" else jnp.int32,
                                     sharding=batch_sh[k]) for k, v in shapes.items()}
    with jax.set_mesh(mesh):
      out[s] = str(fn.lower(*state, batch).compile().memory_analysis())
    print(f"dry run: chunk {s}, memory {shapes['memory'][1]}: {out[s]}")
  return out


def saved_steps(workdir: str) -> list[int]:
  root = os.path.join(workdir, ADAPTER_DIR)
  return sorted(int(d) for d in os.listdir(root) if d.isdigit()) if os.path.isdir(root) else []


def train(config, workdir: str, *, dry_run: bool = False, stop_at: int | None = None) -> dict:
  """Trains the adapter per `config` in `workdir`, resuming from its latest adapter save.
  Returns a summary (start_step, step, loss, adapter_dir). `stop_at` as in trainer.train;
  `dry_run` compiles every chunk size's step on abstract inputs and reports memory."""
  distributed.initialize()
  config_lib.validate(config, process_count=jax.process_count())
  validate(config, base_context(config))
  f, primary = config.focus, distributed.is_primary()
  pcount = jax.process_count()
  if config.data.global_batch % pcount:
    raise config_lib.ConfigError(f"config field data.global_batch: {config.data.global_batch} "
                                 f"must be divisible by the {pcount} processes")
  base_wd = checkpoint.resolve(f.base_workdir)[0]
  start = (saved_steps(workdir) or [0])[-1]
  resume_dir = os.path.join(workdir, ADAPTER_DIR, str(start)) if start else None
  path = _candidate_path(f)
  if resume_dir:
    _, saved_cfg, saved_base = focus_adapter.load_adapter(resume_dir)
    if os.path.abspath(saved_base) != base_wd:
      raise config_lib.ConfigError(f"config field focus.base_workdir: {base_wd} differs from "
                                   f"{saved_base}, the base of the adapter in {resume_dir}")
    if saved_cfg.candidate_path != path:   # the adapter's leaves differ between paths
      raise config_lib.ConfigError(f"config field focus.candidate_path: {path!r}, but the adapter "
                                   f"in {resume_dir} was trained with "
                                   f"{saved_cfg.candidate_path!r}")
  loaded, adapter = focus_adapter.from_workdir(f.base_workdir, adapter_dir=resume_dir,
                                               base_attention=f.base_attention,
                                               candidate_path=path)
  if primary:
    checkpoint.write_config(workdir, config)
  sizes = focus_samples.chunk_sizes(config)
  save_cfg = focus_config(config, max(sizes))   # the largest chunk: the inference default

  mesh = sharding.make_mesh(config.mesh.data, config.mesh.fsdp, config.mesh.tensor)
  graphdef, base_state = nnx.split(loaded.model)
  base_sh = sharding.param_shardings(base_state, mesh)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  batch_sh = {"memory": sharding.batch_sharding(mesh), "tokens": sharding.batch_sharding(mesh),
              "reconstruction": jax.sharding.NamedSharding(mesh, sharding.spec(("batch",))),
              "key_at": jax.sharding.NamedSharding(mesh, sharding.spec(("batch",)))}
  dtype = jnp.dtype(config.train.compute_dtype)
  base_params = jax.device_put(jax.tree.map(lambda p: jnp.asarray(p, dtype),
                                            nnx.to_pure_dict(base_state)), base_sh)
  optim_cfg = config_lib.optim_config(config)
  tx = optim.make(optim_cfg, adapter)
  adapter = jax.device_put(adapter, replicated)
  opt_state = jax.device_put(tx.init(adapter), replicated)
  if resume_dir:
    with np.load(os.path.join(resume_dir, "opt_state.npz")) as z:
      leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
    opt_state = jax.device_put(jax.tree.unflatten(jax.tree.structure(opt_state), leaves),
                               replicated)

  def step_fn(s: int):
    return jax.jit(functools.partial(
        train_step, graphdef=graphdef, tx=tx,
        cfg=focus_config(config, s),
        num_targets=f.num_targets, skip_nonfinite=config.train.nonfinite == "skip",
        answer_weight=float(f.get("answer_weight", 1.0))),
        in_shardings=(replicated, replicated, base_sh, batch_sh),
        out_shardings=(replicated, replicated, replicated), donate_argnums=(0, 1))
  step_fns = {s: step_fn(s) for s in sizes}   # jit compiles each (s, M) on its first call
  if dry_run:
    return _dry_run(config, step_fns, (adapter, opt_state, base_params), batch_sh, mesh)

  sampler = focus_samples.Sampler(config, loaded.tokenizer, jax.process_index(),
                                  config.data.global_batch // pcount)
  steps = config.train.steps
  writer = metrics.Writer(workdir, steps, start, enabled=primary)
  if start:
    writer.message(f"resumed the adapter from step {start} in {workdir}")
  lr_at = optim.schedule(optim_cfg)
  preempt = trainer.Preemption()
  summary = {"start_step": start}
  acc, t_last, step, pending = [], time.perf_counter(), start, None
  waited = 0.0   # seconds the loop waited for the sampler in this logging interval

  def finish(pending):
    nonlocal acc, t_last, waited
    pstep, chunk, tokens, m = pending
    m = jax.device_get(m)
    if not m["finite"]:
      if config.train.nonfinite != "skip":
        raise trainer.NonFiniteLoss(f"non-finite loss ({m['loss']}) at step {pstep} (chunk "
                                    f"{chunk}); stopping (train.nonfinite=skip skips such steps)")
      writer.message(f"step {pstep}: non-finite loss ({m['loss']}); update skipped")
    summary["loss"] = float(m["loss"])
    acc.append((m, tokens))
    if pstep % config.train.log_every == 0 or pstep == steps:
      # Means over the logging interval: each step draws its own chunk size, so one is noisy.
      now = time.perf_counter()
      sums = {k: sum(float(a[k]) for a, _ in acc) for k in acc[0][0] if k != "finite"}
      scalars = {"loss": sums["loss"] / len(acc), "grad_norm": sums["grad_norm"] / len(acc),
                 "lr": lr_at(pstep - 1), "chunk_size": chunk,
                 "tokens_per_s": sum(t for _, t in acc) / max(now - t_last, 1e-9),
                 # Near 0 when the prefetch keeps up; near 1 when the host, not the device, paces.
                 "host_wait_frac": waited / max(now - t_last, 1e-9)}
      for task, key in (("continuation", "cont"), ("reconstruction", "recon"), ("key", "key")):
        if sums[f"{key}_n"]:
          scalars[f"loss_{task}"] = sums[f"{key}_sum"] / sums[f"{key}_n"]
      writer.write(pstep, scalars)
      writer.progress(pstep, scalars)
      acc, t_last, waited = [], now, 0.0

  batches = focus_samples.prefetch(sampler, start, steps)
  try:
    with jax.set_mesh(mesh):
      asked = time.perf_counter()
      for step, local in batches:
        waited += time.perf_counter() - asked
        chunk, M = sampler.shape(step)
        batch = {k: jax.make_array_from_process_local_data(batch_sh[k], v)
                 for k, v in local.items()}
        adapter, opt_state, m = step_fns[chunk](adapter, opt_state, base_params, batch)
        step += 1
        if pending is not None:
          finish(pending)   # after dispatching this step: the device never waits for the host
        pending = (step, chunk, config.data.global_batch * (M + f.local_len), m)
        preempted = preempt.reached(step)  # one agreed step on every host
        stopping = preempted or step == stop_at
        if step % config.train.ckpt_every == 0 or step == steps or stopping:
          if primary:
            summary["adapter_dir"] = _save(workdir, step, adapter, opt_state, save_cfg, base_wd,
                                           config.train.keep_ckpts)
        if preempted:
          writer.message(f"SIGTERM: saved the adapter at step {step} to {workdir}; exiting")
          summary["preempted"] = True
          break
        if stopping:
          break
        asked = time.perf_counter()
      if pending is not None:
        finish(pending)
  finally:
    batches.close()
    writer.close()
    preempt.restore()
  summary["step"] = step
  if primary and not summary.get("preempted"):
    # A resumed run already at train.steps trains nothing and has no loss to report.
    loss = f"loss {summary['loss']:.4f}" if "loss" in summary else "nothing left to train"
    print(f"trained the FocusLLM adapter {step} steps; {loss}; adapter in "
          f"{workdir}/{ADAPTER_DIR}/{step}")
  return summary
