"""The environment the router acts in, in four parts, each importing only the parts below it:

- `routing.episodes`: the environments that run an episode (RouteWeaver, Router-R1) and the
  episode types. May import `routing.pools` and `routing.protocol`.
- `routing.simulated`: the simulated worker pool that stands in for paid LLM APIs, its
  profiles and synthetic tasks, and its HTTP endpoint. May import `routing.pools` and
  `routing.protocol`.
- `routing.pools`: real worker pools (channels, HTTP workers, provider replies, pricing,
  the endpoint check, the replay cache). May import `routing.protocol`.
- `routing.protocol`: what router and workers exchange (the action grammar, violations,
  turns, observations, prompts, worker calls, candidate answers, Router-R1's tags).

Never imports `models/` or `rl/`: generation goes through the `sampling.base.Sampler` protocol.
"""
