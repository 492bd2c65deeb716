"""Speculative drafts: prompt lookup (ngram) and suffix proposals, the shared index's
bound, and a request's drafting turned off when too few drafts are accepted."""

import pytest

from domain.speculation import NgramIndex, Proposer, SharedSuffixes, SpeculativeConfig


def test_prompt_lookup_drafts_what_followed_the_longest_repeated_ngram() -> None:
    index = NgramIndex(2, 4)
    index.extend([1, 2, 3, 4, 5, 6, 9, 2, 3, 4])  # "2 3 4" came before, followed by 5 6
    assert index.propose(3) == [5, 6, 9]
    assert index.propose(10) == [5, 6, 9, 2, 3, 4]  # up to the end of what is known
    index.extend([7])  # "3 4 7", "4 7": never seen
    assert index.propose(3) == []


def test_the_latest_earlier_occurrence_wins_and_longer_ngrams_first() -> None:
    index = NgramIndex(1, 3)
    index.extend([8, 1, 2, 10, 5, 1, 2, 11, 1, 2])
    assert index.propose(1) == [11]  # "1 2" last followed by 11
    index = NgramIndex(1, 3)
    index.extend([7, 1, 2, 20, 9, 1, 2, 30, 7, 1, 2])  # "7 1 2" (3-gram) beats "1 2"
    assert index.propose(1) == [20]


def test_incremental_indexing_equals_indexing_at_once() -> None:
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 1, 4]
    whole = NgramIndex(1, 3)
    whole.extend(tokens)
    stepwise = NgramIndex(1, 3)
    for i, token in enumerate(tokens):
        stepwise.extend([token])
        reference = NgramIndex(1, 3)
        reference.extend(tokens[: i + 1])
        assert stepwise.propose(4) == reference.propose(4)
    assert stepwise.propose(4) == whole.propose(4) == [1, 5, 9, 2]  # after "3 1 4"


def test_suffix_drafts_continue_from_recent_requests() -> None:
    config = SpeculativeConfig(method="suffix", prompt_lookup_min=1, prompt_lookup_max=3)
    shared = SharedSuffixes(1, 3, requests=2)
    template = [40, 41, 42, 43, 44]
    shared.add("a", [1, *template])
    shared.add("b", [2, *template])
    proposer = Proposer(config, [9, 9, 40], shared)  # its own text never saw 40 before
    assert proposer.propose(3) == [41, 42, 43]
    # One request's use is not enough (min count 2): a single sighting drafts nothing.
    lonely = SharedSuffixes(1, 3, requests=2)
    lonely.add("a", [1, *template])
    assert Proposer(config, [9, 9, 40], lonely).propose(3) == []


def test_the_shared_index_forgets_its_oldest_requests() -> None:
    shared = SharedSuffixes(1, 2, requests=1)
    shared.add("a", [5, 6, 7])
    assert shared.next_token([5], 1) == 6
    shared.add("b", [1, 2])
    assert shared.next_token([5], 1) is None and shared.next_token([1], 1) == 2
    assert shared._counts.keys() == {(1,)}  # nothing of "a" is left


def test_drafting_stops_for_a_request_whose_drafts_are_rejected() -> None:
    config = SpeculativeConfig(probe_tokens=8, min_acceptance=0.5)
    proposer = Proposer(config, [1, 2, 3, 1, 2])
    assert proposer.propose(2) == [3, 1]
    proposer.record(drafted=8, accepted=1)
    assert not proposer.active and proposer.propose(2) == []
    kept = Proposer(config, [1, 2, 3, 1, 2])
    kept.record(drafted=8, accepted=6)
    assert kept.active


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "prompt_lookup_min/max"),
        ({"min_acceptance": 2.0}, "min_acceptance"),
    ],
)
def test_a_bad_config_names_its_field(fields: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        SpeculativeConfig(**fields)  # type: ignore[arg-type]
