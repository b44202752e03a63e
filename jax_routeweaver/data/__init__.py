"""Data: the record schema (`records.py`) and its file readers (`record_files.py`) and the
grain pipeline of query batches (`pipeline.py`); benchmark preparation follows.

Never imports `models/` or `rl/`.
"""
