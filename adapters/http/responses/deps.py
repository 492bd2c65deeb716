"""What the Responses controller gets injected (``responses_router`` provides them;
``caller`` comes from the request's state)."""

from litestar.di import NamedDependency

from adapters.http.openai.tools import ToolReplies
from adapters.http.responses.history import ResponseHistory
from adapters.http.served_models import ModelNames
from application.serving.completions import CompletionService

Completions = NamedDependency[CompletionService]
Names = NamedDependency[ModelNames]
ToolCalls = NamedDependency[ToolReplies]
History = NamedDependency[ResponseHistory]
