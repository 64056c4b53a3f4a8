"""bench.auto_vs_bf16's OpenMP wait policy: libgomp's own unless asked, as the actors run it."""
from __future__ import annotations

import os

import pytest

from bench.auto_vs_bf16 import set_wait_policy


@pytest.mark.parametrize("argv,want", [([], None), (["--batch", "8", "--omp-wait-policy", "default"], None),
                                       (["--omp-wait-policy", "passive"], "PASSIVE"),
                                       (["--rounds", "3", "--omp-wait-policy", "active"], "ACTIVE")])
def test_the_wait_policy_is_set_only_when_asked(monkeypatch, argv, want):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    set_wait_policy(argv)
    assert os.environ.get("OMP_WAIT_POLICY") == want


def test_a_wait_policy_outside_the_choices_is_refused(monkeypatch):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        set_wait_policy(["--omp-wait-policy", "spin"])
