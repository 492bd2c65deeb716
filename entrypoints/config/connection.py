"""``infer serve``'s client-connection flags: the settings of
:class:`~adapters.http.uvicorn_server.ConnectionLimits` (the same names), which the uvicorn
server enforces."""

import argparse

from adapters.http.uvicorn_server import ConnectionLimits
from entrypoints.config.flag_fields import from_flags


def connection_limits(args: argparse.Namespace) -> ConnectionLimits:
    """The parsed connection flags as :class:`ConnectionLimits` (checked)."""
    return from_flags(ConnectionLimits, args)


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
