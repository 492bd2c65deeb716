"""Which ingress attaches to a running fleet, which deploys it and which is refused
(``adapters.ray.registry.join_action``): an ingress killed outright never blocks the next
start, whatever its flags."""

from adapters.ray.registry import join_action


def test_the_same_fleet_attaches_and_another_is_refused_while_served() -> None:
    assert join_action("f1", "f1", deployed=True, others_alive=True) == "attach"
    assert join_action("f1", "f1", deployed=True, others_alive=False) == "attach"
    assert join_action("f1", "f2", deployed=True, others_alive=True) == "refuse"


def test_a_fleet_nobody_serves_or_nobody_knows_is_deployed_again() -> None:
    assert join_action(None, "f1", deployed=False, others_alive=False) == "deploy"
    assert join_action("f1", "f2", deployed=False, others_alive=True) == "deploy"
    # its ingresses all killed (stale): another fleet replaces it
    assert join_action("f1", "f2", deployed=True, others_alive=False) == "deploy"
    # the application runs but the registry was lost: deployed again with what is asked
    assert join_action(None, "f1", deployed=True, others_alive=False) == "deploy"
