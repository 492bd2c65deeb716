"""Scheduler policies: which requests run in the next step, and how many tokens each.

The decision is plain data (:class:`SchedulerOutput`); the runner returns plain data
(:class:`RunnerOutput`); ``update_from_output`` applies it: token appended, EOS / stop
token / length checks, state changes, each sampled token reported with the finish it caused.
Stop *strings* need text: the engine's output stage finds them and hands them back through
``finish_requests``. A policy releases finished requests at its next ``schedule``.

The continuous policy is fair across tenants (weighted fair queuing on tokens scheduled)
and honours ``request.context.priority``, preempting lower-priority requests when the batch
is full; the static policy is FCFS.

KV memory is paged (:mod:`domain.kv_blocks`): each policy owns a :class:`BlockManager`, and
every scheduled chunk carries its request's block table for the runner. The continuous
policy admits and grows requests by free blocks, reuses cached prefixes (prefix caching)
and preempts when blocks run out; the static policy reserves ``max_model_len`` positions per
request of a batch (no prefix caching).

Modules: ``outputs`` (the data), ``base`` (the interface and the shared queueing base),
``static``, ``continuous``, ``fairness`` (tenant shares, the fair waiting queue),
``shared_prefill`` (one prompt's KV computed once for several requests).
"""

import time
from collections.abc import Callable, Iterable

from domain.config import EngineConfig
from domain.scheduler.base import Scheduler
from domain.scheduler.continuous import ContinuousScheduler
from domain.scheduler.fairness import TenantShares
from domain.scheduler.outputs import (
    KVStats,
    RunnerOutput,
    SampledToken,
    ScheduledChunk,
    SchedulerOutput,
)
from domain.scheduler.static import StaticScheduler

__all__ = [
    "ContinuousScheduler",
    "KVStats",
    "RunnerOutput",
    "SampledToken",
    "ScheduledChunk",
    "Scheduler",
    "SchedulerOutput",
    "StaticScheduler",
    "TenantShares",
    "make_scheduler",
]


def make_scheduler(
    config: EngineConfig,
    eos_token_ids: Iterable[int],
    clock: Callable[[], float] = time.monotonic,
    *,
    shares: TenantShares | None = None,
) -> Scheduler:
    """The policy ``config.batching_mode`` names; ``clock``: the engine's; ``shares``: the
    tenants' weights the continuous policy queues by (the static one is FCFS)."""
    if config.batching_mode == "static":
        return StaticScheduler(config, eos_token_ids, clock)
    return ContinuousScheduler(config, eos_token_ids, shares=shares)
