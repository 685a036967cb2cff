"""Benchmark: FocusLLM decoding against the base's own long-context decoding (tokens/s, memory).

  python bench/focus_decode.py --out focus_decode.json                   # GPU: 400m, 8x and 32x
  python bench/focus_decode.py --focus_impl pallas --out focus_decode_pallas.json
  python bench/focus_decode.py --size 100m --chunk_size 512 --prompt_len 256 --local_len 512 \
    --focus_impl pallas --modes batched,base --batch 1,8 --out focus_decode_100m.json
  python bench/focus_decode.py --smoke --out /tmp/focus_decode.json     # CPU: tiny, seconds

Random weights (timing only), cast to --dtype. At total length L = m x context the input is a
memory of L - local_len tokens (chunks of --chunk_size) and a local window of local_len tokens.
Modes:
  batched     focus_generate.prefill + decode: every chunk in one batch (rows = batch x chunks);
              each step extends every chunk's cache by one token and condenses all new candidates
              in one pass per layer, and all steps run as one compiled loop over a donated state.
  stepwise    the same steps through focus_generate.step, one dispatch per token: stepwise /
              batched is the host's per-token cost.
  sequential  the same focus/model.py functions on one chunk at a time (C = 1 slices, one
              compile): the prefill and, each step, the cache extension and the candidate run in
              a Python loop over chunks, then one local-decoder pass over all candidates (the
              official code's schedule). batched / sequential is the batching gain.
  local       batched with no memory: the local decoder's rerun over the window alone. Every step
              changes every chunk's candidate, so exact FocusLLM reruns the window each step;
              batched - local is the chunks' share of the step.
  base        the base alone over all L tokens: model.init_cache / forward_cached, full causal
              attention, RoPE NTK-scaled to L (as generate.py). Reported as an error where it
              does not fit.
Each entry is warmed up (prefill + 2 steps, or the whole loop for batched and local, compiling
everything), then timed: prefill_s (the prefill, which also yields the first new token's logits;
prefill_tok_per_s = batch x length / prefill_s),
step_ms = 1000 decode_s / (new_tokens - 1), the mean step of the new_tokens - 1 steps after it
(block_until_ready at the end), and tok_per_s = batch x (new_tokens - 1) / decode_s. --batch takes
a comma list: every batch size runs every mode and multiplier.
peak_GiB is the device's peak_bytes_in_use (None on CPU); with --isolate (default unless --smoke)
every entry runs in a fresh process so the peak is its own, otherwise it is the process peak so
far. focus.frozen_prefill allocates the chunk caches in the base's dtype (--dtype); the focus
modes' chunk prefill runs the base with --chunk_attention (default xla; cudnn needs 16-bit).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from configs import base as base_config  # pylint: disable=wrong-import-position
from focaljax import config as config_lib  # pylint: disable=wrong-import-position
from focaljax.focus import model as focus  # pylint: disable=wrong-import-position
from focaljax.focus import evaluate as focus_eval  # pylint: disable=wrong-import-position
from focaljax.focus import generate as focus_generate  # pylint: disable=wrong-import-position
from focaljax.model import decoder as model_lib  # pylint: disable=wrong-import-position

MODES = ("batched", "stepwise", "sequential", "local", "base")
DEFAULT_MODES = ("batched", "sequential", "base")
GPU = dict(size="400m", chunk_size=1024, prompt_len=512, local_len=1024, new_tokens=32,
           multipliers="8,32")
# The small preset's 64-token context holds at most 64 - 32 - 2 = 30 candidates before the local
# window: 8x and 3 new tokens is the most that fits.
SMOKE = dict(size="small", chunk_size=16, prompt_len=8, local_len=32, new_tokens=3,
             multipliers="8")


def build(args, mode: str):
  """(base Transformer cast to dtype, adapter, FocusConfig); context = the size's data.seq_len.
  The same weights in every mode (seed 0); only the base's attention implementation differs."""
  c = base_config.get_config(f"size={args.size}")
  c.model.attention.implementation = (args.base_attention if mode == "base" else
                                      args.chunk_attention)
  cfg = config_lib.model_config(c, 32000 if not args.smoke else 512)
  dtype = jnp.dtype(args.dtype)
  base = model_lib.Transformer(cfg, nnx.Rngs(0))
  graphdef, state = nnx.split(base)
  base = nnx.merge(graphdef, focus_eval.cast(state, dtype))
  fcfg = focus.FocusConfig(chunk_size=args.chunk_size, prompt_len=args.prompt_len,
                           implementation=args.focus_impl)
  return base, focus.init_adapter(base), fcfg


