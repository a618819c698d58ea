"""jaxformer: the Transformer taken apart to its screws and rebuilt in JAX."""

__version__ = "0.1.0"
