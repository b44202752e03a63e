"""The simulated worker pool: a fake that stands in for paid LLM APIs, which cannot be called
from this project's machines. Worker profiles, synthetic tasks, how a simulated worker reads
its prompt, and an HTTP endpoint serving the pool. May import `routing.pools` and
`routing.protocol`; never `routing.episodes`.
"""
