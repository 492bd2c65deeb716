"""The official ``anthropic`` SDK over Litestar's test client.

The SDK speaks through ``httpx2`` and refuses ``httpx`` clients (Litestar's
``TestClient`` is one), so its requests go through an ``httpx2.MockTransport`` that
forwards each to the test client and hands back the whole answer (streams included: the
test client collects them)."""

import anthropic
import httpx2
from litestar.testing import TestClient


def anthropic_client(http: TestClient, api_key: str = "unused") -> anthropic.Anthropic:
    def forward(request: httpx2.Request) -> httpx2.Response:
        answer = http.request(
            request.method,
            request.url.raw_path.decode(),
            content=request.read(),
            headers=list(request.headers.raw),
        )
        return httpx2.Response(
            answer.status_code, headers=list(answer.headers.raw), content=answer.content
        )

    transport = httpx2.MockTransport(forward)
    return anthropic.Anthropic(
        base_url=str(http.base_url),
        api_key=api_key,
        http_client=httpx2.Client(transport=transport),
        max_retries=0,
    )
