"""Our models: config, layers, KV storage, the shared transformer and the three families."""
