"""What the entry points (train.py, eval.py, the sweep) share: bad input as one `error:` line, a
--config.<field> naming no field, and absl's --help, which exits 1 (a failed run's code), exiting 0."""

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


def no_field_message(e: Exception, argv) -> str:
  """The line for a --config.<path> in `argv` naming no field; `e` is the lookup error
  ml_collections raises for it (its message holds the key and maybe a "did you mean")."""
  key = (re.findall(r"'(\w+)", str(e)) or [str(e)])[0]
  bad = [arg.split("=")[0] for arg in argv if arg.startswith("--config.") and key in arg]
  hint = re.findall(r'Did you mean "([\w.]+)"', str(e))
  return (f"no config field {bad[0][len('--config.'):] if bad else key}" +
          (f" (did you mean {hint[0]}?)" if hint else ""))
