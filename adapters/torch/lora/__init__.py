"""LoRA: training backend (modules, losses) and multi-adapter serving."""
