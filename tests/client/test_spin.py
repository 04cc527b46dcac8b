"""The client's spin while it waits for an answer (``api.next_spin``): the whole ``spin_s``
while answers come within it; halved after each that came later (a busy daemon on a small
machine: spinning would only take the CPU it needs), down to none; whole again at the first
answer that came within ``spin_s``."""

import pytest

from hicached.client.connection import next_spin


def test_answers_within_the_spin_keep_it_whole():
    assert next_spin(0.002, 0.002, 0.0001) == 0.002
    assert next_spin(0.002, 0.002, 0.002) == 0.002


def test_late_answers_halve_it_down_to_none_and_one_on_time_restores_it():
    spins = [0.002]
    for _ in range(8):
        spins.append(next_spin(0.002, spins[-1], 0.020))
    assert spins[:7] == pytest.approx([0.002 / 2 ** i for i in range(7)])
    assert spins[7] == spins[8] == 0.0  # (under 1/64 of spin_s: no spin at all)
    assert next_spin(0.002, 0.0, 0.0015) == 0.002


def test_no_spin_stays_none():
    assert next_spin(0.0, 0.0, 0.0) == 0.0
    assert next_spin(0.0, 0.0, 1.0) == 0.0
