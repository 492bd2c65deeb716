"""Timing kernel paths on a machine other processes may share: interleaved rounds against a
reference GEMM, a round slowed past its floor or kept waiting for a CPU discarded and run
again later, the settled minimum kept."""

import itertools
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

log = structlog.get_logger(__name__)
REFERENCE = (32, 512, 512)  # rows, in, out: the float32 GEMM that gauges the machine
ROUNDS = 3  # undisturbed rounds each comparison needs
DISTURBED = 1.3  # a round slowed more than this (reference over floor, waits) was disturbed
WAIT_SLACK_MS = 0.1  # our threads' wait for a CPU during a round that counts as none
BACKOFF_S = (0.01, 0.2)  # the pause after a turn with every round disturbed: first, most
BUDGET_S = 20.0  # for the rounds after each comparison's first (measured up to LIMIT)
LIMIT = 1.5  # x BUDGET_S: then comparisons left are not measured even once (a machine busy
# throughout: a round of the LM head's can take 0.3 s there)


@dataclass(frozen=True)
class Round:
    """One round of a comparison: each path's time (ms), the reference's before and after
    it, and how long the calling thread and (up to the calls' time) the intra-op threads
    waited for a CPU during its calls (ms, 0 where the kernel does not say)."""

    reference: tuple[float, float]
    times: dict[str, float]
    waited_ms: float = 0.0


def _disturbance(measured: Round, floor: float) -> float:
    """How much other processes slowed ``measured``, as a factor: its reference (the
    slower of before and after) over the machine's floor, or its calls' time with our
    threads' wait for a CPU beyond ``WAIT_SLACK_MS`` over their time, the larger."""
    calls = max(sum(measured.times.values()), 1e-6)
    waited = max(0.0, measured.waited_ms - WAIT_SLACK_MS)
    return max(max(measured.reference) / floor, 1 + waited / calls)


def _disturbed(measured: Round, floor: float) -> bool:
    return _disturbance(measured, floor) > DISTURBED


def _settled(rounds: list[Round], floor: float) -> tuple[dict[str, float], bool]:
    """A comparison's paths (path -> ms), and whether from undisturbed rounds: each path's
    minimum over the undisturbed rounds (the same rounds for every path), else, where
    every round was disturbed, over all of them (load only adds time: a path's fastest call
    is its least disturbed)."""
    undisturbed = [r for r in rounds if not _disturbed(r, floor)]
    used = undisturbed or rounds
    return {path: min(r.times[path] for r in used) for path in used[0].times}, bool(undisturbed)


