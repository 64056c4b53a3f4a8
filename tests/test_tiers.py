"""The tier rules of tests/tiers.py, and that every collected test of this run got exactly one tier."""
from __future__ import annotations

import pytest

from tests.tiers import MODULE_TIERS, Tier, TierError, tier_of

TABLE = {"test_a.py": Tier.UNIT, "test_b.py": Tier.ENGINE}


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
