#!/bin/bash
# One focaljax training run on a Cloud TPU pod slice through GKE and xpk. Copy and edit, then:
#   launch/tpu_xpk.sh configs/base.py:size=1.3b gs://bucket/runs/1.3b [--config.x=y ...]
#
# Assumes an xpk cluster (xpk cluster create --cluster $CLUSTER --tpu-type $TPU_TYPE ...) and an
# image that holds this repository with focaljax installed for TPU (pip install -e . 'jax[tpu]').
# xpk starts the same command on every host of the slice; the TPU runtime publishes the hosts
# (TPU_WORKER_HOSTNAMES) and focaljax then calls jax.distributed.initialize() with no arguments
# (focaljax/train/distributed.py). Process 0 writes config.json, metrics and logs.
# The workdir must be a bucket (gs://...): the hosts share no disk. Install the gcs extra in the
# image (pip install -e '.[gcs]'); checkpoints are written by every host through Orbax.
set -euo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then sed -n '2,11s/^# \{0,1\}//p' "$0"; exit 0; fi

CONFIG=${1:?usage: launch/tpu_xpk.sh CONFIG WORKDIR [--config.a.b=VALUE ...]}
WORKDIR=${2:?usage: launch/tpu_xpk.sh CONFIG WORKDIR [--config.a.b=VALUE ...]}
shift 2

CLUSTER=${CLUSTER:?set CLUSTER to your xpk cluster}
TPU_TYPE=${TPU_TYPE:-v5p-128}            # the slice: its host count is the process count
NUM_SLICES=${NUM_SLICES:-1}
IMAGE=${IMAGE:?set IMAGE to a container image holding focaljax}
NAME=${NAME:-focaljax-$(date +%m%d-%H%M)}

# Preemption sends SIGTERM: every host saves at one agreed step and exits 75; --max-restarts
# starts the workload again and it resumes from that checkpoint.
xpk workload create \
  --cluster "$CLUSTER" \
  --workload "$NAME" \
  --tpu-type "$TPU_TYPE" \
  --num-slices "$NUM_SLICES" \
  --docker-image "$IMAGE" \
  --max-restarts 10 \
  --command "python train.py --config=$CONFIG --workdir=$WORKDIR ${*@Q}"
