"""A training run: the loop (`rl.run.loop.train`), its config and builders, the dialects
(RouteWeaver, Router-R1), checkpoints, weight replicas, router loading for eval and serving,
the worker pool check, preflight, provenance and the stand-in warm start. The top of `rl`: may
import `rl.learner`, `rl.reports` and `rl.core`.
"""
