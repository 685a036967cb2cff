"""Dilution attention's tile sizes (`BlockSizes`), defaults and validation. "mosaic" falls back
to the Triton passes where `runs_mosaic` is False; each backend reads only its own fields.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

BACKENDS = ("triton", "mosaic")
B1_CARRIES = ("registers", "scratch")
F2_KEY_TILES = (1, 2)
MOSAIC_HEAD_DIMS = (64, 128)
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MOSAIC_TILE = 64    # rows and keys of every Mosaic tile
MOSAIC_CTA_ROWS = 128   # F1 (two 64-row tiles a CTA) and B2 (two 64-key blocks a CTA)
MIN_CKPT_ROWS = 64
_TILES = ("block_q_stats", "block_k_stats", "block_q", "block_k", "block_k_fwd", "b1_block_k",
          "block_k_decode", "split_k_decode")


@dataclasses.dataclass(frozen=True)
class BlockSizes:
  """Tile sizes (powers of two >= 16); class defaults are the D <= 64 ones."""
  # Triton passes.
  block_q_stats: int = 64     # F1 rows per program
  block_k_stats: int = 64     # F1 keys per loop step
  block_q: int = 32           # row tile of the key-parallel sweeps F2, B1, B2
  block_k: int = 64           # keys owned by one B2 program
  # F2's key block: wider cuts its float32 atomics; F2, B1 and B2 tile the keys independently.
  block_k_fwd: int = 128
  # B1's key block and where its mini-sweep keeps the tile carries: "scratch" (an HBM slice per
  # program) or "registers" ([R/block_q, b1_block_k], one-hot selects), the faster at each D.
  b1_block_k: int = 128
  b1_carries: str = "scratch"
  # R: rows between F2's carry checkpoints, ceil(T/R)·T·4 bytes per (batch, head).
  ckpt_rows: int = 1024
  block_k_decode: int = 128   # keys per decode loop step
  split_k_decode: int = 2048  # keys per decode program (flash-decoding split)
  # Mosaic passes. F2's 64-key tiles per CTA, summed before one reduce-add of N and S.
  f2_key_tiles: int = 2
  # In-tile mask products: the bf16 pieces' wgmmas as one group, awaited once.
  chain_pieces: bool = True

  def pad_multiple(self, mosaic: bool, training: bool = True) -> int:
    """T's padding: a multiple of every block the passes use (B1's, B2's only when training)."""
    if mosaic:
      return max(MOSAIC_CTA_ROWS, MOSAIC_TILE * self.f2_key_tiles)
    fwd = max(self.block_q_stats, self.block_k_stats, self.block_q, self.block_k_fwd)
    return max(fwd, self.block_k, self.b1_block_k) if training else fwd

  def validate(self, head_dim: int, mosaic: bool):
    """Raises ValueError naming the field (`mosaic`: the Mosaic passes will run)."""
    for name in _TILES:
      x = getattr(self, name)
      if not isinstance(x, int) or x < 16 or x & (x - 1):
        raise ValueError(f"BlockSizes.{name}={x!r} must be a power of two >= 16")
    low = max(MIN_CKPT_ROWS, self.block_q)
    x = self.ckpt_rows
    if not isinstance(x, int) or x < low or x & (x - 1):
      raise ValueError(f"BlockSizes.ckpt_rows={x!r} must be a power of two >= {low} "
                       "(64 and block_q)")
    if self.split_k_decode < self.block_k_decode:
      raise ValueError(f"BlockSizes.split_k_decode={self.split_k_decode} must be a multiple of "
                       f"block_k_decode={self.block_k_decode}")
    if self.b1_carries not in B1_CARRIES:
      raise ValueError(f"BlockSizes.b1_carries={self.b1_carries!r} must be one of {B1_CARRIES}")
    if self.f2_key_tiles not in F2_KEY_TILES:
      raise ValueError(f"BlockSizes.f2_key_tiles={self.f2_key_tiles!r} must be one of "
                       f"{F2_KEY_TILES}")
    if not isinstance(self.chain_pieces, bool):
      raise ValueError(f"BlockSizes.chain_pieces={self.chain_pieces!r} must be True or False")
    if head_dim < 16 or head_dim & (head_dim - 1):
      raise ValueError(f"head dim {head_dim} must be a power of two >= 16 (64 and 128 are tuned)")


def check_backend(backend: str):
  if backend not in BACKENDS:
    raise ValueError(f"backend={backend!r} must be one of {BACKENDS}")


def runs_mosaic(backend: str, head_dim: int, dtype) -> bool:
  """Whether `backend` runs the Mosaic passes for this head dim and input dtype."""
  check_backend(backend)
  return (backend == "mosaic" and head_dim in MOSAIC_HEAD_DIMS
          and jnp.dtype(dtype) in MOSAIC_DTYPES)


def default_block_sizes(backend: str, head_dim: int, dtype) -> BlockSizes:
  """What the entry points run without block_sizes (pure: no hardware query)."""
  del dtype   # the fields of the backend that does not run are inert
  check_backend(backend)
  if head_dim <= 64:
    return BlockSizes()
  return BlockSizes(b1_block_k=64, b1_carries="registers", f2_key_tiles=1, chain_pieces=False)
