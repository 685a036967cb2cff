"""Focal attention, constant temperature: softmax(q·kᵀ / (t·√d)), t from model.attention.temperature
(configs/base.py: 0.4, the paper's best).

  python train.py --config configs/focal.py --workdir runs/focal
  python train.py --config configs/focal.py:size=400m --config.model.attention.temperature=0.3
"""

from configs import base


def get_config(arg=None):
  c = base.preset(arg, "focal:rope")
  return c
