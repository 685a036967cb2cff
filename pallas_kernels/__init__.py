"""Pallas kernels for focaljax's attention variants. Depends only on jax; never imports focaljax.

`reference` holds the pure-JAX spec of every kernel here.
"""
