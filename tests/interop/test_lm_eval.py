"""lm-eval model "focaljax": scores equal the model's own log-probs; local tasks run offline."""

import json
import os

import numpy as np
import pytest

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # pylint: disable=wrong-import-position
from lm_eval.tasks import TaskManager  # pylint: disable=wrong-import-position

from focaljax.interop import hf_export  # pylint: disable=wrong-import-position
from focaljax.interop import hf_import  # pylint: disable=wrong-import-position
from focaljax.evaluation import generate as gen_lib  # pylint: disable=wrong-import-position
from focaljax.interop import lm_eval as lm_eval_adapter  # pylint: disable=wrong-import-position
from focaljax.interop import safetensors_file  # pylint: disable=wrong-import-position
from focaljax.data import tokenizer as tokenizer_lib  # pylint: disable=wrong-import-position

ASSET = str(tokenizer_lib.BUNDLED_FILE)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
  """A random 2-layer model, written as an HF checkpoint (no torch needed) and converted."""
  root = tmp_path_factory.mktemp("lm_eval")
  hf_dir = root / "hf"
  hf_dir.mkdir()
  V, E, F, L = tokenizer_lib.bundled().vocab_size, 32, 64, 2
  shapes = {"model.embed_tokens.weight": (V, E), "model.norm.weight": (E,),
            "lm_head.weight": (V, E)}
  for i in range(L):
    p = f"model.layers.{i}."
    shapes.update({p + "input_layernorm.weight": (E,), p + "post_attention_layernorm.weight": (E,),
                   p + "self_attn.q_proj.weight": (E, E), p + "self_attn.k_proj.weight": (16, E),
                   p + "self_attn.v_proj.weight": (16, E), p + "self_attn.o_proj.weight": (E, E),
                   p + "mlp.gate_proj.weight": (F, E), p + "mlp.up_proj.weight": (F, E),
                   p + "mlp.down_proj.weight": (E, F)})
  rng = np.random.default_rng(0)
  specs = [(n, s, np.float32, lambda s=s: rng.normal(0, 0.3, s)) for n, s in shapes.items()]
  safetensors_file.write_dir(str(hf_dir), specs, 2**30)
  (hf_dir / "config.json").write_text(json.dumps(dict(
      architectures=["LlamaForCausalLM"], vocab_size=V, hidden_size=E, intermediate_size=F,
      num_hidden_layers=L, num_attention_heads=4, num_key_value_heads=2,
      max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)))
  (hf_dir / "tokenizer.json").write_text(open(ASSET).read())
  return hf_import.hf_to_focaljax(str(hf_dir), str(root / "work"))


def test_adapter_scores_match_the_model(workdir):
  lm = lm_eval_adapter.FocaljaxLM(path=workdir, batch_size=2, max_length=16)
  tok = lm.tokenizer
  reqs = [("The cat sat on", " the mat"), ("A", " b c"),
          ("one two three four five six seven eight nine ten eleven twelve", " thirteen")]
  got = lm.loglikelihood([Instance("loglikelihood", {}, r, i) for i, r in enumerate(reqs)])
  for (ctx, cont), (ll, greedy) in zip(reqs, got):
    c, n = lm._encode_pair(ctx, cont)  # pylint: disable=protected-access
    whole = (c + n)[-17:]   # left-truncated to max_length = 16 inputs
    nll = np.asarray(gen_lib.token_nll(lm.loaded.model, [whole[:-1]], [whole[1:]]))[0]
    np.testing.assert_allclose(ll, -nll[-len(n):].sum(), rtol=1e-5)
    assert isinstance(greedy, bool)
  # One window (eos + the text fits in max_length): the exact sum; a long text takes several.
  short, long = "the word and the word", "the word and the word " * 8
  ids = tok.encode(short)
  assert len(ids) < 16 and len(tok.encode(long)) > 32
  rolling = lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), i)
                                      for i, t in enumerate((short, long))])
  nll = np.asarray(gen_lib.token_nll(lm.loaded.model, [[tok.eos_id] + ids[:-1]], [ids]))
  np.testing.assert_allclose(rolling[0], -nll.sum(), rtol=1e-5)
  assert np.isfinite(rolling[1]) and rolling[1] < rolling[0]

  gen = [("Once upon a time", {"until": ["e"], "max_gen_toks": 6}),
         ("Hello", {"until": ["\n"], "max_gen_toks": 6, "do_sample": False})]
  outs = lm.generate_until([Instance("generate_until", {}, g, i) for i, g in enumerate(gen)])
  full = lm.loaded.generate("Once upon a time", max_new_tokens=6)
  assert outs[0] == full.split("e")[0] and "e" not in outs[0]
  # top_k under greedy decoding is ignored (as transformers does); a beam search is not done.
  lm.generate_until([Instance("generate_until", {}, ("Hi", {"max_gen_toks": 2, "top_k": 5}), 0)])
  with pytest.raises(ValueError, match=r"generation arguments \['num_beams'\] are not supported"):
    lm.generate_until([Instance("generate_until", {}, ("Hi", {"num_beams": 4}), 0)])


