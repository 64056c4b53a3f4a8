from hypothesis import given, settings, strategies as st

from engine.core.stop_checker import StopChecker, truncate_at_stop


def run(chunks, stops, include=False):
    checker = StopChecker(stops, include)
    out, hit_at = [], None
    for i, chunk in enumerate(chunks):
        text, hit = checker.feed(chunk)
        out.append(text)
        if hit:
            hit_at = i
            break
    else:
        out.append(checker.flush())
    return out, hit_at, checker


def test_char_by_char_never_leaks_stop():
    text = "Hello wor</s>ld and more"
    out, hit_at, checker = run(list(text), ["</s>"])
    assert "".join(out) == "Hello wor"
    assert hit_at == text.index("</s>") + len("</s>") - 1
    assert all(piece in "Hello wor" for piece in out)
    assert checker.stop_reason == "</s>" and checker.truncated_text == "Hello wor"


def test_partial_prefix_is_held_then_released():
    checker = StopChecker(["STOP"])
    assert checker.feed("abc ST") == ("abc ", False)
    assert checker.feed("O") == ("", False)
    assert checker.feed("P!") == ("", True)
    assert checker.feed("more") == ("", True)


def test_false_alarm_prefix_is_released():
    checker = StopChecker(["STOP"])
    assert checker.feed("ST") == ("", False)
    assert checker.feed("OX") == ("STOX", False)


def test_include_stop_str():
    out, _, _ = run(["a", "b<", "e", "nd>", "tail"], ["<end>"], include=True)
    assert "".join(out) == "ab<end>"


def test_no_stop_everything_emitted_after_flush():
    checker = StopChecker(["zzz"])
    assert checker.feed("ab z") == ("ab ", False)
    assert checker.feed("z") == ("", False)
    assert checker.flush() == "zz"
    assert checker.truncated_text == "ab zz"


def test_no_stop_strings_passthrough():
    checker = StopChecker([])
    assert checker.feed("anything") == ("anything", False)
    assert checker.flush() == ""


def test_earliest_of_several_stops_in_one_delta():
    checker = StopChecker(["cd", "b"])
    assert checker.feed("abcd") == ("a", True)
    assert checker.stop_reason == "b"


def test_overlapping_stop_needs_later_start():
    # "aab": the "ab" match starts at index 1; the held prefix must have been "aa" -> "a" shift.
    out, _, _ = run(list("xaaab"), ["aab"])
    assert "".join(out) == "xa"


def brute_force_truncation(text, stops, include):
    """Cut at the stop occurrence that completes first (the longest one when several end together)."""
    for end in range(len(text) + 1):
        ending = [s for s in stops if text[:end].endswith(s)]
        if ending:
            s = max(ending, key=len)
            return text[:end] if include else text[: end - len(s)]
    return text


def test_reference_matches_earliest_start_when_stops_do_not_nest():
    text = "one two. three; four"
    assert truncate_at_stop(text, [";", "."]) == "one two"
    assert truncate_at_stop(text, [";", "."], include_stop=True) == "one two."
    assert truncate_at_stop(text, ["!"]) == text


alphabet = st.sampled_from("ab<>/s")


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet, max_size=40),
    stops=st.lists(st.text(alphabet, min_size=1, max_size=5), min_size=1, max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=15),
    include=st.booleans(),
)
def test_random_splits_match_reference(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    chunks = [text[i:j] for i, j in zip(bounds, bounds[1:])]
    out, hit_at, checker = run(chunks, stops, include)
    emitted = "".join(out)
    assert emitted == brute_force_truncation(text, stops, include)
    assert emitted == truncate_at_stop(text, stops, include)
    assert text.startswith(emitted)
    assert checker.truncated_text == emitted
    assert (hit_at is not None) == any(s in text for s in stops)
    if not include:
        assert not any(s in emitted for s in stops)


@settings(max_examples=200, deadline=None)
@given(prefix=st.text("abc ", max_size=20), suffix=st.text("abc ", max_size=10),
       cuts=st.lists(st.integers(1, 40), max_size=10))
def test_stop_never_partially_emitted(prefix, suffix, cuts):
    stop = "<|end|>"
    text = prefix + stop + suffix
    bounds = sorted({0, len(text), *(c for c in cuts if c < len(text))})
    chunks = [text[i:j] for i, j in zip(bounds, bounds[1:])]
    out, hit_at, _ = run(chunks, [stop])
    assert "".join(out) == prefix
    assert hit_at is not None
