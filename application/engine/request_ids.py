"""The one place request ids are minted: every face names its requests the same way."""

import uuid


def new_request_id(kind: str) -> str:
    """A fresh id, unique in this process and across restarts: ``{kind}-{32 hex digits}``
    (``kind`` says which face made it: ``cmpl``, ``chatcmpl``, ``gen``, ``llm``, ...)."""
    return f"{kind}-{uuid.uuid4().hex}"
