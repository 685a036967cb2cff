"""focaljax -> HF -> focaljax without torch or transformers (what CI has): the import inverts the
export, bit for bit for softmax layers; a focal layer's temperature comes back folded into its
q projection (the stock-transformers form), equal to float rounding."""

import os

import numpy as np
import pytest

import focaljax
from configs import smoke
from focaljax import config as config_lib
from focaljax.interop import hf_export
from focaljax.interop import hf_import
from focaljax.train import lm


@pytest.mark.parametrize("pattern", ["softmax:rope", "focal:rope"])
def test_export_then_import_gives_the_same_logits(tmp_path, pattern):
  c = smoke.get_config()
  c.train.update(steps=2, eval_every=0)
  c.model.attention.pattern = pattern
  work = str(tmp_path / "work")
  lm.train(config_lib.parse(c), work)
  hf_dir, back = str(tmp_path / "hf"), str(tmp_path / "back")
  hf_export.focaljax_to_hf(work, hf_dir)
  assert os.path.isfile(os.path.join(hf_dir, "config.json"))
  hf_import.hf_to_focaljax(hf_dir, back)
  tokens = np.random.default_rng(0).integers(0, 200, (2, 24)).astype(np.int32)
  want = np.asarray(focaljax.load(work).logits(tokens))
  got = np.asarray(focaljax.load(back).logits(tokens))
  if pattern == "softmax:rope":
    np.testing.assert_array_equal(got, want)
  else:
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_convert_refuses_a_shard_size_that_is_not_positive(tmp_path, capsys, value):
  from focaljax import convert  # pylint: disable=import-outside-toplevel
  with pytest.raises(SystemExit) as e:
    convert.main(["focaljax-to-hf", str(tmp_path), str(tmp_path / "hf"), "--max_shard_gb", value])
  assert e.value.code == 2
  assert f"--max_shard_gb: must be a number > 0, got '{value}'" in capsys.readouterr().err


def test_an_import_fine_tunes_like_the_run_it_came_from(tmp_path):
  """configs/finetune.py over the HF round trip of a run and over the run itself: the same
  losses (softmax imports bit for bit). Training the import in place is refused in one line."""
  from configs import finetune  # pylint: disable=import-outside-toplevel
  from focaljax.train import checkpoint  # pylint: disable=import-outside-toplevel
  c = smoke.get_config()
  c.train.update(steps=2, eval_every=0)
  work, hf_dir, back = (str(tmp_path / n) for n in ("work", "hf", "back"))
  lm.train(config_lib.parse(c), work)
  hf_export.focaljax_to_hf(work, hf_dir)
  hf_import.hf_to_focaljax(hf_dir, back)

  def tune(source, workdir, **model):
    f = finetune.get_config(source)
    f.train.update(steps=2, eval_every=0, log_every=1)
    f.optim.warmup_steps = 1
    f.model.update(model)
    f.data.tokenizer = os.path.join(work, "tokenizer.json")   # the import's is the same
    lm.train(config_lib.parse(f), str(tmp_path / workdir))
    rows = open(tmp_path / workdir / "metrics.jsonl").read().splitlines()
    return [r for r in rows if '"loss"' in r][0]

  assert tune(back, "a").split('"grad_norm"')[0] == tune(work, "b").split('"grad_norm"')[0]
  with pytest.raises(config_lib.ConfigError, match=r"^config field train.init_from: .*'s "
                     rf"parameters have other shapes: model.d_ff {c.model.d_ff} -> "):
    tune(back, "c", d_ff=2 * c.model.d_ff)
  assert not os.path.exists(tmp_path / "c")
  with pytest.raises(checkpoint.CorruptCheckpoint, match=r"holds parameters alone \(an import\), "
                     r"nothing to resume: fine-tune them in another --workdir"):
    lm.train(config_lib.parse(finetune.get_config(back)), back)
