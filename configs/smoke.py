"""Seconds-long runs for tests and CI: the `small` size, a handful of steps.

  python train.py --config configs/smoke.py --workdir /tmp/smoke
  python train.py --config configs/smoke.py:pattern=softmax:rope,dilution:none
"""

from configs import base


def get_config(arg=None):
  c = base.get_config(",".join(filter(None, ["size=small", arg])))
  c.train.update(steps=6, log_every=2, eval_every=3, eval_batches=1, ckpt_every=3,
                 async_ckpt=False)
  c.optim.warmup_steps = 2
  return c
