"""Running an engine in a test: a synchronous :class:`Engine` stepped until it is done, and
a bounded wait for a running :class:`AsyncEngine` to reach a state."""

import asyncio
from collections.abc import Callable

from application.engine.engine import Engine


def run_to_end(engine: Engine, max_steps: int = 100) -> None:
    """Step ``engine`` until it has no work; still busy after ``max_steps``: the test fails."""
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


async def wait_for(done: Callable[[], bool], tries: int = 400, interval_s: float = 0.005) -> None:
    """Until ``done()`` holds, ``tries`` × ``interval_s`` at most (then the caller's own
    assertion says what is wrong)."""
    for _ in range(tries):
        if done():
            return
        await asyncio.sleep(interval_s)
