"""The :class:`~domain.rollout.RolloutStore` port in SQL, in the usage ledger's database
(``--usage-db``: SQLite or PostgreSQL): table ``infer_rollouts`` (a row per rollout, its
targets and rollback policy as JSON) and ``infer_rollouts_version`` (one row, bumped in the
same transaction as every change, which the servers poll)."""

import json

from adapters.storage.sql import TableStore, dialect_for
from domain.rollout import RollbackPolicy, Rollout, RolloutTarget


def rollout_spec(rollout: Rollout) -> str:
    policy = rollout.rollback
    return json.dumps(
        {
            "targets": [
                {"model": t.model, "weight": t.weight, "tenants": sorted(t.tenants)}
                for t in rollout.targets
            ],
            "rollback": None
            if policy is None
            else {
                "max_error_rate": policy.max_error_rate,
                "min_requests": policy.min_requests,
                "window": policy.window,
            },
        }
    )


def rollout_of(name: str, spec: str) -> Rollout:
    data = json.loads(spec)
    targets = tuple(
        RolloutTarget(t["model"], float(t["weight"]), frozenset(t["tenants"]))
        for t in data["targets"]
    )
    policy = data["rollback"]
    return Rollout(name, targets, None if policy is None else RollbackPolicy(**policy))


SqlRolloutStore = TableStore[Rollout]


def open_rollout_store(target: str) -> SqlRolloutStore:
    """The rollouts kept in the database ``target`` names (``--usage-db``'s)."""
    return TableStore(
        dialect_for(target), "infer_rollouts", "spec", _name, rollout_spec, rollout_of
    )


def _name(rollout: Rollout) -> str:
    return rollout.name
