"""``python -m tests.robustness.fake_serve --port P [infer serve's connection flags]``: the
HTTP app on the fake model under ``run_server`` (what ``infer serve`` runs), for tests that
need a process of their own (its open-files limit, its log)."""

import argparse

from entrypoints.connection_flags import ConnectionLimits, add_connection_args
from entrypoints.server import run_server
from tests.robustness.harness import fake_stack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    add_connection_args(parser)
    args = parser.parse_args()
    run_server(fake_stack().app(), "127.0.0.1", args.port, ConnectionLimits.from_args(args))


if __name__ == "__main__":
    main()
