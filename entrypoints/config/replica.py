"""``infer serve`` flags for running several engine replicas on Ray Serve
(:mod:`entrypoints.replicas`): how many, which cluster, how calls are routed."""

import argparse
from dataclasses import dataclass

from domain.breaker import BreakerSettings
from domain.errors import InvalidParameterError
from domain.routing import POLICIES
from entrypoints.config.flag_fields import from_flags

_BREAKER = BreakerSettings()


@dataclass(frozen=True)
class ReplicaSettings:
    """``replicas``: engine replicas on Ray Serve (0: one process, no Ray);
    ``standby_replicas``: warm replicas beside them that take calls only while breakers
    keep serving replicas out; ``ray_address``:
    a cluster to join (None: a local one, started and stopped with the server);
    ``routing``: the routing policy (:mod:`domain.routing`); ``replica_cpus``: CPUs Ray
    reserves per replica (None: ``--threads``, else 1); ``replica_start_timeout``: seconds
    the replicas may take to start before the server gives up with an error;
    ``replica_id``: in a replica's own configuration, its id (no flag: the fleet sets it;
    Tinker puts it in its ids), else empty; ``replica_rank``: there, its rank (Ray Serve's:
    0 to the replicas less one, a restarted replica taking the rank its predecessor freed;
    the KV events' port and ``data_parallel_rank``), else None. The ``cb_*`` fields and
    ``disable_circuit_breaker``: each replica's circuit breaker at the ingress
    (:class:`~domain.breaker.BreakerSettings`, sglang-router's spelling)."""

    replicas: int = 0
    standby_replicas: int = 0
    ray_address: str | None = None
    routing: str = "prefix"
    replica_cpus: float | None = None
    replica_gpus: float | None = None
    replica_start_timeout: float = 300.0
    replica_id: str = ""
    replica_rank: int | None = None
    cb_failure_threshold: int = _BREAKER.failure_threshold
    cb_failure_rate: float = _BREAKER.failure_rate
    cb_window_duration_secs: float = _BREAKER.window_s
    cb_min_requests: int = _BREAKER.min_requests
    cb_timeout_duration_secs: float = _BREAKER.cooldown_s
    disable_circuit_breaker: bool = False

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidParameterError("replicas", f"must be >= 0, got {self.replicas}")
        if self.standby_replicas < 0 or (self.standby_replicas and not self.replicas):
            raise InvalidParameterError("standby_replicas", "must be >= 0, with --replicas")
        if self.routing not in POLICIES:
            raise InvalidParameterError("routing", f"one of {', '.join(POLICIES)}")
        if self.replica_cpus is not None and self.replica_cpus <= 0:
            raise InvalidParameterError("replica_cpus", "must be > 0")
        if self.replica_gpus is not None and self.replica_gpus < 0:
            raise InvalidParameterError("replica_gpus", "must be >= 0")
        if self.replica_start_timeout <= 0:
            raise InvalidParameterError("replica_start_timeout", "must be > 0")
        self.breaker()

    def breaker(self) -> BreakerSettings:
        """The replicas' circuit breaker settings (checked: errors name the flag)."""
        return BreakerSettings(
            enabled=not self.disable_circuit_breaker,
            failure_threshold=self.cb_failure_threshold,
            failure_rate=self.cb_failure_rate,
            window_s=self.cb_window_duration_secs,
            min_requests=self.cb_min_requests,
            cooldown_s=self.cb_timeout_duration_secs,
        )

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReplicaSettings":
        return from_flags(cls, args, replica_id="", replica_rank=None)


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    defaults = ReplicaSettings()
    group = parser.add_argument_group("replicas (Ray Serve; see README: several machines)")
    _add_fleet_args(group, defaults)
    _add_resource_args(group, defaults)
    _add_breaker_args(group, defaults)
    group.add_argument(
        "--replica-start-timeout",
        type=float,
        default=defaults.replica_start_timeout,
        help="seconds the replicas may take to load and start; past it the server stops "
        "with an error (default %(default)s)",
    )


def _add_fleet_args(group: argparse._ArgumentGroup, defaults: ReplicaSettings) -> None:
    """How many replicas (serving, standby), on which cluster, routed how."""
    group.add_argument(
        "--replicas",
        type=int,
        default=defaults.replicas,
        help="engine replicas behind this server's port, on Ray Serve, routed by "
        "--routing (default %(default)s: one process, Ray not used)",
    )
    group.add_argument(
        "--standby-replicas",
        type=int,
        default=defaults.standby_replicas,
        help="warm replicas beside --replicas (started, loaded, routed to only while "
        "circuit breakers keep serving replicas out; default %(default)s)",
    )
    group.add_argument(
        "--ray-address",
        default=defaults.ray_address,
        help="the Ray cluster to run the replicas on (`ray start --head` prints it; "
        "default: a local cluster, started and stopped with the server)",
    )
    group.add_argument(
        "--routing",
        choices=POLICIES,
        default=defaults.routing,
        help="how calls pick a replica: prefix (the replica caching most of the prompt, "
        "weighed with queue and KV use), pow2 (the less loaded of two), round-robin "
        "(default %(default)s)",
    )


def _add_resource_args(group: argparse._ArgumentGroup, defaults: ReplicaSettings) -> None:
    """What Ray reserves per replica."""
    group.add_argument(
        "--replica-cpus",
        type=float,
        default=defaults.replica_cpus,
        help="CPUs Ray reserves per replica (default: --threads, else 1)",
    )
    group.add_argument(
        "--replica-gpus",
        type=float,
        default=defaults.replica_gpus,
        help="GPUs Ray reserves per replica, which it then shows the replica "
        "(CUDA_VISIBLE_DEVICES; a fraction shares one; default: 1 where the model runs on "
        "CUDA, 0 on a CPU)",
    )


def _add_breaker_args(group: argparse._ArgumentGroup, defaults: ReplicaSettings) -> None:
    """Each replica's circuit breaker at the ingress."""
    group.add_argument(
        "--cb-failure-threshold",
        type=int,
        default=defaults.cb_failure_threshold,
        help="consecutive failed calls (the replica lost, or its engine failed them) that "
        "take a replica out of routing (its circuit breaker opens; default %(default)s)",
    )
    group.add_argument(
        "--cb-failure-rate",
        type=float,
        default=defaults.cb_failure_rate,
        help="the fraction of a replica's calls in --cb-window-duration-secs that fail (of "
        "at least --cb-min-requests) that opens its breaker too (default %(default)s)",
    )
    group.add_argument(
        "--cb-window-duration-secs",
        type=float,
        default=defaults.cb_window_duration_secs,
        help="the window of the failure rate, seconds (default %(default)s)",
    )
    group.add_argument(
        "--cb-min-requests",
        type=int,
        default=defaults.cb_min_requests,
        help="calls in the window before the failure rate counts (default %(default)s)",
    )
    group.add_argument(
        "--cb-timeout-duration-secs",
        type=float,
        default=defaults.cb_timeout_duration_secs,
        help="seconds an open breaker waits before its replica is probed with a short "
        "generation (half-open); it closes when the probe answers (default %(default)s)",
    )
    group.add_argument(
        "--disable-circuit-breaker",
        action="store_true",
        help="never take a replica out of routing for its failures",
    )
