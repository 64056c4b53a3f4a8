"""The accuracy gate's rules (bench/kernel_accuracy.py), without a model: the KL bound and its floor, and the
`floor` kernel set's table."""
from __future__ import annotations

from bench.kernel_accuracy import FLOOR_CAP, FLOOR_MARGIN, MAX_KL_MEAN, forced_backend, within_bound
from engine.backends.dispatch import FORMATS


def test_under_the_bound_passes_without_a_floor():
    assert within_bound(MAX_KL_MEAN, None)
    assert not within_bound(MAX_KL_MEAN * 1.01, None)


def test_past_the_bound_a_set_passes_only_near_a_floor_under_its_cap():
    floor = MAX_KL_MEAN * 1.2
    assert within_bound(floor * FLOOR_MARGIN, floor)
    assert within_bound(floor * 0.9, floor)  # better than the floor
    assert not within_bound(floor * FLOOR_MARGIN * 1.01, floor)
    assert not within_bound(FLOOR_CAP * 1.05, FLOOR_CAP * 1.05)  # a shared kernel that far off fails on its own


def test_the_floor_set_gives_every_product_of_every_row_count_to_f_linear():
    table = forced_backend("floor").dispatch
    for fmt in FORMATS:
        assert table.route(fmt).kernels == ("linear",), fmt
