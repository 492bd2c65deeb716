"""What the OpenAI controllers get injected (``openai_router`` provides them; ``caller``
and ``record`` come from the request's state: ``adapters.http.request_state``)."""

from litestar.di import NamedDependency

from adapters.http.openai.tools import ToolReplies
from adapters.http.served_models import ModelNames
from application.engine.input_processor import InputProcessor
from application.serving.completions import CompletionService
from application.serving.embeddings import EmbeddingService

Inputs = NamedDependency[InputProcessor]
Completions = NamedDependency[CompletionService]
Names = NamedDependency[ModelNames]
ToolCalls = NamedDependency[ToolReplies]
Embeddings = NamedDependency[EmbeddingService]
