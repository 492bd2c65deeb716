"""``python -m tests.robustness.transport_serve --port P [--step-latency S] [infer serve's
transport flags]``: the composition root on the fake runner (every reply endless: it runs
until ``max_tokens``) under ``run_server`` with the transport settings, wired as
``infer serve`` wires them, for tests that signal the process or serve TLS."""

import argparse

from adapters.fake import ByteTokenizer
from adapters.fake.runner import FakeModelRunner, reply_script
from adapters.http.uvicorn_server import ConnectionLimits, run_server
from entrypoints.config.transport import TransportSettings, add_address_args, add_transport_args
from tests.fakes import fake_container

MODEL = "fake"


def main() -> None:
    parser = argparse.ArgumentParser()
    add_address_args(parser)
    parser.add_argument("--step-latency", type=float, default=0.0)
    add_transport_args(parser)
    args = parser.parse_args()
    transport = TransportSettings.from_args(args)
    runner = FakeModelRunner(
        script=reply_script(ByteTokenizer(), "Paris", then_eos=False),
        step_latency_s=args.step_latency,
    )
    container = fake_container(runner, http=transport)
    run_server(
        container.http_app(),
        transport.host,
        transport.port,
        ConnectionLimits(),
        draining=container.draining(),
        drain_timeout_s=transport.drain_timeout,
        **transport.uvicorn_tls(),
    )


if __name__ == "__main__":
    main()
