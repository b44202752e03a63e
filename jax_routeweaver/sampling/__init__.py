"""Generation: the `Sampler` protocol (`base`), grammar constraints (`constraints`) and the
in-process JAX sampler (`jax_sampler`). Nothing is imported here, so code that must not depend
on the models (routing) can import `sampling.base` without pulling in `jax_sampler`.
"""
