"""``python -m tests.robustness.fake_serve --port P [infer serve's connection flags]``: the
HTTP app on the fake model under ``run_server`` (what ``infer serve`` runs), for tests that
need a process of their own (its open-files limit, its log)."""

import argparse

from adapters.http.uvicorn_server import run_server
from entrypoints.config.connection import add_connection_args, connection_limits
from tests.robustness.harness import fake_stack


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    add_connection_args(parser)
    args = parser.parse_args()
    run_server(fake_stack().app(), "127.0.0.1", args.port, connection_limits(args))


if __name__ == "__main__":
    main()
