"""``infer serve`` flags for the transport: the address, CORS, TLS, SSE heartbeats, the
request deadline, the drain on SIGTERM and the web console (``--no-ui``)."""

import argparse
import ssl
from dataclasses import dataclass

from adapters.http.streaming import DEFAULT_HEARTBEAT_S
from domain.errors import InvalidParameterError
from entrypoints.config.flag_fields import from_flags


@dataclass(frozen=True)
class TransportSettings:
    """The flags of the same names (seconds; 0 turns a heartbeat or deadline off);
    ``ui``: serve the web console at ``/`` and ``/ui`` (``--no-ui``: off)."""

    host: str = "127.0.0.1"
    port: int = 8000
    allowed_origins: tuple[str, ...] = ()
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_keyfile_password: str | None = None
    sse_heartbeat_interval: float = DEFAULT_HEARTBEAT_S
    request_timeout: float = 0.0
    drain_timeout: float = 30.0
    ui: bool = True

    def __post_init__(self) -> None:
        for name in ("sse_heartbeat_interval", "request_timeout", "drain_timeout"):
            if not getattr(self, name) >= 0:
                raise InvalidParameterError(name, "must be 0 or more (seconds)")
        if self.ssl_certfile and not self.ssl_keyfile:
            raise InvalidParameterError("ssl_keyfile", "is required with --ssl-certfile")
        if self.ssl_keyfile and not self.ssl_certfile:
            raise InvalidParameterError("ssl_certfile", "is required with --ssl-keyfile")
        if self.ssl_keyfile_password is not None and not self.ssl_keyfile:
            raise InvalidParameterError("ssl_keyfile_password", "needs --ssl-keyfile")

    @property
    def tls(self) -> bool:
        return self.ssl_certfile is not None

    def uvicorn_tls(self) -> dict[str, str]:
        """uvicorn's ``ssl_*`` options (none without TLS)."""
        names = ("ssl_certfile", "ssl_keyfile", "ssl_keyfile_password")
        return {n: v for n in names if (v := getattr(self, n)) is not None}

    def check_tls(self) -> None:
        """Load the certificate and key now: a wrong path or password fails at start-up."""
        if not self.tls:
            return
        try:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(
                self.ssl_certfile or "", self.ssl_keyfile, self.ssl_keyfile_password
            )
        except (OSError, ssl.SSLError) as e:
            raise InvalidParameterError(
                "ssl_certfile", f"cannot load the certificate and key: {e}"
            ) from e

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "TransportSettings":
        """The flags, checked (the TLS files loaded) before the model loads."""
        origins = [o.strip() for flag in args.allowed_origins or () for o in flag.split(",")]
        settings = from_flags(cls, args, allowed_origins=tuple(o for o in origins if o))
        settings.check_tls()
        return settings


def add_address_args(parser: argparse.ArgumentParser) -> None:
    defaults = TransportSettings()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)


def add_transport_args(parser: argparse.ArgumentParser) -> None:
    defaults = TransportSettings()
    group = parser.add_argument_group("transport")
    group.add_argument(
        "--allowed-origins",
        action="append",
        default=None,
        help="browser origins allowed cross-origin (CORS), e.g. https://app.example.com "
        "(repeatable or comma-separated; default none: no CORS headers)",
    )
    group.add_argument(
        "--ssl-certfile", default=None, help="serve HTTPS with this certificate (PEM)"
    )
    group.add_argument("--ssl-keyfile", default=None, help="the certificate's private key (PEM)")
    group.add_argument("--ssl-keyfile-password", default=None, help="the key's password, if any")
    group.add_argument(
        "--sse-heartbeat-interval",
        type=float,
        default=defaults.sse_heartbeat_interval,
        help="seconds a stream may be silent before a ': ping' comment is sent (0: never; "
        "default %(default)s)",
    )
    group.add_argument(
        "--request-timeout",
        type=float,
        default=defaults.request_timeout,
        help="seconds an OpenAI or /v1/generate request may take: then 504, or an error "
        "event in a stream, and its work is aborted (default %(default)s: none)",
    )
    group.add_argument(
        "--drain-timeout",
        type=float,
        default=defaults.drain_timeout,
        help="on SIGTERM / SIGINT, seconds running requests may take to finish before they "
        "are ended (default %(default)s)",
    )
    group.add_argument(
        "--no-ui",
        dest="ui",
        action="store_false",
        help="do not serve the web console at / and /ui (default: served; its data behind "
        "the API keys when there are any)",
    )
