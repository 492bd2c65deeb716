"""Use cases of the Tinker-compatible fine-tuning API (seed 002 §3): sessions, futures,
training runs in ``seq_id`` order, sampling and checkpoints, behind domain ports."""
