"""Evaluation: a router checkpoint over evaluation sets (`evaluate`), summaries, tables and
plots of the dumps (`report`), the baseline routers on the same sets (`baselines`), the
baselines and the whole comparison table from one command (`compare`), and the mode the
worker pool favours per domain, from forced rollouts (`favourites`).

Modules are imported where used: `report` is light, `evaluate` pulls in JAX and the model.
"""
