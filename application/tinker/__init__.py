"""Use cases of the Tinker-compatible fine-tuning API: sessions, futures,
training runs in ``seq_id`` order, sampling and checkpoints, behind domain ports."""
