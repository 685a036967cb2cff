"""Focal attention, learned temperature: τ = clip(mean(X·w_τ) + τ_init, 5, 10) per layer,
softmax(q·kᵀ / τ); the mean runs causally over each document's prefix (tau_mean=causal).

  python train.py --config configs/focal_learned.py --workdir runs/focal_learned
"""

from configs import base


def get_config(arg=None):
  c = base.get_config(arg)
  c.model.attention.pattern = "focal:rope"
  c.model.attention.learned = True
  return c
