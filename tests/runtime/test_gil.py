"""``hold_switch_interval``: the GIL switch interval raised while held, never lowered, put back by the last holder."""

from __future__ import annotations

import sys

import pytest

from kubeps.runtime.util.gil import hold_switch_interval


@pytest.fixture(autouse=True)
def interpreter_default():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_raised_while_held_and_put_back_on_release():
    release = hold_switch_interval(0.05)
    assert sys.getswitchinterval() == pytest.approx(0.05)
    release()
    assert sys.getswitchinterval() == pytest.approx(0.005)
    release()  # a second release does nothing
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_never_lowered():
    sys.setswitchinterval(0.2)
    release = hold_switch_interval(0.05)
    assert sys.getswitchinterval() == pytest.approx(0.2)
    release()
    assert sys.getswitchinterval() == pytest.approx(0.2)


def test_the_last_holder_puts_it_back_and_the_longest_holds():
    first = hold_switch_interval(0.05)
    second = hold_switch_interval(0.1)
    assert sys.getswitchinterval() == pytest.approx(0.1)
    first()
    assert sys.getswitchinterval() == pytest.approx(0.1)  # the second still holds
    second()
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_a_change_made_meanwhile_is_kept():
    release = hold_switch_interval(0.05)
    sys.setswitchinterval(0.02)  # the program's own choice, after the hold
    release()
    assert sys.getswitchinterval() == pytest.approx(0.02)


@pytest.mark.parametrize("value", [0, -0.01, True, "0.05", None])
def test_a_bad_interval_is_refused(value):
    with pytest.raises(ValueError, match=r"'hold_switch_interval.seconds' has invalid value .*: a number of seconds > 0"):
        hold_switch_interval(value)
    assert sys.getswitchinterval() == pytest.approx(0.005)