class Timer:
    """Comparisons timed in rounds until each has ``ROUNDS`` undisturbed ones, within a
    budget. ``reference``: one timing of the reference GEMM (ms); ``calls``: how many
    :meth:`measure` calls share ``budget_s`` of their own time (what one leaves goes to the
    next, what one overruns is taken from the next: each comparison's first round is
    measured whatever the budget, until the calls have taken ``LIMIT`` x it; those left
    then are not measured). ``waited``: :func:`waited_ms` (``clock``, ``sleep`` and it
    replaceable in tests). ``floor``: the fastest reference seen; ``history``: each
    comparison's rounds; ``disturbed``: the comparisons no undisturbed round decided;
    ``rounds``, ``again`` (disturbed ones), ``unmeasured`` and ``paused_s`` say how it
    went."""

    def __init__(
        self,
        reference: Callable[[], float],
        *,
        budget_s: float = BUDGET_S,
        calls: int = 1,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        waited: Callable[[], tuple[float, float]] | None = None,
    ) -> None:
        self.reference, self.clock, self.sleep = reference, clock, sleep
        self.waited = waited or waited_ms
        self.budget_s, self.limit_s, self.calls = budget_s, LIMIT * budget_s, calls
        self.spent_s = 0.0
        self.floor = math.inf
        self.history: dict[str, list[Round]] = {}
        self.disturbed: list[str] = []
        self.rounds = self.again = self.unmeasured = 0
        self.paused_s = 0.0

    def measure(
        self, groups: dict[str, Callable[[int], dict[str, float]]]
    ) -> dict[str, dict[str, float]]:
        """Label -> path -> ms: each group's paths, as :func:`_settled` has them (none for a
        group left unmeasured). ``groups``: label -> one round of its paths (``turn`` ->
        path -> ms). Groups short of undisturbed rounds are measured again in the next turn
        (later: after the other groups), with a pause (doubling) after a turn whose every
        round was disturbed, until this call's share of the budget is spent. (A pause costs
        more than it says on a machine busy throughout, and cools the threads: only where
        nothing went through.)"""
        started = self.clock()
        deadline = started + max(0.0, self.budget_s - self.spent_s) / max(1, self.calls)
        self.calls -= 1
        rounds: dict[str, list[Round]] = {label: [] for label in groups}
        self.history |= rounds
        pause = BACKOFF_S[0]
        for turn in itertools.count():
            short = [
                label
                for label, done in rounds.items()
                if sum(not _disturbed(r, self.floor) for r in done) < ROUNDS
            ]
            if not short or (turn > 0 and self.clock() > deadline):
                break
            disturbed, before = [], self.reference()
            for label in short:  # one reference between two rounds: after one, before the next
                if self.spent_s + self.clock() - started > self.limit_s:
                    break
                before = self._round(label, groups[label], turn, before, rounds)
                if _disturbed(rounds[label][-1], self.floor):
                    disturbed.append(label)
            else:
                if len(disturbed) < len(short):
                    pause = BACKOFF_S[0]  # rounds went through: the next turn at once
                    continue
                log.debug(
                    "kernel timings disturbed: measured again after a pause",
                    rounds=len(disturbed),
                    first=disturbed[0],
                    floor_ms=round(self.floor, 4),
                    pause_s=pause,
                )
                paused = self.clock()
                self.sleep(pause)  # every round disturbed: wait for the load to pass
                self.paused_s += self.clock() - paused
                pause = min(2 * pause, BACKOFF_S[1])
                continue
            break  # out of time
        self.spent_s += self.clock() - started
        return self._settled(rounds)

    def _settled(self, rounds: dict[str, list[Round]]) -> dict[str, dict[str, float]]:
        """Each comparison's paths, the unsettled ones logged and listed in ``disturbed``."""
        found, unsettled = {}, {}
        for label, done in rounds.items():
            found[label], settled = _settled(done, self.floor) if done else ({}, False)
            self.unmeasured += not done
            if not settled:
                slowed = sorted(_disturbance(r, self.floor) for r in done)
                unsettled[label] = [round(x, 1) for x in slowed[:ROUNDS]]
        if unsettled:
            self.disturbed += unsettled
            first = next(iter(unsettled))
            log.warning(
                "kernel timings stayed disturbed within the budget: left out of the choices",
                comparisons=len(unsettled),
                unmeasured=sum(not slowed for slowed in unsettled.values()),
                first=first,
                slowed=unsettled[first],
                floor_ms=round(self.floor, 4),
            )
        return found

    def _round(
        self,
        label: str,
        one_round: Callable[[int], dict[str, float]],
        turn: int,
        before: float,
        rounds: dict[str, list[Round]],
    ) -> float:
        """One round of ``label`` after the reference ``before`` and before another,
        kept in ``rounds``; the reference after it."""
        own, others = self.waited()
        times = one_round(turn)
        own, others = (now - then for now, then in zip(self.waited(), (own, others), strict=True))
        # the intra-op threads' wait counts up to the calls' time: a thread the calls did not
        # use (too little work to split) may have waited meanwhile without delaying them
        waited = own + min(others, sum(times.values()))
        after = self.reference()
        self.floor = min(self.floor, before, after)
        measured = Round((before, after), times, waited)
        rounds[label].append(measured)
        self.rounds += 1
        self.again += _disturbed(measured, self.floor)
        return after

    def recheck(self) -> list[str]:
        """The comparisons settled on rounds that the floor found since shows disturbed
        (a load that slowed everything at first: their rounds agreed with each other, not
        with the machine), now among ``disturbed``; logged."""
        found = [
            label
            for label, done in self.history.items()
            if label not in self.disturbed and not _settled(done, self.floor)[1]
        ]
        if found:
            self.disturbed += found
            log.warning(
                "kernel timings that looked settled were slower than the machine's floor "
                "found later: left out of the choices",
                comparisons=len(found),
                first=found[0],
                floor_ms=round(self.floor, 4),
            )
        return found


def waited_ms() -> tuple[float, float]:
    """How long this thread, and the process's other threads together, have waited,
    runnable, for a CPU so far (ms; the second field of Linux's per-thread schedstat; 0
    where there is none): time another process took from a measurement."""
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0, 0.0
    me, mine, others = str(threading.get_native_id()), 0, 0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat", "rb") as stat:
                waited = int(stat.read().split()[1])
        except (OSError, ValueError, IndexError):
            continue  # a thread gone, or no schedstat
        if task == me:
            mine = waited
        else:
            others += waited
    return mine / 1e6, others / 1e6


def reference_timer(samples: int = 3, limit_s: float = math.inf) -> Callable[[], float]:
    """One timing (ms) of a fixed float32 GEMM: the fastest of ``samples`` calls, or of
    those made within ``limit_s``: how fast this machine runs now, whatever the model."""
    rows, k, n = REFERENCE
    generator = torch.Generator().manual_seed(0)
    x, w = torch.randn(rows, k, generator=generator), torch.randn(n, k, generator=generator)

    def timed() -> float:
        best = math.inf
        with torch.inference_mode():
            first = time.perf_counter()
            for _ in range(samples):
                start = time.perf_counter()
                F.linear(x, w)
                best = min(best, time.perf_counter() - start)
                if start - first > limit_s:
                    break
        return best * 1e3

    with torch.inference_mode():
        F.linear(x, w)  # warm-up
    return timed


def reference_ms() -> float:
    """The reference GEMM's time now (ms, the fastest of 16 calls or of those that ran in
    50 ms: a start's check, a few ms on a quiet machine)."""
    return reference_timer(samples=16, limit_s=0.05)()
