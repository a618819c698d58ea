"""Pallas kernels for attention. Depends on jax alone (never jaxformer, flax, optax, orbax)."""
