"""LoRA: PEFT's adapter format (peft), the training backend (training, losses) and
multi-adapter serving (serving, the ServingAdapters port)."""
