"""The fine-tuning half's domain (the Tinker face): values, errors, checks, provenance,
ports and the custom-loss language."""
