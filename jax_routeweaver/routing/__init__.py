"""The environment the router acts in: protocols, prompts, workers, cost and episodes.

Never imports `models/` or `rl/`: generation goes through the `sampling.base.Sampler` protocol.
"""
