"""Episodes: the environments that run one router episode turn by turn (RouteWeaver's modes,
Router-R1's search/answer loop) and the episode and trajectory types. May import
`routing.pools` and `routing.protocol`; never `routing.simulated`.
"""
