"""Multi-host start-up through `jax.distributed` (the engine TPU pods and GPU clusters already use).

`initialize()` is a no-op on one host. It starts the distributed runtime when the environment says
there are several processes:
  - explicit: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID (any launcher, and the
    2-process CPU test);
  - SLURM (SLURM_NTASKS > 1) and TPU pods / Cloud TPU multislice: jax's own cluster detection,
    `jax.distributed.initialize()` with no arguments.
Logging, config/tokenizer writing and metrics come from process 0 only (`is_primary`).
"""

from __future__ import annotations

import os

import jax

_started = False


def _cluster_detected() -> bool:
  if int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_JOB_ID" in os.environ:
    return True
  # Multi-host TPU: the TPU runtime publishes the worker list.
  return len(os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",")) > 1


def initialize() -> None:
  global _started
  if _started:
    return
  if "JAX_COORDINATOR_ADDRESS" in os.environ and int(os.environ.get("JAX_NUM_PROCESSES", "1")) > 1:
    # CPU collectives across processes (tests, CPU clusters) go through gloo; GPUs use NCCL.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]))
    _started = True
  elif _cluster_detected():
    jax.distributed.initialize()
    _started = True


def is_primary() -> bool:
  return jax.process_index() == 0
