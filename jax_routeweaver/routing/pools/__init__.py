"""Worker pools: the channel file, the HTTP pool with its retry policy, provider replies and
usage, prices, the endpoint check and the replay cache. May import `routing.protocol`; never
`routing.simulated` or `routing.episodes`.
"""
