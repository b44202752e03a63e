"""The protocol between router and workers (docs/protocol.md): the action grammar and its
violations, turns and observations, the router's prompts, worker calls and their results,
candidate answers of replies, and Router-R1's tag dialect. Knows no worker pool and no
episode: imports nothing of `routing` outside this part.
"""
