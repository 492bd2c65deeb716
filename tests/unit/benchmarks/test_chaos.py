"""benchmarks/chaos.py without a fleet: the retrying client's bookkeeping (answered,
retried on the other ingress, refused without a retry, lost after its tries)."""

from pathlib import Path

import httpx
import pytest

from tests.bench_modules import load_benchmark

chaos = load_benchmark("chaos")


@pytest.fixture
def fleet(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(chaos.time, "sleep", lambda _: None)
    return chaos.Fleet(tmp_path, 1, "redis://127.0.0.1:1/0", "postgresql://x@127.0.0.1:1/x")


def test_a_call_cut_on_one_ingress_is_answered_by_the_other(fleet) -> None:
    tally, tried = chaos.Tally(), []

    def attempt(url: str, request_id: str) -> str | None:
        tried.append((url, request_id))
        if len(tried) == 1:
            raise httpx.ConnectError("refused")
        return None

    fleet.call(tally, "t", attempt)
    assert (tally.sent, tally.answered, tally.retried, tally.lost) == (1, 1, 1, 0)
    assert tried[0][0] != tried[1][0]  # the other ingress
    assert tried[1][1] in fleet.answered and tried[0][1] not in fleet.answered


def test_a_clean_4xx_is_refused_not_retried_and_a_dead_fleet_loses_the_call(fleet) -> None:
    tally = chaos.Tally()
    fleet.call(tally, "t", lambda url, rid: "400 prompt too long")
    assert (tally.refused, tally.retried, tally.lost) == (1, 0, 0)
    fleet.call(tally, "t", lambda url, rid: "503 draining")
    assert tally.retried == chaos.TRIES and tally.lost == 1
    fleet.call(tally, "t", lambda url, rid: "429 slow down")
    assert tally.lost == 2 and tally.refused == 1  # 429 is retried, not refused
