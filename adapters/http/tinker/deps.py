"""What the Tinker controllers get injected (the router provides them)."""

from typing import Any

from litestar.di import NamedDependency

from adapters.http.auth import ApiKeyGuard
from application.tinker.service import TinkerService

Service = NamedDependency[TinkerService]
SdkConfig = NamedDependency[dict[str, Any]]  # what /client/config answers
Guard = NamedDependency[ApiKeyGuard]  # for a handler that checks the key itself
