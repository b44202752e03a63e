"""Data: the record schema (`records.py`); the grain pipeline and benchmark preparation follow.

Never imports `models/` or `rl/`.
"""
