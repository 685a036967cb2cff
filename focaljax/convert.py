"""`python -m focaljax.convert {hf-to-focaljax,focaljax-to-hf} ...`: the conversion command line
(`focaljax.interop.hf_import` and `hf_export` do the work; their docstrings say what converts
and what is refused)."""

import argparse
import sys

from focaljax.interop import hf, hf_export, hf_import


def _positive(text: str) -> float:
  try:
    value = float(text)
  except ValueError:
    value = 0.0
  if not value > 0:
    raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
  return value


def main(argv=None) -> int:
  p = argparse.ArgumentParser(description=hf.__doc__ + hf_import.__doc__ + hf_export.__doc__,
                              formatter_class=argparse.RawTextHelpFormatter)
  sub = p.add_subparsers(dest="command", required=True)
  a = sub.add_parser("hf-to-focaljax", help="HF LLaMA-family dir -> focaljax workdir")
  a.add_argument("hf_dir")
  a.add_argument("out_dir")
  b = sub.add_parser("focaljax-to-hf", help="focaljax workdir or checkpoints/<step> -> HF dir")
  b.add_argument("ckpt")
  b.add_argument("out_dir")
  b.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: stored)")
  b.add_argument("--max_shard_gb", type=_positive, default=5.0, help="shard past this size")
  for parser in (a, b):
    parser.add_argument("--replace", action="store_true",
                        help="delete a non-empty out_dir's contents first (default: refuse)")
  args = p.parse_args(argv)
  try:
    if args.command == "hf-to-focaljax":
      print(hf_import.hf_to_focaljax(args.hf_dir, args.out_dir, replace=args.replace))
    else:
      print(hf_export.focaljax_to_hf(args.ckpt, args.out_dir, dtype=args.dtype,
                                     max_shard_gb=args.max_shard_gb, replace=args.replace))
  except (ValueError, OSError) as e:   # bad input: one line naming it, as argparse does
    print(f"focaljax-convert: error: {' '.join(str(e).split())}", file=sys.stderr)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main())
