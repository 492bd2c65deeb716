"""The usage ledger: one record per API request that ended, kept in a database, and the
totals read back from it by time bucket (the usage API, the console, daily quotas).

A :class:`UsageRecord` is plain data about a request, never its text: who (tenant), what
(model, route, kind), when it ended, how it ended (HTTP status) and the tokens it used.
The :class:`UsageLedger` port stores records and sums them; its adapters are SQLite (one
machine) and PostgreSQL (every process of a fleet writing to one place).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

# What a record's tokens were spent on: the OpenAI usage API's two endpoints.
COMPLETIONS, EMBEDDINGS = "completions", "embeddings"
KINDS = (COMPLETIONS, EMBEDDINGS)
# The columns totals may be grouped by.
GROUP_COLUMNS = ("tenant_id", "model", "route", "key_id")


@dataclass(frozen=True, slots=True)
class UsageRecord:
    """``ended_s``: wall time (unix seconds) the request ended; ``tenant_id`` None: an open
    server's caller; ``status``: the HTTP status it was answered (499: the client went
    away before an answer)."""

    ended_s: float
    request_id: str
    tenant_id: str | None
    model: str | None
    route: str
    kind: str
    status: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    latency_ms: float = 0.0
    key_id: str | None = None  # the API key's public id (``key_...``; None: no key)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    """Records that ended in [``start_s``, ``end_s``), summed per ``bucket_s`` seconds from
    ``start_s`` and per the values of ``group_by`` (of :data:`GROUP_COLUMNS`); ``tenants``
    / ``models`` / ``kind``: only those (None: all)."""

    start_s: float
    end_s: float
    bucket_s: int
    group_by: tuple[str, ...] = ()
    tenants: frozenset[str] | None = None
    models: frozenset[str] | None = None
    kind: str | None = None

    def __post_init__(self) -> None:
        if self.bucket_s <= 0 or self.end_s < self.start_s:
            raise ValueError("a usage query needs bucket_s > 0 and end_s >= start_s")
        if unknown := set(self.group_by) - set(GROUP_COLUMNS):
            raise ValueError(f"cannot group usage by {sorted(unknown)}")


@dataclass(frozen=True, slots=True)
class UsageTotals:
    """One bucket's sums for one group (``group``: the grouped columns' values, in
    ``group_by``'s order). ``requests`` counts every record; ``succeeded`` those answered
    2xx; ``rate_limited`` those answered 429; ``failed`` the other 4xx / 5xx / 499."""

    bucket: int  # the bucket's index from the query's start
    group: tuple[str | None, ...]
    requests: int
    succeeded: int
    rate_limited: int
    failed: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int


class UsageLedger(Protocol):
    """Where usage records are kept. Calls block (a database round trip): the application
    calls them from a worker thread, never the event loop."""

    def append(self, records: Sequence[UsageRecord]) -> None:
        """Store ``records`` at once (one transaction): all or none."""
        ...

    def totals(self, query: UsageQuery) -> list[UsageTotals]:
        """The non-empty buckets' sums, by bucket then group."""
        ...

    def prune(self, before_s: float) -> int:
        """Drop the records that ended before ``before_s``; how many went."""
        ...

    def close(self) -> None: ...
