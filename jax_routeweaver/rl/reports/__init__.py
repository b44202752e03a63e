"""What a run reports: step metrics, per-episode metrics, the run log (``metrics.jsonl``,
TensorBoard) and its plots. May import `rl.core` and the layers below `rl`; never
`rl.learner` or `rl.run`.
"""
