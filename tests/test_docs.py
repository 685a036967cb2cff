"""The repository reads as a product, not a log: no work-history words, no pointers to files a
user does not have, no timings in library code, docs within their size budget, and every result
file the performance page names present.

The forbidden words are assembled from pieces below, so this file does not match itself.
"""

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = "docs/results/"

_S = "sess" + "ion"
_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|"
             "thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|"
             r"twentieth|twenty-\w+|thirty-\w+|\d+(st|nd|rd|th)")
HISTORY = [re.compile(p, re.IGNORECASE) for p in (
    rf"\b({_ORDINALS})\s+{_S}\b",                   # an ordinal work period
    rf"\b{_S}\s?\d+\b",                             # a numbered one
    r"\bis" + r"sue\s+#?\d+\b",                     # a tracker number
    "CONT" + r"RACT\.md",                           # files outside the repository
    r"\bno" + "tes/",
    r"\bse" + "eds/",
    r"\bsha" + "red/",
)]
TIMINGS = [re.compile(r"\b\d+(\.\d+)?\s?m" + r"s\b"), re.compile("TFL" + "OP/s")]
README_BYTES, DOCS_BYTES = 12_000, 80_000


def _repo_files() -> list[pathlib.Path]:
  """Tracked files, plus new ones git does not ignore (so a file is checked before its commit)."""
  try:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         cwd=ROOT, capture_output=True, check=True).stdout
  except (OSError, subprocess.CalledProcessError):
    pytest.skip("not a git checkout")
  names = sorted({n for n in out.decode().split("\0") if n})
  return [ROOT / n for n in names if (ROOT / n).is_file()]   # deleted but not yet committed: gone


def _text(path: pathlib.Path) -> str | None:
  data = path.read_bytes()
  if b"\0" in data[:8192]:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def _offenders(paths, patterns) -> list[str]:
  found = []
  for path in paths:
    text = _text(path)
    if text is None:
      continue
    for i, line in enumerate(text.splitlines(), 1):
      if any(p.search(line) for p in patterns):
        found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
  return found


def test_no_work_history_or_outside_references():
  files = [p for p in _repo_files()
           if not (p.relative_to(ROOT).as_posix().startswith(RESULTS) and p.suffix == ".json")]
  found = _offenders(files, HISTORY)
  assert not found, ("work-history words or references to files outside the repository "
                     "(write the finding, its date and command instead):\n" + "\n".join(found))


def test_no_timings_in_library_code():
  files = [p for p in _repo_files() if p.suffix == ".py"
           and p.relative_to(ROOT).parts[0] in ("focaljax", "pallas_kernels")]
  found = _offenders(files, TIMINGS)
  assert not found, ("measurements belong in docs/performance.md, not in code:\n"
                     + "\n".join(found))


def test_docs_within_size_budget():
  readme = (ROOT / "README.md").stat().st_size
  docs = {p: p.stat().st_size for p in sorted((ROOT / "docs").rglob("*.md"))}
  total = sum(docs.values())
  listing = "\n".join(f"{p.relative_to(ROOT)}: {n} bytes" for p, n in docs.items())
  assert readme < README_BYTES, f"README.md: {readme} bytes, budget {README_BYTES}"
  assert total < DOCS_BYTES, f"docs/**/*.md: {total} bytes, budget {DOCS_BYTES}:\n{listing}"


def test_performance_page_names_existing_results():
  page = ROOT / "docs" / "performance.md"
  missing = []
  for i, line in enumerate(page.read_text().splitlines(), 1):
    for name in re.findall(re.escape(RESULTS) + r"[\w./-]+?\.json", line):
      if not (ROOT / name).is_file():
        missing.append(f"docs/performance.md:{i}: {name}")
  assert not missing, "result files named but absent:\n" + "\n".join(missing)
