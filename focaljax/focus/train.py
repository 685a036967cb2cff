"""FocusLLM training (configs/focus.py) through train/loop.py: the adapter trains (replicated,
copied from the base's projections), the base is frozen (closed over by the loss, never saved).
Samples are a pure function of (seed, step, process); each step draws a chunk size and a memory
length (whole chunks; one compile per pair) and, per sample, a continuation (memory, then the
window), a reconstruction (p_reconstruction: the window copies a span of the memory) or a passkey
drill (retrieval_mix: a needle in the memory, the question and key ending the window).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import functools
import os
import re
import typing

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from flax import nnx

from focaljax import config as config_lib
from focaljax import sharding
from focaljax.data import pipeline as data_lib
from focaljax.data import retrieval
from focaljax.evaluation import loading
from focaljax.focus import model as focus
from focaljax.model import decoder as model_lib
from focaljax.train import checkpoint
from focaljax.train import loop
from focaljax.train import optim

_MAX_DRAWS = 1000   # document draws per sample before concluding the source has no long documents
_CACHE_BYTES = 512 << 20   # token ids kept per process: the corpus's long documents fit
# Batches built ahead on worker threads (0: on the training thread). The tokenizer releases the
# GIL, so until the cache holds the documents the threads tokenize in parallel.
_CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 2
PREFETCH = max(2, min(8, _CORES - 1))


class Sampler:
  """Batches as a pure function of (seed, step, process): resumable without iterator state."""

  def __init__(self, f: config_lib.FocusTrainConfig, data, seed: int, tokenizer,
               process_index: int, local_batch: int):
    self.f, self.seed, self.pidx, self.local_batch = f, seed, process_index, local_batch
    self.tok = tokenizer
    self._question_len = len(tokenizer.encode(retrieval.PASSKEY_QUESTION))
    if f.retrieval_mix:   # every drill fits, whatever key it draws: refused once, up front
      needle, tail, answer = retrieval.drill_sizes(tokenizer)
      memory = min(s * (m // s) for s in f.chunk_sizes for m in f.memory_tokens)
      self._check_drill(needle, tail, answer, memory)
    self.docs = data_lib.documents(data, "train")
    # Token ids of re-drawn documents, text cut first (books run to 1M tokens).
    n = f.doc_max_tokens
    self._tokens = functools.lru_cache(maxsize=max(64, _CACHE_BYTES // (4 * n)))(
        lambda i: np.asarray(tokenizer.encode(self.docs[i][:16 * n])[:n], np.int32))
    # Too-short documents are not tokenized again; a skip still consumes its draw.
    self._short: set[int] = set()

  def shape(self, step: int) -> tuple[int, int]:
    """(chunk size, memory length) of the step, the same on every process; the memory draw has
    its own stream, so adding lengths leaves every step's chunk size as it was."""
    sizes, memories = self.f.chunk_sizes, self.f.memory_tokens
    s = sizes[np.random.default_rng([self.seed, step]).integers(len(sizes))]
    m = memories[np.random.default_rng([self.seed, step, 2]).integers(len(memories))]
    return s, s * (m // s)   # whole chunks

  def _document(self, rng) -> np.ndarray:
    for _ in range(_MAX_DRAWS):
      i = int(rng.integers(len(self.docs)))
      if i in self._short:
        continue
      ids = self._tokens(i)
      if len(ids) >= self.f.doc_min_tokens:
        return ids
      self._short.add(i)
    raise config_lib.ConfigError(
        f"config field focus.doc_min_tokens: {_MAX_DRAWS} random documents of data.source were "
        f"all shorter than {self.f.doc_min_tokens} tokens; lower it or use a source with longer "
        "documents")

  def _drill(self, memory, local, rng) -> tuple[np.ndarray, np.ndarray, int]:
    """A needle over a random stretch of the memory, the window ending with the question and " K."
    -> (memory, local tokens, key_at: where the answer starts among the num_targets targets)."""
    needle, tail = retrieval.drill_pieces(self.tok, rng)
    answer = len(tail) - self._question_len
    self._check_drill(len(needle), len(tail), answer, len(memory))
    memory = memory.copy()
    at = int(rng.integers(len(memory) - len(needle) + 1))
    memory[at:at + len(needle)] = needle
    context = local[:len(local) - len(tail)]
    return (memory, np.concatenate([context, np.asarray(tail, np.int32)]),
            self.f.num_targets - answer)

  def _check_drill(self, needle: int, tail: int, answer: int, memory: int) -> None:
    if needle > memory or tail > self.f.local_len + 1 or answer > self.f.num_targets:
      raise config_lib.ConfigError(
          f"config field focus.retrieval_mix: a drill needs a memory of >= {needle} tokens "
          f"(shortest: {memory}), a local window of >= {tail - 1} (question and key; "
          f"focus.local_len={self.f.local_len}) and focus.num_targets >= {answer} (the key; "
          f"{self.f.num_targets})")

  def batch(self, step: int) -> dict[str, np.ndarray]:
    """memory int32 [b, M], tokens int32 [b, local_len + 1], reconstruction float32 [b],
    key_at int32 [b]: where a drill's answer " K." starts among the last num_targets, or -1."""
    _, M = self.shape(step)
    T = self.f.local_len
    rng = np.random.default_rng([self.seed, step, self.pidx, 1])
    memory, tokens, recon, key_at = [], [], [], []
    for _ in range(self.local_batch):
      ids = self._document(rng)
      is_recon, at = rng.random() < self.f.p_reconstruction, -1
      n = M if is_recon else M + T + 1
      window = ids[(o := rng.integers(len(ids) - n + 1)):o + n]
      memory.append(window[:M])
      if is_recon:
        tokens.append(window[(r := rng.integers(M - T)):r + T + 1])
      elif rng.random() < self.f.retrieval_mix:
        memory[-1], local, at = self._drill(window[:M], window[M:], rng)
        tokens.append(local)
      else:
        tokens.append(window[M:])
      recon.append(float(is_recon))
      key_at.append(at)
    return {"memory": np.stack(memory), "tokens": np.stack(tokens),
            "reconstruction": np.asarray(recon, np.float32),
            "key_at": np.asarray(key_at, np.int32)}


def prefetch(sampler: Sampler, start: int, stop: int, depth: int | None = None):
  """Yields (step, sampler.batch(step)) for steps [start, stop), `depth` batches ahead on worker
  threads (batches are pure functions of the step). Close the generator to stop the workers."""
  depth = PREFETCH if depth is None else depth
  if depth == 0:
    yield from ((step, sampler.batch(step)) for step in range(start, stop))
    return
  with concurrent.futures.ThreadPoolExecutor(depth, thread_name_prefix="focus-sampler") as pool:
    ahead = collections.deque(pool.submit(sampler.batch, s)
                              for s in range(start, min(start + depth, stop)))
    try:
      for step in range(start, stop):
        if step + depth < stop:
          ahead.append(pool.submit(sampler.batch, step + depth))
        yield step, ahead.popleft().result()
    finally:
      for future in ahead:
        future.cancel()


def meta(cfg: focus.FocusConfig, *, trained_prompt_len: int, local_len: int,
         base_workdir: str, base_step: int | None = None) -> dict:
  """A checkpoint's meta; `cfg` is the adapter as served (largest chunk, focus.eval_prompt_len);
  base_step: the base checkpoint it trains over (None: not known, a converted .npz run)."""
  return {"focus": dataclasses.asdict(cfg), "trained_prompt_len": trained_prompt_len,
          "local_len": local_len, "base_workdir": base_workdir, "base_step": base_step}


def with_attention(model, implementation: str):
  """The same weights with the base's attention implementation replaced: cuDNN refuses chunk
  caches with room for later tokens and the Pallas kernels cannot tile a chunk's length (chunk +
  prompt - 1), so FocusLLM runs the base's as "xla"."""
  cfg = dataclasses.replace(model.cfg, attention=dataclasses.replace(
      model.cfg.attention, implementation=implementation))
  graphdef, _ = model_lib.abstract_model(cfg)
  return nnx.merge(graphdef, nnx.state(model))


def resolve(path: str) -> tuple[str, int | None]:
  """(run workdir, step) of a FocusLLM run workdir (None: latest) or a checkpoints/<step> in it."""
  p = epath.Path(checkpoint.absolute(path))
  if p.parent.name == "checkpoints" and p.name.isdigit():
    return str(p.parent.parent), checkpoint.step_dir(p)
  if checkpoint.latest_step(str(p)) is not None:
    return str(p), None
  if (p / "adapter").is_dir():   # the layout before Orbax checkpoints (focus/legacy.py)
    raise FileNotFoundError(f"{path} keeps its adapter in the old .npz layout; convert it with: "
                            f"python -m focaljax.focus.legacy {path}")
  raise FileNotFoundError(f"{path} is neither a FocusLLM run workdir (no checkpoints/<step>) nor "
                          "a checkpoints/<step> directory inside one")


class StepShape(typing.NamedTuple):
  """A FocusLLM step's compile key: its chunk size and memory length."""
  chunk: int
  memory: int

  def __str__(self):
    return f"chunk {self.chunk}, memory {self.memory}"


class NotAnAdapter(ValueError):
  """A path holds no FocusLLM adapter, or one trained on another base."""


def load(path: str, base) -> tuple[dict, focus.FocusConfig, dict]:
  """(adapter, FocusConfig, meta + {"workdir", "step"}) of a run workdir (latest checkpoint) or
  one of its checkpoints/<step>, restored onto the shapes of `base`."""
  workdir, step = resolve(path)
  try:
    saved, step = checkpoint.read_meta(workdir, step)
  except KeyError:   # checkpoints with params alone
    saved = {}
  if "focus" not in saved:
    raise NotAnAdapter(f"{workdir}: its checkpoints hold no FocusLLM adapter (a language model's "
                     "workdir?)")
  cfg = focus.FocusConfig(**saved["focus"])
  like = checkpoint.abstract_like(jax.eval_shape(
      lambda: focus.init_adapter(base, cfg.candidate_path)))
  try:
    adapter, step = checkpoint.restore_params(workdir, step, like)
  except ValueError as e:   # Orbax's tree mismatch: its first line only
    raise NotAnAdapter(f"{workdir}: the adapter does not fit this base "
                       f"({str(e).splitlines()[0].rstrip(':')}); is the base the adapter's, "
                       f"{saved['base_workdir']}?") from None
  return adapter, cfg, {**saved, "workdir": workdir, "step": step}


def answer_nll_sum(nll_BQ, key_at_B):
  """Σ of the NLL of targets key_at.. (a drill's answer " K."); rows with key_at = -1 add 0."""
  in_answer_BQ = (jnp.arange(nll_BQ.shape[1])[None] >= key_at_B[:, None]) & (key_at_B[:, None] >= 0)
  return jnp.where(in_answer_BQ, nll_BQ, 0.0).sum()


def loss(adapter, base_params, batch, *, graphdef, cfg: focus.FocusConfig, num_targets: int):
  """(Σ target NLL, (targets, per-task sums)) of a batch (loop.LossFn)."""
  base = nnx.merge(graphdef, base_params)
  nll_BQ = focus.target_nll(adapter, base, batch["memory"], batch["tokens"], cfg, num_targets)
  nll_B, r_B = nll_BQ.mean(axis=1), batch["reconstruction"]
  # loss_key, the drills' answer NLL, says whether the memory reaches the local decoder: about
  # ln(90000) ≈ 11.4 is knowing only that a 5-digit key comes, ~0 is reading it.
  sums = {"loss_continuation": ((nll_B * (1 - r_B)).sum(), (1 - r_B).sum()),
          "loss_reconstruction": ((nll_B * r_B).sum(), r_B.sum()),
          "loss_key": (answer_nll_sum(nll_BQ, batch["key_at"]),
                       (batch["key_at"] >= 0).sum().astype(jnp.float32))}
  return nll_BQ.sum(), (jnp.float32(nll_BQ.size), sums)


def _check_resume(f: config_lib.FocusTrainConfig, workdir: str, base_step: int) -> None:
  """A resume goes on over the base checkpoint the adapter trained over (a base workdir trained
  on since is refused; its step pinned as checkpoints/<step> resumes)."""
  if checkpoint.latest_step(workdir) is None:
    return
  saved, step = checkpoint.read_meta(workdir, None)
  where = f"the adapter in {workdir}/checkpoints/{step}"
  over = saved.get("base_step")   # None: saved before it was recorded
  root = re.sub(r"/checkpoints/\d+$", "", saved["base_workdir"])
  pinned = f"{root}/checkpoints/{over}"
  if saved["base_workdir"] != f.base_workdir and f.base_workdir != pinned:
    raise config_lib.ConfigError(f"config field focus.base_workdir: {f.base_workdir} differs from "
                                 f"{saved['base_workdir']}, the base of {where}")
  if over is not None and over != base_step:
    raise config_lib.ConfigError(
        f"config field focus.base_workdir: {f.base_workdir} is at step {base_step}, but {where} "
        f"trained over its step {over}; resume with focus.base_workdir={pinned}, or train a new "
        "adapter in another --workdir")
  if saved["focus"]["candidate_path"] != f.candidate_path:   # the adapters' leaves differ
    raise config_lib.ConfigError(
        f"config field focus.candidate_path: {f.candidate_path!r}, but {where} was trained with "
        f"{saved['focus']['candidate_path']!r}")


def task(cfg: config_lib.Config, workdir: str, mesh) -> loop.Task:
  """The loop.Task of a FocusLLM adapter run over the frozen base focus.base_workdir."""
  f = cfg.focus
  base = loading.load(f.base_workdir)
  _check_resume(f, workdir, base.step)
  graphdef, base_state = nnx.split(with_attention(base.model, "xla"))
  try:
    base_sh = sharding.param_shardings(base_state, mesh)
  except ValueError as e:   # a mesh axis that does not divide one of the base's weights
    raise config_lib.ConfigError(f"config field mesh: {e}") from None
  dtype = jnp.dtype(cfg.train.compute_dtype)
  base_params = sharding.put(jax.tree.map(lambda p: jnp.asarray(p, dtype),
                                          nnx.to_pure_dict(base_state)), base_sh)
  adapter = focus.init_adapter(base.model, f.candidate_path)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  rows = jax.sharding.NamedSharding(mesh, sharding.spec(("batch",)))
  batch_sh = {"memory": sharding.batch_sharding(mesh), "tokens": sharding.batch_sharding(mesh),
              "reconstruction": rows, "key_at": rows}
  B, T = cfg.data.global_batch, f.local_len
  sampler = Sampler(f, cfg.data, cfg.seed, base.tokenizer, jax.process_index(),
                    B // jax.process_count())

  def focus_cfg(chunk: int, prompt_len: int) -> focus.FocusConfig:
    return focus.FocusConfig(chunk, prompt_len=prompt_len, implementation=f.implementation,
                             candidate_path=f.candidate_path)

  def batches(start):
    ahead = prefetch(sampler, start, cfg.train.steps)
    try:
      for step, local in ahead:
        chunk, M = sampler.shape(step)
        # One compiled step per (chunk size, memory length): the batch's shapes.
        yield loop.Batch(local, key=StepShape(chunk, M), tokens=B * (M + T),
                         info={"chunk_size": chunk})
    finally:
      ahead.close()

  def abstract_batches():   # every (chunk size, memory length) a step can draw
    shapes = lambda M: {"memory": (B, M), "tokens": (B, T + 1), "reconstruction": (B,),
                        "key_at": (B,)}
    keys = {StepShape(s, s * (m // s)) for s in f.chunk_sizes for m in f.memory_tokens}
    return {key: {k: jax.ShapeDtypeStruct(v, jnp.float32 if k == "reconstruction" else
                                             jnp.int32, sharding=batch_sh[k])
                     for k, v in shapes(key.memory).items()} for key in sorted(keys)}

  served = focus_cfg(max(f.chunk_sizes), f.eval_prompt_len or f.prompt_len)
  adapter_sh = jax.tree.map(lambda _: replicated, adapter)
  return loop.Task(
      params=sharding.put(adapter, adapter_sh),
      param_sh=adapter_sh,
      tx=optim.make(cfg.optim, adapter),
      loss=lambda key: functools.partial(loss, graphdef=graphdef,
                                         cfg=focus_cfg(key.chunk, f.prompt_len),
                                         num_targets=f.num_targets),
      batch_sh=batch_sh, batches=batches, abstract_batches=abstract_batches,
      frozen=base_params, frozen_sh=base_sh,
      meta=meta(served, trained_prompt_len=f.prompt_len, local_len=f.local_len,
                base_workdir=f.base_workdir, base_step=base.step),
      evaluate_with=f"python eval.py --workdir {f.base_workdir} --focus_adapter {workdir}")


def train(cfg: config_lib.Config, workdir: str, *, dry_run: bool = False,
          stop_at: int | None = None) -> dict:
  """Trains the FocusLLM adapter `cfg.focus` describes in `workdir` (loop.run)."""
  return loop.run(cfg, workdir, task, dry_run=dry_run, stop_at=stop_at)
