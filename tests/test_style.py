"""House rules that keep the code base honest: one dispatch table, one hardware query, one import
direction."""

import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = ("softmax", "focal", "dilution")


def _py_files(pkg):
  for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
    for f in files:
      if f.endswith(".py"):
        yield os.path.join(dirpath, f)


def test_only_the_dispatch_table_compares_variant_names():
  names = "|".join(VARIANTS)
  pattern = re.compile(rf"""[=!]=\s*["']({names})["']|["']({names})["']\s*[=!]=""")
  offenders = []
  for path in _py_files("focaljax"):
    if path.endswith(os.path.join("focaljax", "model", "attention.py")):
      continue
    with open(path) as f:
      for i, line in enumerate(f, 1):
        if pattern.search(line):
          offenders.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not offenders, offenders


def _imports(path):
  tree = ast.parse(open(path).read())
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      yield from (a.name.split(".")[0] for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module:
      yield node.module.split(".")[0]


def test_imports_flow_one_way():
  for path in _py_files("pallas_kernels"):
    assert not {"focaljax", "configs", "train", "eval"} & set(_imports(path)), path
  for path in _py_files("focaljax"):
    assert not {"train", "eval", "configs"} & set(_imports(path)), path


def test_only_dispatch_asks_which_hardware_this_is():
  pattern = re.compile(r"default_backend\(|compute_capability|device_kind|\bhopper\(\)")
  offenders = []
  for pkg in ("focaljax", "pallas_kernels"):
    for path in _py_files(pkg):
      if path.endswith(os.path.join("focaljax", "dispatch.py")):
        continue
      with open(path) as f:
        offenders += [f"{os.path.relpath(path, ROOT)}:{i}" for i, line in enumerate(f, 1)
                      if pattern.search(line)]
  assert not offenders, offenders


def _module(path):
  rel = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
  return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _import_graph():
  """module -> the package modules it imports (anywhere in the file, lazy imports included)."""
  paths = [p for pkg in ("focaljax", "pallas_kernels") for p in _py_files(pkg)]
  modules = {_module(p) for p in paths}
  graph = {}
  for path in paths:
    deps = set()
    for node in ast.walk(ast.parse(open(path).read())):
      if isinstance(node, ast.Import):
        deps |= {a.name for a in node.names}
      elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        deps |= {f"{node.module}.{a.name}" for a in node.names} | {node.module}
    graph[_module(path)] = {d for d in deps if d in modules and not _module(path).startswith(d + ".")
                            and d != _module(path)}
  return graph


def test_no_import_cycles():
  graph, state, cycles = _import_graph(), {}, []

  def visit(m, stack):
    state[m] = "open"
    for d in sorted(graph.get(m, ())):
      if state.get(d) == "open":
        cycles.append(" -> ".join(stack[stack.index(d):] + [d]))
      elif d not in state:
        visit(d, stack + [d])
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m, [m])
  assert not cycles, cycles


def test_entry_scripts_are_short():
  # flags -> config -> one library call; their flags and checks live in focaljax/*_cli.py
  for script in ("train.py", "eval.py"):
    with open(os.path.join(ROOT, script)) as f:
      assert len(f.readlines()) < 80, script
