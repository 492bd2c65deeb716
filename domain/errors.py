"""Domain errors: bad input is reported with these, never with assert."""


class InferError(Exception):
    """Base class of every error this project raises on purpose."""


class InvalidParameterError(InferError, ValueError):
    """A request parameter is out of range or inconsistent; ``param`` names it."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ModelLoadError(InferError):
    """Weights or a tokenizer could not be loaded; the message names the file and the problem."""
