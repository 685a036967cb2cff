"""Softmax attention without position encoding (the control for dilution's length claims).

  python train.py --config configs/softmax_nope.py --workdir runs/softmax_nope
"""

from configs import base


def get_config(arg=None):
  c = base.preset(arg, "softmax:none")
  return c
