"""The embedding models (BERT-family sentence encoders) loaded and run for `/v1/embeddings`."""
