"""A session with work in flight stays alive whatever its heartbeats: a server loaded
enough to delay them (thousands of concurrent samples) must not end the sessions loading
it; once its work is done, its silence counts from then."""

from application.tinker.futures import FutureStore
from application.tinker.sessions import SessionManager


def test_busy_sessions_are_not_expired_and_their_silence_counts_from_then() -> None:
    now = [0.0]
    sessions = SessionManager(timeout_s=100.0, clock=lambda: now[0])
    busy, idle = sessions.create("a"), sessions.create("a")
    now[0] = 500.0  # no heartbeat from either for 500 s; busy has work in flight
    assert sessions.expire_stale(busy={busy.id}) == [idle]
    assert busy.ended is None and idle.ended == "expired"
    now[0] = 590.0  # its work ended at 500: 90 s of silence since
    assert sessions.expire_stale() == []
    now[0] = 601.0
    assert sessions.expire_stale() == [busy]


async def test_the_future_store_names_the_sessions_with_unfinished_work() -> None:
    futures = FutureStore()
    running, done, other = (futures.create("a", "Sample") for _ in range(3))
    running.session_id, done.session_id = "s1", "s2"
    futures.resolve(done, None)
    assert futures.busy_sessions() == {"s1"}  # a future without a session names none
    del other
