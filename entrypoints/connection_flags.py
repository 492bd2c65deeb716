"""``infer serve``'s client-connection settings (:class:`ConnectionLimits`) and their flags
(the same names); the uvicorn server that enforces them is :mod:`entrypoints.server`."""

import argparse
from dataclasses import dataclass

from domain.errors import InvalidParameterError
from entrypoints.flag_fields import from_flags


@dataclass(frozen=True)
class ConnectionLimits:
    """What ``infer serve`` allows one client connection (the flags of the same names)."""

    max_connections: int = 1000
    timeout_keep_alive: int = 5
    header_timeout: float = 10.0
    body_timeout: float = 60.0
    backlog: int = 2048
    h11_max_incomplete_event_size: int = 16 * 1024
    body_read_timeout: float = 10.0

    def __post_init__(self) -> None:
        for name in ("max_connections", "backlog", "h11_max_incomplete_event_size"):
            if getattr(self, name) < 1:
                raise InvalidParameterError(name, "must be at least 1")
        for name in ("timeout_keep_alive", "header_timeout", "body_timeout", "body_read_timeout"):
            if not getattr(self, name) > 0:
                raise InvalidParameterError(name, "must be greater than 0 (seconds)")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ConnectionLimits":
        return from_flags(cls, args)


def add_connection_args(parser: argparse.ArgumentParser) -> None:
    """``infer serve``'s connection flags (uvicorn's names where uvicorn has the setting)."""
    defaults = ConnectionLimits()
    group = parser.add_argument_group("client connections")
    group.add_argument(
        "--max-connections",
        type=int,
        default=defaults.max_connections,
        help="open connections at most; beyond, the longest-idle one is closed, or (all busy) "
        "the new one gets 503; lowered to fit the open-files limit",
    )
    group.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=defaults.timeout_keep_alive,
        help="seconds an idle keep-alive connection is kept open",
    )
    group.add_argument(
        "--header-timeout",
        type=float,
        default=defaults.header_timeout,
        help="seconds a client has to send a request's headers (then 408 and close)",
    )
    group.add_argument(
        "--body-timeout",
        type=float,
        default=defaults.body_timeout,
        help="seconds a client has to send a request's body after its headers (then 408)",
    )
    group.add_argument(
        "--body-read-timeout",
        type=float,
        default=defaults.body_read_timeout,
        help="seconds between two reads of a request body: a body that stops arriving gets "
        "408 then (a slow but steady upload goes on, within --body-timeout)",
    )
    group.add_argument(
        "--backlog",
        type=int,
        default=defaults.backlog,
        help="connections the kernel queues before they are accepted",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=defaults.h11_max_incomplete_event_size,
        help="bytes a request line plus headers may take (beyond: 400)",
    )
