"""focaljax: focal, dilution and FocusLLM attention in a JAX/Flax training stack."""

from focaljax import ops  # noqa: F401
from focaljax.loaded import load  # noqa: F401
