"""The web console's routes (fake runner, through the composition root): the page and its
assets with a strict Content-Security-Policy on every response, the assets' own hygiene
(no inline script or style, no HTML sinks), ``--no-ui``, the engine's event stream (its
history and live points, over a real socket) and the API keys on the console's data."""

import json
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from litestar.testing import TestClient

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http.console.pages import STATIC
from adapters.http.console.security import CONTENT_SECURITY_POLICY
from application.access.keys import hash_key
from entrypoints.cli import _parser
from entrypoints.config import ServerConfig
from entrypoints.config.transport import TransportSettings
from tests.fakes import fake_container
from tests.support.uvicorn_thread import running

KEY = "sk-console-test"
CSP_DIRECTIVES = {
    "default-src 'self'",
    "script-src 'self'",
    "style-src 'self'",
    "img-src 'self' data:",
    "connect-src 'self'",
    "object-src 'none'",
    "base-uri 'none'",
    "frame-ancestors 'none'",
}
# What would turn a server-provided string into markup or code.
HTML_SINKS = re.compile(
    r"\.innerHTML|\.outerHTML|insertAdjacentHTML|document\.write|\beval\(|new Function\(|"
    r"createContextualFragment|\.srcdoc|setAttribute\(\s*['\"](?:on|style)"
)


def keys_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.json"
    tenants = [{"id": "alice", "keys": [hash_key(KEY)]}]
    path.write_text(json.dumps({"tenants": tenants}))
    return path


def app(tmp_path: Path, *, keys: bool = False, ui: bool = True, latency_s: float = 0.0) -> Any:
    runner = FakeModelRunner(
        script=reply_script(ByteTokenizer(), "hello there"), step_latency_s=latency_s
    )
    overrides: dict[str, Any] = {"cache_dir": str(tmp_path), "http": TransportSettings(ui=ui)}
    if keys:
        overrides["api_keys_file"] = str(keys_file(tmp_path))
    return fake_container(runner, **overrides).http_app()


@pytest.fixture
def http(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app(tmp_path)) as client:
        yield client


def assert_console_headers(response: httpx.Response) -> None:
    csp = response.headers["content-security-policy"]
    assert csp == CONTENT_SECURITY_POLICY
    assert {d.strip() for d in csp.split(";")} >= CSP_DIRECTIVES
    assert "unsafe-inline" not in csp and "unsafe-eval" not in csp
    assert response.headers["x-content-type-options"] == "nosniff"


@pytest.mark.parametrize("path", ["/", "/ui", "/ui/"])
def test_the_page_is_served_at_the_root_and_ui_with_a_strict_csp(
    http: TestClient, path: str
) -> None:
    response = http.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert_console_headers(response)
    page = response.text
    assert '<script type="module" src="/ui/static/app.js"></script>' in page
    assert '<link rel="stylesheet" href="/ui/static/console.css">' in page


def test_every_asset_is_served_with_its_type_and_the_csp(http: TestClient) -> None:
    types = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
    names = sorted(p.name for p in STATIC.iterdir() if p.suffix in types)
    assert {"app.js", "dom.js", "chart.js", "playground.js", "engine.js"} <= set(names)
    for name in names:
        response = http.get(f"/ui/static/{name}")
        assert response.status_code == 200, name
        assert response.headers["content-type"].startswith(types[Path(name).suffix]), name
        assert_console_headers(response)
        assert response.headers["cache-control"] == "no-cache"
        again = http.get(f"/ui/static/{name}", headers={"If-None-Match": response.headers["etag"]})
        assert again.status_code == 304


@pytest.mark.parametrize(
    "path", ["/ui/static/nope.js", "/ui/static/.hidden.js", "/ui/static/%2e%2e%2fapp.py"]
)
def test_nothing_else_is_served_from_static(http: TestClient, path: str) -> None:
    response = http.get(path)
    assert response.status_code == 404
    assert "import" not in response.text


def test_errors_of_console_routes_carry_the_csp_too(tmp_path: Path) -> None:
    with TestClient(app(tmp_path, keys=True)) as http:
        refused = http.get("/ui/api/me")
    assert refused.status_code == 401
    assert_console_headers(refused)


def test_the_assets_have_no_inline_code_or_style_and_no_html_sinks() -> None:
    """The CSP forbids inline scripts and styles; the scripts write server strings as text
    only (textContent / text nodes), never through an HTML parser."""
    page = (STATIC / "index.html").read_text()
    assert not re.search(r"<script(?![^>]*\bsrc=)", page), "an inline script"
    assert not re.search(r"<style|\sstyle=|\son[a-z]+=", page, re.I), "inline style or handler"
    for script in STATIC.glob("*.js"):
        code = script.read_text()
        assert not HTML_SINKS.search(code), f"{script.name}: {HTML_SINKS.search(code)}"
        assert not re.search(r"https?://(?!127\.0\.0\.1|localhost)", code), (
            f"{script.name} loads something from elsewhere"
        )
        assert ".style." not in code and "cssText" not in code, f"{script.name}: inline style"


