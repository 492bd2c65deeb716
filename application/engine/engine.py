"""The engine: one synchronous step at a time — schedule, run, apply, output, observe.

``step()`` never blocks on I/O; output leaves through the OutputSink port, statistics
through the StepObserver port. Token-level stops (EOS, stop ids, length) are the
scheduler's; text and stop strings are the output stage's (:mod:`application.engine.output`),
which hands stop-string hits back to the scheduler.
"""

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from application.engine.output import OutputProcessor
from application.engine.request_checks import RequestChecks
from application.engine.speculation import make_speculator
from application.engine.step_stats import StepStatsCollector
from domain.config import EngineConfig
from domain.observer import NullObserver, RequestStart, StepObserver, StepStats
from domain.ports import GrammarCompiler, ModelRunner, OutputSink, Tokenizer
from domain.request import AdmitCall, Request, StepOutput
from domain.scheduler import Scheduler, SchedulerOutput, make_scheduler
from domain.speculation import StepCosts

log = structlog.get_logger(__name__)
# What a client is told when a step fails (a bug or the device, not its request).
STEP_FAILED = "internal error: the engine step failed (details in the server log)"


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine now, for a fleet's router and its operators: requests running and
    waiting, the KV pool's use (0..1), and prompt tokens looked up in the prefix cache
    since start, and of those found there."""

    running: int
    waiting: int
    kv_usage: float
    prefix_queried_tokens: int
    prefix_hit_tokens: int


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        tokenizer: Tokenizer,
        sink: OutputSink,
        *,
        scheduler: Scheduler | None = None,
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
        observer: StepObserver | None = None,
        grammar: GrammarCompiler | None = None,
        draft: ModelRunner | None = None,
        step_costs: StepCosts | None = None,
    ) -> None:
        """``clock``: what requests and steps are timed on, and the static policy's batch
        wait (tests pass ``tests.fakes.ManualClock``); the step loop reads no other.
        ``observer``: receives every step's :class:`StepStats` (metrics, tracing).
        ``vocab_size`` and ``grammar``: the request checks' (:class:`RequestChecks`).
        ``draft``: the draft model's runner (``speculative.method`` ``draft_model``), with
        a KV pool of ``config``'s blocks. ``step_costs``: what the runner's steps cost by
        shape (the torch runner measures them), from which speculation decides per step
        what to draft."""
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.sink = sink
        self.clock = clock
        self.scheduler = scheduler or make_scheduler(config, tokenizer.eos_token_ids, clock)
        self.checks = RequestChecks(
            config, tokenizer, room=self.scheduler.room, vocab_size=vocab_size, grammar=grammar
        )
        self.observer: StepObserver = observer or NullObserver()
        self.output = OutputProcessor(tokenizer)
        self.speculator = make_speculator(config, draft, step_costs, self.checks.vocab_size)
        self.stats = StepStatsCollector(self.scheduler)

    @property
    def vocab_size(self) -> int:
        return self.checks.vocab_size

    def admit(self, call: AdmitCall) -> list[Request]:
        """Queue ``call``'s prepared prompts (:meth:`RequestChecks.prepare`'s ids) all
        together or none: raises what :meth:`RequestChecks.check_room` raises, with nothing
        queued. Choice j of prompt i (``request_ids[i * n + j]``) runs
        ``params.for_choice(j)``; a prompt's choices share one prefill
        (:attr:`Request.prefill_source_id`), unless they ask for prompt logprobs.
        ``call.adapter_folder`` is a fleet's: the runner must hold the adapter by now."""
        request_ids, prompts, params, n = call.request_ids, call.prompts, call.params, call.n
        assert len(request_ids) == len(prompts) * n, "n request ids per prompt"
        self.checks.check_room(len(prompts), n)
        now = self.clock()
        requests = []
        share = n > 1 and not params.prompt_logprobs
        for i, request_id in enumerate(request_ids):
            prompt, choice = prompts[i // n], i % n
            shared = share and len(prompt) > 1
            request = Request(
                request_id,
                prompt,
                params.for_choice(choice),
                now,
                adapter_id=call.adapter_id,
                context=call.context,
                prefill_source_id=request_ids[i - choice] if shared and choice else None,
                shares_prefill=shared and not choice,
            )
            requests.append(request)
        for request in requests:
            self.scheduler.add_request(request)  # room was checked for all of them
            self.output.add(request)
            self.stats.started(
                RequestStart(
                    request.request_id,
                    now,
                    len(request.prompt_token_ids),
                    request.sampling_params,
                    call.context,
                    call.adapter_id,
                )
            )
        return requests

    def abort(self, request_id: str) -> None:
        """Stop a request now; its runner state is released at the next step."""
        request = self.scheduler.abort(request_id)
        if request is not None:
            self.output.discard(request_id)
            if self.speculator is not None:
                self.speculator.end(request)
            request.finished_s = self.clock()
            self.stats.ended([request])

    def load(self) -> EngineLoad:
        running, waiting = self.scheduler.counts()
        kv = self.scheduler.kv_stats()
        return EngineLoad(
            running, waiting, kv.usage, kv.prefix_queried_tokens, kv.prefix_hit_tokens
        )

    def take_evicted(self) -> list[bytes]:
        """The prefix cache's blocks evicted since the last call, by hash (a fleet's
        replica reports them to the router)."""
        return self.scheduler.take_evicted()

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> StepStats:
        """One scheduler iteration: schedule, run, apply, output, observe. The stats say
        whether anything ran (``ran`` False: idle, or a static batch still filling up)."""
        batch = self.scheduler.schedule()
        if batch.released:
            self.runner.release(batch.released)
        if batch.is_empty:
            return self._observe(batch, ran=False, sampled=0)
        now = self.clock()
        self.stats.step_started(now)
        for chunk in batch.chunks:
            if chunk.request.scheduled_s is None:
                chunk.request.scheduled_s = now
        try:
            result = self.runner.execute(batch)
        except Exception:  # a failed forward fails its batch, never the engine
            # Clients get no exception text (it can name files and internals); the log has it.
            log.exception("engine step failed", requests=len(batch.chunks))
            self._fail(batch, STEP_FAILED)
            return self._observe(batch, ran=True, sampled=0)
        sampled = self.scheduler.update_from_output(batch, result)
        outputs = self.output.process(sampled, result, self.scheduler.finish_requests)
        for output in outputs:
            self.sink.publish(output)
        if self.speculator is not None:  # the next step's drafts
            running, _ = self.scheduler.counts()
            sampling = {t.request.request_id: t.request for t in sampled}  # in batch order
            self.speculator.propose(sampling.values(), running)
        accepted = sum(map(len, result.accepted.values()))  # speculative drafts kept
        return self._observe(
            batch, ran=True, sampled=len(outputs), outputs=outputs, accepted=accepted
        )

    def _observe(
        self,
        batch: SchedulerOutput,
        *,
        ran: bool,
        sampled: int,
        outputs: Sequence[StepOutput] = (),
        accepted: int = 0,
    ) -> StepStats:
        stats = self.stats.collect(
            batch, self.clock(), ran=ran, sampled=sampled, outputs=outputs, accepted=accepted
        )
        try:
            self.observer.on_step(stats)
        except Exception:  # observing must never break serving
            log.exception("step observer failed")
        return stats

    def _fail(self, batch: SchedulerOutput, error: str) -> None:
        failed = [c.request for c in batch.chunks]
        for request in failed:
            request.fail()
            self.output.discard(request.request_id)
            self.sink.publish(StepOutput(request.request_id, None, "", finished=True, error=error))
        self.stats.ended(failed)
        self.runner.release([r.request_id for r in failed])
        if self.speculator is not None:
            for request in failed:
                self.speculator.end(request)
