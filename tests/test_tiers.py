"""The tier rules of tests/tiers.py, and that every collected test of this run got exactly one tier."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.tiers import MODULE_TIERS, E, P, Tier, TierError, U, module_tiers, tier_of, tier_selector

TABLE = {"test_a.py": Tier.UNIT, "test_b.py": Tier.ENGINE}
TESTS = Path(__file__).parent


def test_a_test_takes_its_modules_tier():
    assert tier_of("test_a.py", ["parametrize", "usefixtures"], TABLE) is Tier.UNIT
    assert tier_of("test_b.py", [], TABLE) is Tier.ENGINE


def test_an_explicit_marker_wins_and_slow_means_process():
    assert tier_of("test_a.py", ["process"], TABLE) is Tier.PROCESS
    assert tier_of("test_b.py", ["slow", "parametrize"], TABLE) is Tier.PROCESS
    assert tier_of("test_b.py", ["slow", "process"], TABLE) is Tier.PROCESS  # the same tier twice is one


def test_no_tier_or_two_tiers_is_an_error():
    with pytest.raises(TierError, match="test_new.py has no tier"):
        tier_of("test_new.py", ["parametrize"], TABLE)
    with pytest.raises(TierError, match="two tiers"):
        tier_of("test_a.py", ["unit", "engine"], TABLE)
    with pytest.raises(TierError, match="two tiers"):
        tier_of("test_a.py", ["slow", "unit"], TABLE)


def test_the_table_names_test_modules_by_file_name():
    assert all(name.startswith("test_") and name.endswith(".py") and "/" not in name for name in MODULE_TIERS)


def test_every_collected_test_carries_exactly_one_tier(request):
    tiers = {t.value for t in Tier}
    items = request.session.items
    offenders = [item.nodeid for item in items if len({m.name for m in item.iter_markers()} & tiers) != 1]
    assert items and not offenders, offenders


def test_a_tier_expression_is_answered_per_tier_and_any_other_is_left_to_the_markers():
    fast = tier_selector("unit or engine")
    assert [fast(t) for t in (U, E, P)] == [True, True, False]
    assert [tier_selector("not (process)")(t) for t in (U, E, P)] == [True, True, False]
    assert [tier_selector("process")(t) for t in (U, E, P)] == [False, False, True]
    for other in ("slow", "unit and not slow", "", "unit or __import__('os')", "unit;", "unit engine", "(unit"):
        assert tier_selector(other) is None, other


def test_a_modules_tiers_are_its_own_and_each_tier_marker_its_source_names():
    table = {"test_a.py": P, "test_b.py": U}
    assert module_tiers("test_a.py", "def test_x(): pass", table) == {P}
    assert module_tiers("test_a.py", "@pytest.mark.unit\ndef test_x(): pass", table) == {P, U}
    assert module_tiers("test_b.py", "pytest.param(1, marks=pytest.mark.slow)", table) == {U, P}
    assert module_tiers("test_c.py", "", table) is None  # not in the table: collected, and refused there


def test_the_tiers_read_from_each_source_hold_every_tier_its_collected_tests_have(request):
    """So a `-m` of tiers skips a module (conftest.py's pytest_ignore_collect) only when none of its tests is of a
    selected tier."""
    collected: dict[str, set[Tier]] = {}
    for item in request.session.items:
        collected.setdefault(item.path.name, set()).add(tier_of(item.path.name, (m.name for m in item.iter_markers())))
    assert collected
    for name, tiers in collected.items():
        assert tiers <= module_tiers(name, (TESTS / name).read_text()), name
