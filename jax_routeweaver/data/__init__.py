"""Data: the record schema and readers (`records.py`) and the grain pipeline of query
batches (`pipeline.py`); benchmark preparation follows.

Never imports `models/` or `rl/`.
"""
