"""fusedopt_jax: fusedopt's fused multi-tensor optimizer steps in JAX, through the XLA FFI.

Each transformation is an Optax GradientTransformation (``init``, ``update``) whose update runs
one custom call over the whole pytree, plus the fused form ``step(params, grads, state)`` that
updates parameters and states in place (donate them to ``jax.jit``). See docs/jax.md.

    import fusedopt_jax as fj
    tx = fj.adamw(1e-3, weight_decay=0.01)          # optax.adamw's arguments
    updates, state = tx.update(grads, state, params)  # Optax's form
    params = optax.apply_updates(params, updates)
    step = jax.jit(tx.step, donate_argnums=(0, 2))   # the fused form
    params, state = step(params, grads, state)
"""

__all__ = ["FusedTransformation", "adam", "adamw", "clip_adamw", "handler_calls", "lamb", "lion", "register", "sgd"]


def __getattr__(name):
    # Imported on first use, so that ``python -m fusedopt_jax._build`` needs no jax.
    if name in __all__:
        from . import _core

        return getattr(_core, name)
    raise AttributeError(f"module 'fusedopt_jax' has no attribute {name!r}")
