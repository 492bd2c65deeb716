"""Starting and stopping what ``infer serve --replicas N`` runs on Ray, each within bounded
time: Ray itself (a local cluster, or ``--ray-address``'s), the Serve application (its
replicas started within ``--replica-start-timeout``), and Ray's shutdown.

Several ingresses may serve one fleet: an ingress started against a cluster whose fleet
runs already attaches to it (:class:`Membership`: counted in the fleet's registry, beating
every second) instead of deploying it again, and one that stops leaves the application to
the others: the last one out stops it (an ingress killed outright stops counting after
:data:`~adapters.ray.registry.INGRESS_STALE_AFTER_S`). A wait past its
bound is an :class:`~domain.errors.InvalidParameterError` naming the flag; SIGINT/SIGTERM
during the start (:func:`on_stop_signals`, :data:`STOPPED`) end it with
``KeyboardInterrupt``, so that the caller stops what started."""

import contextlib
import hashlib
import os
import signal
import socket
import threading
import time
from typing import Any

import ray
from ray import serve
from ray._private import auto_init_hook
from ray.serve._private.constants import SERVE_CONTROLLER_NAME, SERVE_NAMESPACE
from ray.serve.config import ProxyLocation
from ray.serve.handle import DeploymentHandle

from adapters.ray.ingress import APP_NAME
from adapters.ray.registry import REPORT_EVERY_S, registry_or_new
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


class Membership:
    """This ingress in the fleet's registry: :meth:`join` (whether the application runs
    already: attach, else deploy), a beat every :data:`REPORT_EVERY_S` while it serves, and
    :meth:`leave` (whether it was the last ingress out)."""

    def __init__(self, port: int) -> None:
        self.id = f"{socket.gethostname()}:{os.getpid()}:{port}"
        self._registry = registry_or_new()
        self._beating = threading.Event()

    def join(self, fleet: object) -> bool:
        """Counted in; True where the fleet runs already (attach to it), False where this
        ingress deploys it. ``fleet``: what makes it (the model's, the engine's and the
        replicas' settings, compared by their repr); another fleet than the one running
        while other ingresses serve it is an error: one cluster serves one fleet."""
        fingerprint = hashlib.sha256(repr(fleet).encode()).hexdigest()[:16]
        action = ray.get(self._registry.join.remote(self.id, fingerprint, fleet_running()))
        if action == "refuse":
            raise InvalidParameterError(
                "ray_address",
                "this cluster already serves a fleet of another model, engine or replica "
                "count; start this ingress with the same flags, or against another cluster",
            )
        threading.Thread(target=self._beat, daemon=True, name="fleet-membership").start()
        return action == "attach"

    def _beat(self) -> None:
        while not self._beating.wait(REPORT_EVERY_S):
            with contextlib.suppress(Exception):  # a lost beat: the next one counts
                ray.get(self._registry.beat.remote(self.id), timeout=REPORT_EVERY_S * 5)

    def leave(self) -> bool:
        """Counted out; True where no other ingress is alive (stop the application)."""
        self._beating.set()
        try:
            others: list[str] = ray.get(self._registry.leave.remote(self.id), timeout=30)
        except Exception:  # the registry gone: nothing left to keep up
            return True
        if not others:
            with contextlib.suppress(Exception):
                ray.kill(self._registry)
        return not others


def fleet_running() -> bool:
    """Whether the cluster's Serve runs the fleet's application."""
    with contextlib.suppress(Exception):
        return APP_NAME in serve.status().applications
    return False


def start_serve() -> None:
    """Ray Serve, without its HTTP proxy (the HTTP port is the server's)."""
    serve.start(proxy_location=ProxyLocation.Disabled)


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


def stop_ray(last: bool = True) -> None:
    """Ray Serve's application where this was the ``last`` ingress, and Ray (the local
    cluster, or the connection to one)."""
    if last:
        # The application first: Serve's shutdown begins with the cached handles, whose
        # router ran on the server's event loop, closed by now: it raises there, before
        # it reaches the controller (one ingress on its own local cluster never noticed:
        # the cluster goes with it).
        with contextlib.suppress(Exception):
            serve.delete(APP_NAME)
        try:
            serve.shutdown()
        except Exception:  # then Serve's controller directly (a detached actor)
            with contextlib.suppress(Exception):
                controller = ray.get_actor(SERVE_CONTROLLER_NAME, namespace=SERVE_NAMESPACE)
                ray.get(controller.graceful_shutdown.remote(), timeout=30)
    # A handle's long poll answered during the shutdown must not start Ray again: that
    # waits on the lock ray.shutdown holds while it waits for that callback (a hang).
    auto_init_hook.enable_auto_connect = False
    ray.shutdown()
