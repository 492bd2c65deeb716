"""Running models: the batched ModelRunner, the sampler, single-request generate()."""
