"""Pure domain layer: entities, value objects, scheduler policies and ports (stdlib only)."""
