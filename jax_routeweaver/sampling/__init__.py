"""Generation: the `Sampler` protocol (`base`) and the in-process JAX sampler (`jax_sampler`).

Only the model-free protocol is re-exported here, so code that must not depend on the models
(routing) can import this package; `JaxSampler` lives in `sampling.jax_sampler`.
"""

from jax_routeweaver.sampling.base import (
    Completion,
    Sampler,
    SamplingParams,
    apply_stop_strings,
    find_stop_string,
)

__all__ = ["Completion", "Sampler", "SamplingParams", "apply_stop_strings", "find_stop_string"]
