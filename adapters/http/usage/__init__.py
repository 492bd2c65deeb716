"""Usage: the recording middleware and the usage API over the ledger."""
