"""The structured log as JSON lines in a string, for the length of a ``with`` block."""

import io
import logging
from collections.abc import Iterator
from contextlib import contextmanager

import structlog

from adapters.observability.logging import configure_logging


@contextmanager
def json_log_stream() -> Iterator[io.StringIO]:
    """The log configured at ``info`` as JSON lines into the stream yielded (loggers cached by
    an earlier configuration included: they write through the root handler set here); then
    structlog's defaults and the root logger's handlers and level as they were."""
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    assert configure_logging("info", "json", stream) == "json"
    try:
        yield stream
    finally:
        structlog.reset_defaults()
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
