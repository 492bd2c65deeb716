"""One process's services around its engine: started in order, stopped in reverse, the
same for ``infer serve``'s app and a fleet's replica (application/lifecycle.py)."""

import asyncio
import gc

from application.lifecycle import Lifecycle


class Recorded:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name, self.calls = name, calls

    def start(self) -> None:
        self.calls.append(f"{self.name} start")

    async def stop(self) -> None:
        self.calls.append(f"{self.name} stop")

    def close(self) -> None:
        self.calls.append(f"{self.name} close")


async def test_services_start_in_order_and_stop_in_reverse() -> None:
    calls: list[str] = []
    watching = asyncio.Event()

    async def watch() -> None:
        calls.append("watch runs")
        watching.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            calls.append("watch cancelled")
            raise

    lifecycle = Lifecycle(
        Recorded("engine", calls),
        Recorded("usage", calls),  # type: ignore[arg-type]
        tinker=Recorded("tinker", calls),
        embeddings=Recorded("embeddings", calls),
        watches=[watch],
    )
    try:
        await lifecycle.start()
        assert gc.get_freeze_count() > 0  # the start-up heap out of the collector's sight
        await asyncio.wait_for(watching.wait(), 5)
        await lifecycle.stop()
    finally:
        gc.unfreeze()
    assert calls == [
        "usage start",
        "engine start",
        "tinker start",
        "watch runs",
        "watch cancelled",
        "tinker stop",
        "embeddings stop",
        "engine stop",
        "usage close",
    ]
