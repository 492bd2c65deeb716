"""``--replica-gpus``: by default one GPU per replica where the model runs on CUDA, none on a
CPU; given, as given; what each replica deployment asks Ray for."""

import pytest

from adapters.ray.deployment import engine_app, replica_gpus
from domain.errors import InvalidParameterError
from entrypoints.config import ServerConfig, to_json
from entrypoints.config.replica import ReplicaSettings
from entrypoints.replicas import engine_deployment, replica_container


def gpus(config: ServerConfig, device: str) -> float:
    return replica_gpus(config.fleet.replica_gpus, config.model.device, device)


def test_the_default_follows_the_device_and_a_flag_wins() -> None:
    assert gpus(ServerConfig.for_model(replicas=2), "cuda") == 1.0
    assert gpus(ServerConfig.for_model(replicas=2), "cpu") == 0.0
    assert gpus(ServerConfig.for_model(replicas=2, device="cuda:1"), "cpu") == 1.0
    assert gpus(ServerConfig.for_model(replicas=2, replica_gpus=0.5), "cpu") == 0.5
    with pytest.raises(InvalidParameterError, match="replica_gpus"):
        ReplicaSettings(replica_gpus=-1)


def test_each_replica_asks_ray_for_them() -> None:
    config = ServerConfig.for_model(replicas=2)
    app = engine_app(engine_deployment(config, gpus=1.0), to_json(config), replica_container)
    options = app._bound_deployment.ray_actor_options
    assert (options["num_gpus"], options["num_cpus"]) == (1.0, 1.0)