def _tokens(B, n, seed, vocab):
  return jax.random.randint(jax.random.key(seed), (B, n), 1, vocab, dtype=jnp.int32)


def _sync(x):
  return jax.block_until_ready(x)


def _stepper(step):
  """run(state, logits, n) for a per-token step(state, token) -> (state, logits)."""
  def run(st, logits, n):
    for _ in range(n):
      st, logits = step(st, jnp.argmax(logits, -1).astype(jnp.int32))
    return logits
  return run


def batched(base, adapter, cfg, memory, local, new, fused=True):
  """A start() -> (state, first logits, run) for focus_generate (jitted at module level): the
  steps as one decode loop (fused) or one step call per token."""
  def run(st, logits, n):
    return focus_generate.decode(adapter, base, st, logits, n)[1]

  def start():
    state, logits = focus_generate.prefill(adapter, base, memory, local, cfg, new)
    return state, logits, run if fused else _stepper(
        lambda st, tok: focus_generate.step(adapter, base, st, tok))
  return start


@jax.jit
def _concat_kv(kvs):
  return [(jnp.concatenate([kv[i][0] for kv in kvs], 1),
           jnp.concatenate([kv[i][1] for kv in kvs], 1)) for i in range(len(kvs[0]))]


def _seq_fns(graphdef, cfg, T, new):
  impl, P = cfg.implementation, cfg.prompt_tokens(T)

  @jax.jit
  def prefill_one(base_state, adapter, chunk_BS, local_BT):
    base = nnx.merge(graphdef, base_state)
    _, kv, caches = focus.condense(adapter, base, chunk_BS, local_BT[:, T - P:], 1, cfg,
                                   extra=new - 1)
    return caches, [(k[:, :, 0], v[:, :, 0]) for k, v in kv]   # [B, 1, K, D]

  @jax.jit
  def step_one(base_state, adapter, caches, prev_B, token_B, pos):
    base = nnx.merge(graphdef, base_state)
    theta = base.cfg.rope_theta
    caches = focus.frozen_step(base, caches, prev_B[:, None], pos, theta)
    _, kv = focus.candidates(adapter, base, caches, token_B[:, None],
                             jnp.full((token_B.shape[0], 1), pos + 1), theta, implementation=impl)
    return caches, [(k[:, :1], v[:, :1]) for k, v in kv]

  @jax.jit
  def local(base_state, tokens_BL, kv, index):
    base = nnx.merge(graphdef, base_state)
    return focus.local_logits(base, tokens_BL, kv, base.cfg.rope_theta, implementation=impl,
                              at_B=jnp.full((tokens_BL.shape[0],), index))

  return prefill_one, step_one, local


