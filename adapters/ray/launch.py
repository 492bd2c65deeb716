"""Starting and stopping what ``infer serve --replicas N`` runs on Ray, each within bounded
time: Ray itself (a local cluster, or ``--ray-address``'s), the Serve application (its
replicas started within ``--replica-start-timeout``), and Ray's shutdown. A wait past its
bound is an :class:`~domain.errors.InvalidParameterError` naming the flag; SIGINT/SIGTERM
during the start (:func:`on_stop_signals`, :data:`STOPPED`) end it with
``KeyboardInterrupt``, so that the caller stops what started."""

import contextlib
import signal
import threading
import time
from typing import Any

import ray
from ray import serve
from ray._private import auto_init_hook
from ray.serve.config import ProxyLocation
from ray.serve.handle import DeploymentHandle

from adapters.ray.ingress import APP_NAME
from adapters.ray.registry import REGISTRY_NAME, FleetRegistry
from domain.errors import InvalidParameterError

STOPPED: list[int] = []  # signals received (a flag: a handler must take no lock)


def on_stop_signals() -> None:
    """SIGINT/SIGTERM set the flag from now on (again after ray.init, which sets its own)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, _: STOPPED.append(signum))


def start_ray(address: str | None, timeout_s: float) -> None:
    """Ray: a local cluster (``address`` None), else the one at ``address`` (within
    ``timeout_s``: ``--ray-address``)."""
    try:
        if address is None:
            ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)
        else:
            within(timeout_s, "ray_address", lambda: ray.init(address=address))
    except ConnectionError as e:
        raise InvalidParameterError("ray_address", f"no Ray cluster reached: {e}") from e


def start_serve() -> Any:
    """The fleet's registry (its handle: the actor lives while it is held) and Ray Serve,
    without its HTTP proxy (the HTTP port is the server's)."""
    registry = FleetRegistry.options(name=REGISTRY_NAME).remote()  # type: ignore[attr-defined]
    serve.start(proxy_location=ProxyLocation.Disabled)
    return registry


def run_bounded(app: Any, timeout_s: float) -> DeploymentHandle:
    """Deploy ``app``; its replicas not started within ``timeout_s``: an error naming
    ``--replica-start-timeout``."""
    handles: list[DeploymentHandle] = []
    within(
        timeout_s,
        "replica_start_timeout",
        lambda: handles.append(serve.run(app, name=APP_NAME, route_prefix=None, blocking=False)),
        what="the replicas did not start (a cluster short of CPUs for --replicas?)",
    )
    return handles[0]


def within(timeout_s: float, flag: str, work: Any, what: str = "no answer") -> None:
    """Run ``work`` on a thread; past ``timeout_s`` it is an error naming ``flag``."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            work()
        except BaseException as e:  # reported on the caller's thread
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True, name=f"ray-{flag}")
    thread.start()
    deadline = time.monotonic() + timeout_s
    while thread.is_alive() and time.monotonic() < deadline and not STOPPED:
        thread.join(0.2)
    if STOPPED:
        raise KeyboardInterrupt  # stopped during the start: clean up what started
    if thread.is_alive():
        raise InvalidParameterError(flag, f"{what} within {timeout_s:g} s")
    if errors:
        raise errors[0]


def stop_ray() -> None:
    """Ray Serve's application and Ray (the local cluster, or the connection to one)."""
    with contextlib.suppress(Exception):
        serve.shutdown()
    # A handle's long poll answered during the shutdown must not start Ray again: that
    # waits on the lock ray.shutdown holds while it waits for that callback (a hang).
    auto_init_hook.enable_auto_connect = False
    ray.shutdown()
