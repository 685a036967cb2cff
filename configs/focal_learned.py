"""Focal attention, learned temperature: τ = clip(mean(X·w_τ) + τ_init, τ_min, τ_max) per layer,
softmax(q·kᵀ / τ), the clip range the paper's [5, 10] at head dim 128 scaled by √(head_dim/128);
the mean runs causally over each document's prefix (tau_mean=causal).

  python train.py --config configs/focal_learned.py --workdir runs/focal_learned

Result (35.7M, 256 context, 32.8M tokens, three seeds; docs/reproducing.md): validation loss
level with softmax+RoPE (−0.001 [−0.026, +0.023]); passkey retrieval better or level per seed.
"""

from configs import base


def get_config(arg=None):
  c = base.preset(arg, "focal:rope")
  c.model.attention.learned = True
  return c
