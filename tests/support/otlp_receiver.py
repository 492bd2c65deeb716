"""An OTLP/HTTP trace receiver on 127.0.0.1 (decoded with opentelemetry-proto), for tests
that check the spans a real server exports (``running_receiver``, ``find_spans``)."""

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from tests.e2e.server import free_port


class Receiver(ThreadingHTTPServer):
    def __init__(self) -> None:
        super().__init__(("127.0.0.1", free_port()), _Handler)
        self.spans: list[Any] = []
        self.paths: list[str] = []
        self.lock = threading.Lock()


class _Handler(BaseHTTPRequestHandler):
    server: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        with self.server.lock:
            self.server.paths.append(self.path)
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.server.spans.extend(scope.spans)
        reply = ExportTraceServiceResponse().SerializeToString()
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.send_header("Content-Length", str(len(reply)))
        self.end_headers()
        self.wfile.write(reply)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def running_receiver() -> Iterator[Receiver]:
    """A receiver serving on a thread of its own until the block ends."""
    server = Receiver()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()


def find_spans(receiver: Receiver, name: str, count: int = 1, timeout_s: float = 20) -> list[Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with receiver.lock:
            found = [s for s in receiver.spans if s.name == name]
        if len(found) >= count:
            return found
        time.sleep(0.2)
    return found
