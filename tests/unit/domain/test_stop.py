"""StopStringMatcher on streamed text deltas."""

from hypothesis import given, settings
from hypothesis import strategies as st

from adapters.fake import ByteTokenizer
from domain.detokenizer import IncrementalDetokenizer
from domain.stop import StopStringMatcher


def _feed_all(matcher: StopStringMatcher, deltas: list[str]) -> tuple[str, bool]:
    emitted = []
    for delta in deltas:
        text, hit = matcher.feed(delta)
        emitted.append(text)
        if hit:
            return "".join(emitted), True
    return "".join(emitted) + matcher.flush(), False


def test_passes_everything_through_without_stop_strings() -> None:
    matcher = StopStringMatcher([])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.flush() == ""


def test_emits_text_that_cannot_start_a_stop_string_at_once() -> None:
    assert StopStringMatcher(["STOP"]).feed("hello world") == ("hello world", False)


def test_finds_a_stop_string_spanning_deltas() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("abc ST") == ("abc ", False)
    assert matcher.feed("O") == ("", False)
    assert matcher.feed("P and more") == ("", True)


def test_stops_at_the_very_start() -> None:
    assert StopStringMatcher(["STOP"]).feed("STOP now") == ("", True)


def test_excludes_the_stop_string_and_what_follows_it() -> None:
    assert StopStringMatcher(["\n\n"]).feed("one\n\ntwo") == ("one", True)


def test_says_which_stop_string_was_hit() -> None:
    matcher = StopStringMatcher(["world", "lo"])
    assert matcher.matched is None
    assert matcher.feed("hel") == ("he", False) and matcher.matched is None
    assert matcher.feed("lo") == ("l", True) and matcher.matched == "lo"


def test_the_earliest_of_two_stop_strings_wins() -> None:
    assert StopStringMatcher(["world", "lo"]).feed("hello world") == ("hel", True)


def test_the_result_does_not_depend_on_how_the_text_is_cut() -> None:
    stops = ["abcd", "c"]
    assert _feed_all(StopStringMatcher(stops), ["xabcd"]) == ("xab", True)
    assert _feed_all(StopStringMatcher(stops), list("xabcd")) == ("xab", True)


def test_emits_a_held_back_prefix_that_turns_out_not_to_be_a_stop() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ale") == ("STale", False)


def test_finds_a_stop_string_that_overlaps_its_own_prefix() -> None:
    matcher = StopStringMatcher(["aab"])
    assert matcher.feed("xaa") == ("x", False)
    assert matcher.feed("ab") == ("a", True)


def test_flush_returns_the_held_back_text() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("x ST") == ("x ", False)
    assert matcher.flush() == "ST"
    assert matcher.flush() == ""


def test_finds_a_stop_string_spread_over_byte_tokens() -> None:
    tokenizer = ByteTokenizer()
    detokenizer = IncrementalDetokenizer(tokenizer)
    deltas = [
        detokenizer.push(i) for i in tokenizer.encode("你好，世界。", add_special_tokens=False)
    ]
    assert _feed_all(StopStringMatcher(["世界"]), deltas) == ("你好，", True)


def _held_back_naively(text: str, stops: list[str]) -> int:
    """The longest suffix of ``text`` that is a proper prefix of a stop string, by brute force."""
    return max(
        (
            k
            for k in range(1, len(text) + 1)
            for s in stops
            if len(s) > k and s.startswith(text[-k:])
        ),
        default=0,
    )


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(alphabet="abc", max_size=12),
    stops=st.lists(st.text(alphabet="abc", min_size=1, max_size=6), min_size=1, max_size=4),
)
def test_what_is_held_back_matches_a_brute_force_search(text: str, stops: list[str]) -> None:
    assert StopStringMatcher(stops)._partial_stop_length(text) == _held_back_naively(text, stops)
