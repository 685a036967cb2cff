"""Evaluates a trained focaljax model; results as JSON (and PNG plots) under WORKDIR/eval/.

  python eval.py --workdir runs/default
  python eval.py --workdir runs/default/checkpoints/250 --suites val,longdoc --max_multiplier 4
  python eval.py --workdir runs/default --books path/to/books.jsonl.xz --max_books 16

  python eval.py --workdir runs/default --focus_adapter runs/focus          # FocusLLM suites
  python eval.py --workdir runs/default --focus_adapter runs/focus/checkpoints/2000 \
      --suites focus_passkey --focus_multipliers 2,8 --passkey_seeds 10

Suites: val, longdoc, passkey, keyword, copy, attention, sample (default: all). Long documents:
--books, else the validation split's documents concatenated (the output says which).

FocusLLM suites (focaljax/focus/evaluate.py): focus_passkey, focus_longdoc, on the base --workdir
with the adapter --focus_adapter (a FocusLLM run workdir: its latest checkpoint; or one of its
checkpoints/<step>); the default suites with --focus_adapter are focus_passkey, and
focus_longdoc when --books is given. Their JSON goes under
the run's eval/ (eval/adapter_<step> for an explicit step). --max_multiplier (default 32 for
them), --passkey_seeds (default 10 for them), --max_books and --books apply to them too.

Exit status: 0 done; 1 a suite produced no result (skipped, or no length could be scored; the
reason is in its output and JSON); 2 bad input (flags, a missing workdir or file, bad data): one
line `error: ...`, no traceback.
"""

from absl import app, flags

from focaljax import eval_cli

if __name__ == "__main__":
  flags.adopt_module_key_flags(eval_cli)   # --help lists them
  app.run(eval_cli.main, flags_parser=eval_cli.parse_flags)
