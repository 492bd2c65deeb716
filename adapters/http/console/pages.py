"""The console's page and assets: ``GET /`` and ``GET /ui`` answer the HTML shell,
``GET /ui/static/<name>`` its scripts and stylesheet (from this package's ``static/``
folder, read once when the app is built: nothing is fetched from elsewhere, so the
console works offline), ``GET /ui/api/info`` whether a key is needed. All public."""

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from litestar import Request, Response, get
from litestar.handlers import HTTPRouteHandler
from litestar.params import FromPath

from application.access.access import Access

STATIC = Path(__file__).with_name("static")
CONTENT_TYPES = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
}
# A flat name with a known extension: no folders, no dot files (nothing else is served).
ASSET_NAME = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9_.-]*$")
# Revalidated every time (a cheap 304): an upgraded server's assets are never stale.
CACHE_CONTROL = "no-cache"


@dataclass(frozen=True, slots=True)
class Asset:
    body: bytes
    content_type: str
    etag: str


def load_assets(folder: Path = STATIC) -> dict[str, Asset]:
    """The files of ``folder`` by name, with their content types and ETags."""
    assets = {}
    for path in sorted(folder.iterdir()):
        kind = CONTENT_TYPES.get(path.suffix)
        if path.is_file() and kind is not None and ASSET_NAME.match(path.name):
            body = path.read_bytes()
            etag = '"' + hashlib.sha256(body).hexdigest()[:20] + '"'
            assets[path.name] = Asset(body, kind, etag)
    return assets


def _answer(request: Request[Any, Any, Any], asset: Asset) -> Response[bytes]:
    headers = {"ETag": asset.etag, "Cache-Control": CACHE_CONTROL}
    if request.headers.get("if-none-match") == asset.etag:
        return Response(b"", status_code=304, headers=headers)
    return Response(asset.body, media_type=asset.content_type, headers=headers)


def page_handlers(
    access: Access | None, assets: dict[str, Asset] | None = None
) -> list[HTTPRouteHandler]:
    """The public handlers; with ``access``'s keys (read at each request: a SIGHUP may
    bring them), the page asks for one."""
    assets = load_assets() if assets is None else assets
    index = assets["index.html"]

    @get(["/", "/ui", "/ui/"], include_in_schema=False, sync_to_thread=False)
    def shell(request: Request[Any, Any, Any]) -> Response[bytes]:
        return _answer(request, index)

    @get("/ui/static/{name:str}", include_in_schema=False, sync_to_thread=False)
    def static(request: Request[Any, Any, Any], name: FromPath[str]) -> Response[bytes]:
        asset = assets.get(name) if ASSET_NAME.match(name) else None
        if asset is None:
            return Response(b"not found", status_code=404, media_type="text/plain")
        return _answer(request, asset)

    @get("/ui/api/info", include_in_schema=False, sync_to_thread=False)
    def info() -> dict[str, Any]:
        return {"keyed": access is not None and not access.open}

    return [shell, static, info]
