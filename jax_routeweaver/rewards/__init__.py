"""Rewards: answer scorers (`scorers/`), the code sandbox, and the task / efficiency reward.

Never imports `models/` or `rl/`.
"""
