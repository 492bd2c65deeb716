"""The Tinker router's old home: ``tinker_router`` now lives in :mod:`adapters.http.tinker`."""

from adapters.http.tinker import tinker_router

__all__ = ["tinker_router"]