def sequential(base, adapter, cfg, memory, local, new):
  """A start() for the one-chunk-at-a-time schedule; the jitted pieces are built once."""
  graphdef, base_state = nnx.split(base)
  B, T = local.shape
  s = cfg.chunk_size
  # The same refusal as focus_generate.prefill: this loop calls the pieces beneath it.
  focus.check_positions(base.cfg, cfg, T, cfg.prompt_tokens(T), extra=new - 1,
                        memory_len=memory.shape[1])
  prefill_one, step_one, local_fn = _seq_fns(graphdef, cfg, T, new)

  def step(st, token_B):
    prev = st["tokens"][:, st["length"] - 1]
    tokens = st["tokens"].at[:, st["length"]].set(token_B)
    out = [step_one(base_state, adapter, c, prev, token_B, st["pos"]) for c in st["caches"]]
    st = {"tokens": tokens, "length": st["length"] + 1, "pos": st["pos"] + 1,
          "caches": [c for c, _ in out], "kvs": [kv for _, kv in out]}
    return st, local_fn(base_state, tokens, _concat_kv(st["kvs"]), st["length"] - 1)

  def start():
    chunks = [prefill_one(base_state, adapter, memory[:, c * s:(c + 1) * s], local)
              for c in range(memory.shape[1] // s)]
    tokens = jnp.zeros((B, T + new - 1), jnp.int32).at[:, :T].set(local)
    st = {"tokens": tokens, "length": T, "pos": cfg.chunk_size + cfg.prompt_tokens(T) - 1,
          "caches": [c for c, _ in chunks], "kvs": [kv for _, kv in chunks]}
    return st, local_fn(base_state, tokens, _concat_kv(st["kvs"]), T - 1), _stepper(step)

  return start


def full_attention(base, memory, local, new, dtype):
  """A start() for the base over memory + local with a KV cache (generate.py's decoding)."""
  graphdef, state = nnx.split(base)
  prompt = jnp.concatenate([memory, local], 1)
  L = prompt.shape[1] + new
  prefill = jax.jit(lambda st, p: _base_prefill(graphdef, st, p, L, dtype))
  stepf = jax.jit(lambda st, c, tok, pos: _base_step(graphdef, st, c, tok, pos, L, dtype),
                  donate_argnums=1)

  def step(st, token_B):
    logits, caches = stepf(state, st["caches"], token_B, st["pos"])
    return {"caches": caches, "pos": st["pos"] + 1}, logits

  def start():
    logits, caches = prefill(state, prompt)
    return {"caches": caches, "pos": prompt.shape[1]}, logits, _stepper(step)

  return start


def _base_prefill(graphdef, state, prompt_BT, max_len, dtype):
  model = nnx.merge(graphdef, state)
  caches = model.init_cache(prompt_BT.shape[0], max_len, dtype)
  logits_BTV, caches = model.forward_cached(prompt_BT, caches, 0, rope_length=max_len, dtype=dtype)
  return logits_BTV[:, -1], caches


def _base_step(graphdef, state, caches, token_B, pos, max_len, dtype):
  model = nnx.merge(graphdef, state)
  logits_BTV, caches = model.forward_cached(token_B[:, None], caches, pos, rope_length=max_len,
                                            dtype=dtype)
  return logits_BTV[:, 0], caches


def _decode(start, new):
  """(prefill seconds, decode seconds) of one greedy generation of `new` tokens."""
  t0 = time.perf_counter()
  st, logits, run = start()
  _sync(logits)
  t1 = time.perf_counter()
  logits = run(st, logits, new - 1)
  _sync(logits)
  return t1 - t0, time.perf_counter() - t1


def entry(args, mode: str, multiplier: int, B: int) -> dict:
  base, adapter, cfg = build(args, mode)
  ctx, T, new = base.cfg.max_seq_len, args.local_len, args.new_tokens
  L = multiplier * ctx
  row = dict(mode=mode, multiplier=multiplier, length=L, context=ctx, batch=B, new_tokens=new,
             chunk_size=cfg.chunk_size,
             num_chunks={"base": None, "local": 0}.get(mode, (L - T) // cfg.chunk_size),
             focus_impl=cfg.implementation)
  memory = _tokens(B, L - T, 1, base.cfg.vocab_size)
  local = _tokens(B, T, 2, base.cfg.vocab_size)
  try:
    start = {"batched": lambda: batched(base, adapter, cfg, memory, local, new),
             "stepwise": lambda: batched(base, adapter, cfg, memory, local, new, fused=False),
             "local": lambda: batched(base, adapter, cfg, memory[:, :0], local, new),
             "sequential": lambda: sequential(base, adapter, cfg, memory, local, new),
             "base": lambda: full_attention(base, memory, local, new, jnp.dtype(args.dtype))
             }[mode]()
    # Compiles prefill and step; the fused loop compiles per step count, so it warms up whole.
    _decode(start, new if mode in ("batched", "local") else min(new, 3))
    prefill_s, decode_s = _decode(start, new)
    row.update(prefill_s=prefill_s, prefill_tok_per_s=B * L / prefill_s,
               decode_s=decode_s,
               step_ms=1e3 * decode_s / (new - 1) if new > 1 else None,
               tok_per_s=B * (new - 1) / decode_s if new > 1 else None)
  except Exception as e:  # pylint: disable=broad-except
    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if os.environ.get("BENCH_TRACEBACK"):
      traceback.print_exc()
  stats = jax.devices()[0].memory_stats() or {}
  peak = stats.get("peak_bytes_in_use")
  row["peak_GiB"] = None if peak is None else peak / 2**30
  return row


def _print(row):
  f = lambda k, w, p: f"{row[k]:{w}.{p}f}" if row.get(k) is not None else f"{'-':>{w}}"
  print(f"{row['mode']:<11} {row['multiplier']:>4}x {row.get('batch', '-'):>5} "
        f"{f('length', 8, 0)} {f('num_chunks', 6, 0)} {f('prefill_s', 10, 3)} "
        f"{f('step_ms', 9, 2)} {f('tok_per_s', 10, 2)} {f('peak_GiB', 9, 2)}  "
        f"{row.get('error', '')}", flush=True)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="write the rows as JSON here")
  ap.add_argument("--smoke", action="store_true", help="tiny model on CPU")
  ap.add_argument("--size", default=None,
                  help="configs/sizes.py preset (default 400m; smoke: small)")
  ap.add_argument("--chunk_size", type=int, default=None)
  ap.add_argument("--prompt_len", type=int, default=None)
  ap.add_argument("--local_len", type=int, default=None)
  ap.add_argument("--new_tokens", type=int, default=None)
  ap.add_argument("--multipliers", default=None, help="comma list of L / context (default 8,32)")
  ap.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma list of {MODES}")
  ap.add_argument("--batch", default="1", help="comma list of batch sizes")
  ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
  ap.add_argument("--focus_impl", default="xla", choices=["xla", "pallas"])
  ap.add_argument("--base_attention", default="auto",
                  help="model.attention.implementation of the base mode")
  ap.add_argument("--chunk_attention", default="xla",
                  help="the same for the focus modes' frozen chunk prefill (focus/train.py "
                  "with_attention: cudnn needs a 16-bit --dtype)")
  ap.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                  help="one process per entry (default: on unless --smoke)")
  ap.add_argument("--entry", default=None, help=argparse.SUPPRESS)  # mode:multiplier (child)
  args = ap.parse_args(argv)
  for k, v in (SMOKE if args.smoke else GPU).items():
    if getattr(args, k) is None:
      setattr(args, k, v)
  if args.smoke:
    args.dtype = "float32"
  if args.entry:
    mode, m, b = args.entry.split(":")
    print("ROW " + json.dumps(entry(args, mode, int(m), int(b))), flush=True)
    return
  modes = [m for m in args.modes.split(",") if m]
  bad = set(modes) - set(MODES)
  if bad:
    raise SystemExit(f"--modes: unknown {sorted(bad)}; allowed: {MODES}")
  isolate = (not args.smoke) if args.isolate is None else args.isolate
  print(f"size={args.size} chunk={args.chunk_size} prompt={args.prompt_len} local={args.local_len}"
        f" new={args.new_tokens} batch={args.batch} dtype={args.dtype} focus_impl="
        f"{args.focus_impl} base_attention={args.base_attention} chunk_attention="
        f"{args.chunk_attention} isolate={isolate}")
  print(f"{'mode':<11} {'x':>5} {'batch':>5} {'length':>8} {'chunks':>6} {'prefill_s':>10} "
        f"{'step_ms':>9} {'tok/s':>10} {'peak_GiB':>9}")
  rows = []
  for b, m, mode in itertools.product([int(x) for x in args.batch.split(",")],
                                      [int(x) for x in args.multipliers.split(",")], modes):
    if isolate:
      # The parent never touches the device, so each child has it to itself.
      argv_child = argv if argv is not None else sys.argv[1:]   # a child never writes --out
      proc = subprocess.run([sys.executable, os.path.abspath(__file__), *argv_child,
                             f"--entry={mode}:{m}:{b}"], capture_output=True, text=True)
      lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
      row = json.loads(lines[-1][4:]) if lines else dict(
          mode=mode, multiplier=m, batch=b, length=None, num_chunks=None,
          error=f"child exited {proc.returncode}: {proc.stderr.strip()[-300:]}")
    else:
      row = entry(args, mode, m, b)
    rows.append(row)
    _print(row)
  if args.out:
    with open(args.out, "w") as f:
      json.dump({"args": vars(args), "rows": rows}, f, indent=2)
    print(f"wrote {len(rows)} rows to {args.out}")


if __name__ == "__main__":
  main()
