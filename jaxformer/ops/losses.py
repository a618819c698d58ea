"""Token-level cross entropy with an ignore mask and the PaLM z-loss."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Integer

from jaxformer.typing import ArrayLike, Tokens


def cross_entropy(logits: Float[ArrayLike, "B T V"], targets: Tokens, *,
                  mask: Bool[ArrayLike, "B T"] | Integer[ArrayLike, "B T"] | None = None, z_loss: float = 0.0,
                  ) -> tuple[Float[Array, ""], dict[str, Array]]:
    """Mean next-token cross entropy over unmasked tokens, plus ``z_loss * log(Z)^2``.

    Args:
      logits: ``[B, T, V]`` (any float dtype; computed in fp32).
      targets: int ``[B, T]`` in ``[0, V)``; masked positions may hold anything, and a negative target (Hugging
        Face's and PyTorch's ignore label, -100) never counts, mask or not.
      mask: bool (or 0/1 int) ``[B, T]``, True where the token counts (None: all count); not per-token weights.
      z_loss: coefficient of the mean squared log-partition (PaLM uses 1e-4).

    Returns:
      ``(loss, metrics)``: fp32 scalar ``ce + z``; ``metrics`` holds ``"ce"`` (mean CE),
      ``"z_loss"`` (``z_loss * mean(logsumexp^2)``, the term added to the loss) and
      ``"n_tokens"`` (int32 count). With no unmasked token every value is 0, not NaN.
    """
    logits, targets = jnp.asarray(logits), jnp.asarray(targets)
    if logits.ndim < 2 or targets.shape != logits.shape[:-1]:
        raise ValueError(
            f"cross_entropy expects logits [B,T,V] and targets [B,T]; got {logits.shape=} {targets.shape=}"
        )
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise ValueError(f"cross_entropy targets must be integers; got {targets.dtype=}")
    if mask is None:
        mask = jnp.ones(targets.shape, jnp.bool_)
    else:
        mask = jnp.asarray(mask)
        if mask.shape != targets.shape:
            raise ValueError(
                f"cross_entropy mask must match logits [B,T,V] on [B,T]; got {logits.shape=} {mask.shape=}"
            )
        if not (mask.dtype == jnp.bool_ or jnp.issubdtype(mask.dtype, jnp.integer)):
            raise ValueError(f"cross_entropy mask must be bool (or 0/1 integers), not per-token weights; "
                             f"got {mask.dtype=}")
        mask = mask.astype(jnp.bool_)
    mask = mask & (targets >= 0)  # -100 and the like: ignored, not read as index V - 100

    x = logits.astype(jnp.float32)
    log_z = jax.nn.logsumexp(x, axis=-1)
    safe_targets = jnp.where(mask, targets, 0)
    target_logit = jnp.take_along_axis(x, safe_targets[..., None], axis=-1)[..., 0]
    n_tokens = jnp.sum(mask, dtype=jnp.int32)
    denom = jnp.maximum(n_tokens, 1).astype(jnp.float32)
    ce = jnp.sum(jnp.where(mask, log_z - target_logit, 0.0)) / denom
    z = jnp.float32(z_loss) * jnp.sum(jnp.where(mask, jnp.square(log_z), 0.0)) / denom
    return ce + z, {"ce": ce, "z_loss": z, "n_tokens": n_tokens}
