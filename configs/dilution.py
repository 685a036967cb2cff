"""Dilution attention without position encoding in every layer.

  python train.py --config configs/dilution.py --workdir runs/dilution
  python train.py --config configs/dilution.py:size=209m --config.model.attention.implementation=pallas
"""

from configs import base


def get_config(arg=None):
  c = base.preset(arg, "dilution:none")
  return c
