"""Domain errors: bad input is reported with these, never with assert."""


class InferError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidParameterError(InferError, ValueError):
    """A request parameter is out of range or inconsistent; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param, self.message = param, message

    def renamed(self, param: str) -> "InvalidParameterError":
        """The same error reported under ``param`` (the request field a face took the
        value from: ``max_completion_tokens`` for ``max_tokens``)."""
        return InvalidParameterError(param, self.message)


class InvalidRequestError(InvalidParameterError):
    """An invalid request whose message is complete as written (no ``param:`` prefix)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(param, message)
        self.args = (message,)

    def __str__(self) -> str:
        return str(self.args[0])


class ModelLoadError(InferError):
    """Weights or a tokenizer could not be loaded; the message names the file and the problem."""


class PromptTooLongError(InvalidParameterError):
    """Prompt plus requested new tokens do not fit the engine's max_model_len (HTTP 422)."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            "prompt",
            f"{prompt_tokens} prompt tokens + {max_tokens} new tokens exceed "
            f"max_model_len {max_model_len}",
        )


class QueueFullError(InferError):
    """The waiting queue is at max_waiting_requests (HTTP 503); retry later."""


class EmptyPromptError(InvalidParameterError):
    """An empty prompt (HTTP 400 on the native endpoint)."""

    def __init__(self) -> None:
        super().__init__("prompt", "must not be empty")


class ModelNotFoundError(InvalidRequestError):
    """A request's ``model`` names no model this server serves to the caller (OpenAI: 404
    ``model_not_found``; the native endpoint: 422)."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


class StoreUnavailableError(InferError):
    """A database the server keeps records in (usage, audit, rollouts) cannot be reached
    now (HTTP 503): what is served keeps serving."""
