"""What an :class:`AsyncEngine` on a :class:`FakeModelRunner` still holds once its requests
should have ended, and waits for it to run or to let go of everything."""

import time
from typing import Any

from adapters.fake.runner import FakeModelRunner
from application.engine.async_engine import AsyncEngine


class EngineLeftovers:
    """Mixed into a test's stack, which sets ``engine`` and ``runner``."""

    engine: AsyncEngine
    runner: FakeModelRunner

    def leftovers(self) -> dict[str, Any]:
        """What the engine still holds: empty when every request has ended."""
        core = self.engine.engine
        left: dict[str, Any] = {}
        if core.has_work():
            left["queued_or_running"] = len(core.output)
        if self.runner.live:
            left["runner_state"] = sorted(self.runner.live)
        blocks = core.scheduler.blocks  # type: ignore[attr-defined]
        if blocks.num_free_blocks < blocks.num_blocks:
            left["kv_blocks"] = blocks.num_blocks - blocks.num_free_blocks
        if len(self.engine.sink):
            left["open_streams"] = len(self.engine.sink)
        return left

    def wait_idle(self, timeout_s: float = 5.0) -> dict[str, Any]:
        """Poll until nothing is left (empty dict) or ``timeout_s`` passes (what is left)."""
        deadline = time.monotonic() + timeout_s
        while (left := self.leftovers()) and time.monotonic() < deadline:
            time.sleep(0.01)
        return left

    def wait_busy(self, timeout_s: float = 5.0) -> None:
        """Until some request holds runner state (it is running)."""
        deadline = time.monotonic() + timeout_s
        while not self.runner.live:
            assert time.monotonic() < deadline, "no request started"
            time.sleep(0.005)
