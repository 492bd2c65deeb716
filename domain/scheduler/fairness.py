"""Fairness across tenants for the continuous policy: weighted fair queuing on tokens
scheduled (:class:`TenantShares`) and a waiting queue per (priority, tenant)
(:class:`FairQueue`). A tenant id of None is one tenant of its own."""

import math
from collections import Counter, deque
from collections.abc import Callable, Iterable, Iterator, Mapping

from domain.errors import InvalidParameterError
from domain.request import Request
from domain.tenancy import Tenant


class TenantShares:
    """Each tenant's *virtual time* (tokens scheduled for it divided by its weight) and
    which tenants are active (requests waiting or running).

    A tenant that becomes active starts at the system's virtual time (the least of the
    active tenants'), so idling banks no credit, and keeps a debt it ran up.
    """

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights: dict[str, float] = {}
        self._vtime: dict[str | None, float] = {}  # tenant -> tokens scheduled / weight
        self._active: dict[str | None, int] = {}  # tenant -> its requests waiting or running
        self._vclock = 0.0  # the system's virtual time: the least active one, kept when idle
        self.set_weights(weights or {})

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Each tenant's share of tokens under contention, relative to the others' (tenants
        not named here, and the None tenant, weigh 1.0). Replaces the previous weights;
        service already counted stays counted. A weight must be a positive finite number."""
        for tenant, weight in weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise InvalidParameterError(
                    "tenant_weights", f"tenant {tenant!r}: {weight} is not a positive number"
                )
        self._weights = dict(weights)

    def set_tenants(self, tenants: Iterable[Tenant]) -> None:
        """:meth:`set_weights` from the tenants' own weights (each keyring placed)."""
        self.set_weights({t.id: t.weight for t in tenants})

    def weight(self, tenant_id: str | None) -> float:
        return 1.0 if tenant_id is None else self._weights.get(tenant_id, 1.0)

    def virtual_time(self, tenant_id: str | None) -> float:
        """The tenant's weighted service so far (tokens scheduled / weight)."""
        return self._vtime.get(tenant_id, 0.0)

    def charge(self, tenant: str | None, tokens: int) -> None:
        self._vtime[tenant] = self.virtual_time(tenant) + tokens / self.weight(tenant)

    def activate(self, tenant: str | None) -> None:
        """One more request of ``tenant`` waits or runs."""
        count = self._active.get(tenant, 0)
        if count == 0:  # newly active: no credit for the time it was idle
            self._vtime[tenant] = max(self.virtual_time(tenant), self._system_vtime())
        self._active[tenant] = count + 1

    def deactivate(self, tenant: str | None) -> None:
        """One request of ``tenant`` left (ended, or dropped while waiting)."""
        count = self._active.get(tenant, 0) - 1
        if count > 0:
            self._active[tenant] = count
            return
        vclock = self._system_vtime()  # with this tenant still counted as active
        self._active.pop(tenant, None)
        if len(self._vtime) > 2 * len(self._active) + 64:  # forget idle tenants without debt
            self._vtime = {t: v for t, v in self._vtime.items() if t in self._active or v > vclock}

    def _system_vtime(self) -> float:
        """The least virtual time of the active tenants (monotone; kept while none is)."""
        if self._active:
            least = min(self.virtual_time(t) for t in self._active)
            self._vclock = max(self._vclock, least)
        return self._vclock


class FairQueue:
    """Waiting requests, one FIFO per (priority, tenant). Iterates queue by queue."""

    def __init__(self) -> None:
        # Insertion order: the order the queues became non-empty (ties go to the first).
        self._queues: dict[tuple[int, str | None], deque[Request]] = {}
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Request]:
        for queue in self._queues.values():
            yield from queue

    def append(self, request: Request) -> None:
        self._queue(request).append(request)
        self._len += 1

    def requeue(self, request: Request) -> None:
        """Back to the front of its queue (a preempted request)."""
        self._queue(request).appendleft(request)
        self._len += 1

    def remove(self, request: Request) -> None:
        key = _queue_key(request)
        queue = self._queues[key]
        queue.remove(request)
        self._len -= 1
        if not queue:
            del self._queues[key]

    def priority_counts(self) -> list[tuple[int, int]]:
        """(priority, requests waiting with it), highest priority first."""
        counts: Counter[int] = Counter()
        for (priority, _), queue in self._queues.items():
            counts[priority] += len(queue)
        return sorted(counts.items(), reverse=True)

    def pop_next(self, virtual_time: Callable[[str | None], float]) -> Request:
        """The head of the highest-priority queue whose tenant has the least virtual time."""
        key = min(self._queues, key=lambda k: (-k[0], virtual_time(k[1])))
        queue = self._queues[key]
        request = queue.popleft()
        self._len -= 1
        if not queue:
            del self._queues[key]
        return request

    def _queue(self, request: Request) -> deque[Request]:
        key = _queue_key(request)
        queue = self._queues.get(key)
        if queue is None:
            queue = self._queues[key] = deque()
        return queue


def _queue_key(request: Request) -> tuple[int, str | None]:
    return request.context.priority, request.context.tenant_id
