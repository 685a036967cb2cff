"""The alternating hybrid: even layers softmax + RoPE, odd layers dilution without position
encoding (the dilution study's best in-domain arm).

  python train.py --config configs/hybrid.py --workdir runs/hybrid
"""

from configs import base


def get_config(arg=None):
  c = base.preset(arg, "softmax:rope,dilution:none")
  return c
