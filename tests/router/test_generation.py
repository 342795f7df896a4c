"""Stop strings are matched on text as it grows: nothing past a stop string is ever released."""

from __future__ import annotations

from megaserve.router.generation import StopMatcher


def feed(matcher: StopMatcher, pieces: list[str]) -> tuple[list[str], bool]:
    released = []
    for piece in pieces:
        text, stopped = matcher.push(piece)
        released.append(text)
        if stopped:
            return released, True
    released.append(matcher.flush())
    return released, False


def test_without_stops_everything_passes_at_once():
    assert feed(StopMatcher(()), ["ab", "cd"]) == (["ab", "cd", ""], False)


def test_a_stop_string_split_over_pieces_is_found_and_its_start_never_released():
    released, stopped = feed(StopMatcher(["END"]), ["hello E", "N", "D and more"])
    assert stopped and released == ["hello ", "", ""]


def test_a_false_start_is_released_once_it_cannot_be_a_stop():
    released, stopped = feed(StopMatcher(["END"]), ["hello E", "NOUGH"])
    assert not stopped and "".join(released) == "hello ENOUGH"
    assert released[0] == "hello "


def test_the_earliest_of_several_stops_wins_and_text_before_it_comes_out():
    released, stopped = feed(StopMatcher(["world", "lo w"]), ["hel", "lo world"])
    assert stopped and "".join(released) == "hel"


def test_a_stop_at_the_very_start_releases_nothing():
    released, stopped = feed(StopMatcher(["\n"]), ["\nrest"])
    assert stopped and released == [""]


def test_text_held_back_at_the_end_is_flushed():
    released, stopped = feed(StopMatcher(["abc"]), ["xyz a", "b"])
    assert not stopped and released == ["xyz ", "", "ab"]
