"""The Tinker wire formats: JSON (:mod:`.json`) and protobuf (:mod:`.proto`) bodies to domain
values, results back to what the SDK reads."""
