"""The serving use cases: completions and chat behind every face, the Responses store,
embeddings, the model catalogue and its rollouts."""
