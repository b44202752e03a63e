"""The numeric core: pure functions of arrays with their shapes in the docstrings.

Advantages (GRPO and the COMET split, ``A_mode + A_inner = A_GRPO``), the PPO dual-clip and
k3 KL losses, GAE, the minimum-support gradient, padded shapes and the estimator registry.
Imports jax, chex and numpy only: no other part of the package (import-linter contract
``numeric-core``).
"""
