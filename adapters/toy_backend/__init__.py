"""A deterministic numpy model for fast tests of the fine-tuning API (seed 002 §5.1)."""
