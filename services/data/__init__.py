"""Where a run's prompts come from: JSONL or Parquet rows released as prompt groups (source.py)."""
