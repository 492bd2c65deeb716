"""GenerationProbe: a health check that runs the engine — a short prompt's prefill and a
few decode steps, greedy — on the base model or one adapter (a rollout's build), timed.

Probes of one model share the run in progress and reuse its result for ``reuse_s``: a load
balancer (or an attacker) polling it costs at most one tiny generation per model per
``reuse_s``. The probe queues like any request (default priority): under load its time to
first token is what a caller would see.
"""

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from application.engine.engine_client import EngineClient
from application.engine.request_ids import new_request_id
from domain.sampling import SamplingParams

PROMPT = "The capital of France is"
TOKENS = 3  # a prefill, then two decode steps
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_REUSE_S = 1.0


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """``ok``: the tokens came; ``ttft_ms``: the prompt to its first token (the prefill,
    queueing included); ``tpot_ms``: the mean time of each later token (decode);
    ``error``: why not."""

    ok: bool
    tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    error: str | None = None
    at: float = 0.0  # monotonic time it ended


class GenerationProbe:
    def __init__(
        self,
        engine: EngineClient,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        reuse_s: float = DEFAULT_REUSE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.engine, self.timeout_s, self.reuse_s, self.clock = engine, timeout_s, reuse_s, clock
        self._running: dict[str | None, asyncio.Task[ProbeResult]] = {}
        self._last: dict[str | None, ProbeResult] = {}

    async def run(self, adapter_id: str | None = None) -> ProbeResult:
        """The probe of ``adapter_id``'s model (None: the base model)."""
        last = self._last.get(adapter_id)
        if last is not None and self.clock() - last.at < self.reuse_s:
            return last
        task = self._running.get(adapter_id)
        if task is None:
            task = asyncio.create_task(self._probe(adapter_id))
            self._running[adapter_id] = task
            task.add_done_callback(lambda _: self._running.pop(adapter_id, None))
        return await asyncio.shield(task)

    async def _probe(self, adapter_id: str | None) -> ProbeResult:
        if not self.engine.healthy:
            return self._keep(adapter_id, ProbeResult(False, error="the engine loop is down"))
        params = SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)
        request_id = new_request_id("probe")
        started = self.clock()
        times: list[float] = []
        try:
            async with asyncio.timeout(self.timeout_s):
                stream = await self.engine.stream(request_id, PROMPT, params, adapter_id=adapter_id)
                async for output in stream:
                    if output.token_id is not None:
                        times.append(self.clock())
                    if output.finished:
                        if output.finish_reason == "error":
                            raise RuntimeError("the engine failed the probe's request")
                        break
        except TimeoutError:
            self.engine.abort([request_id])
            error = f"no {TOKENS} tokens within {self.timeout_s:g} s ({len(times)} came)"
            return self._keep(adapter_id, ProbeResult(False, len(times), error=error))
        except Exception as e:
            self.engine.abort([request_id])
            return self._keep(adapter_id, ProbeResult(False, len(times), error=str(e)[:300]))
        if not times:
            return self._keep(adapter_id, ProbeResult(False, error="no token came"))
        ttft = (times[0] - started) * 1000
        tpot = (times[-1] - times[0]) * 1000 / (len(times) - 1) if len(times) > 1 else None
        result = ProbeResult(True, len(times), round(ttft, 2), tpot and round(tpot, 2))
        return self._keep(adapter_id, result)

    def _keep(self, adapter_id: str | None, result: ProbeResult) -> ProbeResult:
        kept = ProbeResult(
            result.ok, result.tokens, result.ttft_ms, result.tpot_ms, result.error, self.clock()
        )
        self._last[adapter_id] = kept
        return kept
