"""``infer serve`` flags for running several engine replicas on Ray Serve
(:mod:`entrypoints.replicas`): how many, which cluster, how calls are routed."""

import argparse
from dataclasses import dataclass

from domain.errors import InvalidParameterError
from domain.routing import POLICIES
from entrypoints.config.flag_fields import from_flags


@dataclass(frozen=True)
class ReplicaSettings:
    """``replicas``: engine replicas on Ray Serve (0: one process, no Ray); ``ray_address``:
    a cluster to join (None: a local one, started and stopped with the server);
    ``routing``: the routing policy (:mod:`domain.routing`); ``replica_cpus``: CPUs Ray
    reserves per replica (None: ``--threads``, else 1); ``replica_start_timeout``: seconds
    the replicas may take to start before the server gives up with an error;
    ``replica_id``: in a replica's own configuration, its id (no flag: the fleet sets it;
    Tinker puts it in its ids), else empty."""

    replicas: int = 0
    ray_address: str | None = None
    routing: str = "prefix"
    replica_cpus: float | None = None
    replica_gpus: float | None = None
    replica_start_timeout: float = 300.0
    replica_id: str = ""

    def __post_init__(self) -> None:
        if self.replicas < 0:
            raise InvalidParameterError("replicas", f"must be >= 0, got {self.replicas}")
        if self.routing not in POLICIES:
            raise InvalidParameterError("routing", f"one of {', '.join(POLICIES)}")
        if self.replica_cpus is not None and self.replica_cpus <= 0:
            raise InvalidParameterError("replica_cpus", "must be > 0")
        if self.replica_gpus is not None and self.replica_gpus < 0:
            raise InvalidParameterError("replica_gpus", "must be >= 0")
        if self.replica_start_timeout <= 0:
            raise InvalidParameterError("replica_start_timeout", "must be > 0")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "ReplicaSettings":
        return from_flags(cls, args, replica_id="")


def add_replica_args(parser: argparse.ArgumentParser) -> None:
    defaults = ReplicaSettings()
    group = parser.add_argument_group("replicas (Ray Serve; see README: several machines)")
    group.add_argument(
        "--replicas",
        type=int,
        default=defaults.replicas,
        help="engine replicas behind this server's port, on Ray Serve, routed by "
        "--routing (default %(default)s: one process, Ray not used)",
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
    group.add_argument(
        "--replica-start-timeout",
        type=float,
        default=defaults.replica_start_timeout,
        help="seconds the replicas may take to load and start; past it the server stops "
        "with an error (default %(default)s)",
    )
