"""Evaluation: a router checkpoint over evaluation sets (`evaluate`), summaries, tables and
plots of the dumps (`report`), the baseline routers on the same sets (`baselines`), and the
baselines and the whole comparison table from one command (`compare`).

Modules are imported where used: `report` is light, `evaluate` pulls in JAX and the model.
"""
