"""What the entry points (train.py, eval.py) share: bad input as one `error:` line, and absl's
--help, which exits 1 (the code of a failed run), exiting 0."""

import re
import sys

HELP = frozenset({"--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml"})


def fail(message, code: int = 2):
  """The last line of `message` on stderr, then exit `code`: a config file's error arrives as
  the last line of its traceback, whose class name is dropped."""
  lines = [line.strip() for line in str(message).splitlines() if line.strip()]
  last = re.sub(r"^\w*(Error|Exception): ", "", lines[-1]) if lines else message
  print(f"error: {last}", file=sys.stderr)
  sys.exit(code)


def exit_after_help(e: SystemExit, argv) -> None:
  """Re-raises absl's exit from flag parsing, with code 0 after --help."""
  sys.exit(0 if e.code == 1 and HELP & set(argv) else e.code)