def test_no_ui_serves_no_console(tmp_path: Path) -> None:
    assert fake_container(http=TransportSettings(ui=False)).timeline() is None
    with TestClient(app(tmp_path, ui=False)) as http:
        for path in ("/", "/ui", "/ui/static/app.js", "/ui/api/info", "/ui/api/engine/events"):
            assert http.get(path).status_code == 404, path
        assert http.get("/health").status_code == 200


def test_the_flag() -> None:
    def serve(*argv: str) -> ServerConfig:
        return ServerConfig.from_args(_parser().parse_args(["serve", *argv]), device="cpu")

    assert serve().http.ui is True
    assert serve("--no-ui").http.ui is False


def test_keys_guard_the_data_not_the_page(tmp_path: Path) -> None:
    with TestClient(app(tmp_path, keys=True)) as http:
        assert http.get("/").status_code == 200
        assert http.get("/ui/static/app.js").status_code == 200
        assert http.get("/ui/api/info").json() == {"keyed": True}
        missing = http.get("/ui/api/me")
        assert missing.status_code == 401
        assert "Authorization: Bearer" in missing.json()["error"]["message"]
        wrong = http.get("/ui/api/me", headers={"Authorization": "Bearer sk-wrong"})
        assert wrong.status_code == 401
        assert wrong.json()["error"]["message"] == "invalid API key"
        assert http.get("/ui/api/engine/events").status_code == 401
        me = http.get("/ui/api/me", headers={"Authorization": f"Bearer {KEY}"})
        assert me.status_code == 200
        assert me.json() == {"tenant": "alice", "faces": ["openai", "tinker"]}


def test_an_open_server_needs_no_key(http: TestClient) -> None:
    assert http.get("/ui/api/info").json() == {"keyed": False}
    assert http.get("/ui/api/me").json() == {"tenant": None, "faces": None}


def events(url: str, count: int, headers: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """The first ``count`` events of the engine stream."""
    found = []
    with httpx.stream(
        "GET", f"{url}/ui/api/engine/events", headers=headers or {}, timeout=10
    ) as stream:
        assert stream.status_code == 200
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert_console_headers(stream)  # type: ignore[arg-type]
        for line in stream.iter_lines():
            if line.startswith("data: "):
                found.append(json.loads(line[len("data: ") :]))
                if len(found) == count:
                    break
    return found


def serving(application: Any) -> Any:
    server = uvicorn.Server(
        uvicorn.Config(application, host="127.0.0.1", port=0, log_level="warning")
    )
    return running(server)


def test_the_engine_stream_sends_its_history_then_live_points(tmp_path: Path) -> None:
    with serving(app(tmp_path, keys=True, latency_s=0.02)) as server:
        auth = {"Authorization": f"Bearer {KEY}"}
        reply = httpx.post(
            f"{server.url}/v1/completions",
            json={"model": "fake", "prompt": "Hi there " * 8, "max_tokens": 8},
            headers=auth,
        )
        assert reply.status_code == 200
        time.sleep(1.1)  # its second finished
        history, update = events(server.url, 2, auth)
    assert history["type"] == "history"
    assert history["window_s"] == 600
    assert history["engine"]["model"] == "fake"
    assert history["engine"]["kv_blocks"] > 0
    assert history["replicas"] is None
    points = history["points"]
    assert points, "the completion's second is in the history"
    assert sum(p["generation_tps"] for p in points) == 8  # max_tokens
    assert any(p["ttft_s"] is not None for p in points)
    assert points[-1]["kv_usage"] == 0  # the request ended: its prompt's full blocks cached
    assert 0 < points[-1]["kv_cached"] < 1
    assert [p["t"] for p in points] == list(range(points[0]["t"], points[-1]["t"] + 1))
    assert update["type"] == "update"
    for point in update["points"]:
        assert point["t"] > points[-1]["t"]
        assert point["running"] == 0 and point["generation_tps"] == 0


def test_the_running_count_moves_while_requests_run(tmp_path: Path) -> None:
    with serving(app(tmp_path, latency_s=0.05)) as server:

        def slow() -> None:
            httpx.post(
                f"{server.url}/v1/completions",
                json={"model": "fake", "prompt": "Hi", "max_tokens": 60, "ignore_eos": True},
                timeout=30,
            )

        threads = [threading.Thread(target=slow) for _ in range(3)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        seen = events(server.url, 4)
        for thread in threads:
            thread.join()
    points = [p for e in seen for p in e["points"]]
    assert max(p["running_max"] for p in points) == 3
    assert any(p["generation_tps"] > 0 for p in points)
