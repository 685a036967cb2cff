"""focaljax: focal, dilution and FocusLLM attention in a JAX/Flax training stack."""

from focaljax import ops  # noqa: F401
from focaljax.evaluation.loading import load  # noqa: F401
