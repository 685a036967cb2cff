"""focaljax: focal, dilution and FocusLLM attention in a JAX/Flax training stack.

`focaljax.load` (focaljax.evaluation.loading.load) and `focaljax.ops` are imported on first use,
so that `import focaljax.data` needs neither jax nor the kernels.
"""

import importlib


def __getattr__(name: str):
  if name == "load":
    return importlib.import_module("focaljax.evaluation.loading").load
  if name == "ops":
    return importlib.import_module("focaljax.ops")
  raise AttributeError(f"module 'focaljax' has no attribute {name!r}")