def test_a_score_does_not_depend_on_its_batch(workdir):
  # max_length 128 > the trained 64: alone a 40-token request pads to 64, beside a 100-token one
  # to 128; RoPE scales for max_length in both (it once scaled for the bucket).
  lm = lm_eval_adapter.FocaljaxLM(path=workdir, batch_size=2, max_length=128)
  ids = np.random.default_rng(1).integers(0, lm.loaded.config.vocab_size, 100).tolist()
  short, long = (ids[:36], ids[36:40]), (ids[:90], ids[90:])
  alone = lm._score_tokens([short])[0][0]  # pylint: disable=protected-access
  batched = lm._score_tokens([short, long])[0][0]  # pylint: disable=protected-access
  nll = gen_lib.token_nll(lm.loaded.model, [ids[:39]], [ids[1:40]], rope_length=128)
  np.testing.assert_allclose([alone, batched], -np.asarray(nll)[0, -4:].sum(), rtol=1e-6)


TASKS = {
    "fj_mc": dict(output_type="multiple_choice", doc_to_text="{{question}}",
                  doc_to_choice="{{choices}}", doc_to_target="{{label}}",
                  metric_list=[{"metric": "acc"}]),
    "fj_gen": dict(output_type="generate_until", doc_to_text="{{prompt}}",
                   doc_to_target="{{answer}}",
                   generation_kwargs={"until": ["\n"], "max_gen_toks": 5, "do_sample": False},
                   metric_list=[{"metric": "exact_match"}]),
}
DOCS = {
    "fj_mc": [{"question": f"Question {i}: the sky is", "choices": [" blue", " green", " loud"],
               "label": i % 3} for i in range(4)],
    "fj_gen": [{"prompt": f"Count: {i}, {i + 1},", "answer": f" {i + 2}"} for i in range(3)],
}


def test_simple_evaluate_runs_local_tasks(workdir, tmp_path):
  for name, spec in TASKS.items():
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS[name]))
    # JSON is a subset of YAML: the task files need no yaml writer.
    (tmp_path / f"{name}.yaml").write_text(json.dumps(dict(
        task=name, dataset_path="json", test_split="test",
        dataset_kwargs={"data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "hf")},
        **spec)))
  out = lm_eval.simple_evaluate(
      model="focaljax", model_args=f"path={workdir},batch_size=4", tasks=list(TASKS),
      task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False),
      bootstrap_iters=0, log_samples=False)
  print(json.dumps(out["results"], default=str))
  acc = out["results"]["fj_mc"]["acc,none"]
  assert 0 <= acc <= 1
  assert 0 <= out["results"]["fj_gen"]["exact_match,none"] <= 1


@pytest.mark.parametrize("args,match", [
    (["--model_args", "path=/nonexistent/run", "--tasks", "hellaswag"], "/nonexistent/run is "),
    (["--tasks", "no_such_task"], "Tasks not found: no_such_task"),
    (["--model_args", "foo=1", "--tasks", "hellaswag"], "model_args ['foo'] are not known"),
    (["--model_args", "max_length=8", "--tasks", "hellaswag"], "model_args path is required"),
    (["--model_args", "path=P,max_length=abc", "--tasks", "hellaswag"],
     "model_args max_length=abc: must be an integer >= 1"),
    (["--model_args", "path=P,max_length=-5", "--tasks", "hellaswag"], "model_args max_length=-5"),
    (["--model_args", "path=P,max_length=0", "--tasks", "hellaswag"],
     "model_args max_length=0: must be an integer >= 1"),
    (["--batch_size", "0", "--tasks", "hellaswag"],
     "batch_size (--batch_size)=0: must be an integer >= 1 or auto"),
])
def test_cli_bad_input_is_one_line(workdir, capsys, args, match):
  # lm_eval merges repeated --model_args: only cases without one get the workdir's.
  own = ["--model_args", f"path={workdir}"] * ("--model_args" not in args)
  argv = ["--model", "focaljax", *own, *[a.replace("path=P", f"path={workdir}") for a in args]]
  assert lm_eval_adapter.main(argv) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err[-1].startswith("focaljax-lm-eval: error: ") and match in err[-1], err
