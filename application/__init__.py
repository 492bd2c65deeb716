"""Use cases: the engine step loop and the services built on it (domain + stdlib only)."""
