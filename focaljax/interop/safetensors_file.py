"""The safetensors file format, read memory-mapped and written as a stream (no torch needed).

A file is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}} padded with spaces to a multiple of 8, then the raw little-endian tensor bytes.
A sharded checkpoint adds model.safetensors.index.json mapping each tensor to its file.
"""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
           "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
           "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in _DTYPES.items()}
_INDEX = "model.safetensors.index.json"


def read(path: str) -> dict[str, np.ndarray]:
  """Lazily mapped tensors of one .safetensors file: nothing is read until a tensor is used, and
  each tensor is its own mapping, so dropping it releases its pages."""
  size = os.path.getsize(path)
  with open(path, "rb") as f:
    n = struct.unpack("<Q", f.read(8))[0] if size >= 8 else size
    if 8 + n > size:
      raise ValueError(f"{path} is truncated or not a safetensors file ({size} bytes, shorter "
                       "than its header)")
    try:
      header = json.loads(f.read(n))
      header.pop("__metadata__", None)
    except (ValueError, AttributeError):
      raise ValueError(f"{path} is not a safetensors file (no JSON header)") from None
  out = {}
  for name, h in header.items():
    if h.get("dtype") not in _DTYPES:
      raise ValueError(f"{path}: tensor {name} has dtype {h.get('dtype')}, not one of "
                       f"{list(_DTYPES)}")
    begin, end = h["data_offsets"]
    dtype, shape = _DTYPES[h["dtype"]], tuple(h["shape"])
    if end - begin != int(np.prod(shape)) * np.dtype(dtype).itemsize:
      raise ValueError(f"{path}: tensor {name} has {end - begin} bytes, not those of shape "
                       f"{list(shape)} {h['dtype']}")
    if 8 + n + end > size:
      raise ValueError(f"{path} is truncated: tensor {name} ends at byte {8 + n + end} of a "
                       f"{size}-byte file")
    out[name] = (np.memmap(path, dtype, "r", offset=8 + n + begin, shape=shape) if end > begin
                 else np.zeros(shape, dtype))
  return out


def read_dir(hf_dir: str) -> dict[str, np.ndarray]:
  """Every tensor of an HF checkpoint directory, single file or sharded, memory-mapped."""
  index = os.path.join(hf_dir, _INDEX)
  if os.path.isfile(index):
    try:
      with open(index) as f:
        files = sorted(set(json.load(f)["weight_map"].values()))
    except (ValueError, KeyError, AttributeError, TypeError):
      raise ValueError(f"{index} is not a valid index (a JSON object with a weight_map)") from None
    missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
    if missing:
      raise FileNotFoundError(f"{index} lists {missing[0]}, which is missing from {hf_dir}")
  elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
    files = ["model.safetensors"]
  else:
    raise FileNotFoundError(f"{hf_dir} has neither model.safetensors nor {_INDEX} "
                            "(PyTorch .bin checkpoints: re-save with safe_serialization=True)")
  out = {}
  for f in files:
    out.update(read(os.path.join(hf_dir, f)))
  return out


def write_dir(out_dir: str, specs, max_shard_bytes: int) -> list[str]:
  """Streams `specs` [(name, shape, dtype, make() -> array)] into model.safetensors, or into
  shards of at most `max_shard_bytes` plus model.safetensors.index.json; one tensor in memory."""
  shards, size = [[]], 0
  for name, shape, dtype, make in specs:
    nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
    if shards[-1] and size + nbytes > max_shard_bytes:
      shards.append([])
      size = 0
    shards[-1].append((name, shape, dtype, make, nbytes))
    size += nbytes
  names = (["model.safetensors"] if len(shards) == 1 else
           [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
  weight_map, total = {}, 0
  for fname, shard in zip(names, shards):
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape, dtype, _, nbytes in shard:
      header[name] = {"dtype": _NAMES[np.dtype(dtype)], "shape": list(shape),
                      "data_offsets": [offset, offset + nbytes]}
      offset += nbytes
      weight_map[name] = fname
    total += offset
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)   # the format pads the header so tensor data stays aligned
    with open(os.path.join(out_dir, fname), "wb") as f:
      f.write(struct.pack("<Q", len(raw)) + raw)
      for name, shape, dtype, make, _ in shard:
        arr = np.ascontiguousarray(make(), dtype=dtype)
        if arr.shape != tuple(shape):
          raise ValueError(f"tensor {name}: made shape {arr.shape}, declared {tuple(shape)}")
        f.write(arr.reshape(-1).view(np.uint8).data)   # bytes: buffers refuse bf16
  if len(names) > 1:
    with open(os.path.join(out_dir, _INDEX), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  return names
