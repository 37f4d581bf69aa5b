"""The one validation dialect (kubeps.runtime.checks): strict numbers, bounds, and refusals that name the field,
the value and what is allowed."""

from __future__ import annotations

import math

import numpy as np
import pytest
from pydantic import BaseModel

from kubeps.runtime.checks import (Flag, Fraction, MetricsPort, NonNegativeSeconds, Port, PortOrZero, PositiveInt,
                                   RealNumber, Seconds, allowed_text, check, check_callable, from_text, index_in,
                                   integer, number)
from kubeps.runtime.errors import RuntimeConfigError


@pytest.mark.parametrize("type_,value,expected", [
    (PositiveInt, 3, 3), (PositiveInt, np.int64(7), 7), (Seconds, 2, 2.0), (Seconds, np.float32(0.5), 0.5),
    (NonNegativeSeconds, 0, 0.0), (Fraction, 1, 1.0), (Port, 65535, 65535), (PortOrZero, 0, 0),
    (Flag, True, True), (Flag, np.bool_(False), False), (integer(ge=-1), -1, -1), (number(gt=0, lt=1), 0.25, 0.25),
    (PositiveInt | None, None, None), (Seconds | None, 3, 3.0), (RealNumber, np.float32(2.5), 2.5),
    (RealNumber, 7, 7.0),
])
def test_accepts(type_, value, expected):
    got = check("field", value, type_)
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("type_,value,allowed", [
    (PositiveInt, 0, "an integer >= 1"), (PositiveInt, True, "an integer >= 1"), (PositiveInt, 2.0, "an integer >= 1"),
    (PositiveInt, "3", "an integer >= 1"), (Seconds, 0, "a number of seconds > 0"),
    (Seconds, math.nan, "a number of seconds > 0"), (Seconds, math.inf, "a number of seconds > 0"),
    (Seconds, False, "a number of seconds > 0"), (NonNegativeSeconds, -1, "a number of seconds >= 0"),
    (Fraction, 1.5, "a number in (0, 1]"), (Port, 0, "a port number in 1..65535"),
    (Port, 70000, "a port number in 1..65535"), (Flag, 1, "True or False"), (Flag, "yes", "True or False"),
    (number(ge=0, le=1), 2, "a finite number >= 0 and <= 1"),
    (PositiveInt | None, 0, "an integer >= 1, or None"), (RealNumber, True, "a real number"),
    (RealNumber, "1", "a real number"),
])
def test_refuses_naming_field_value_and_allowed(type_, value, allowed):
    with pytest.raises(RuntimeConfigError) as info:
        check("num_shards", value, type_, owner="Partitioner")
    err = info.value
    assert err.field == "Partitioner.num_shards" and err.allowed == allowed
    assert "Partitioner.num_shards" in str(err) and repr(value) in str(err) and allowed in str(err)
    assert isinstance(err, ValueError)


def test_the_types_annotate_pydantic_models():
    class Options(BaseModel):
        timeout: Seconds = 1.0
        workers: PositiveInt = 1

    assert Options(timeout=3, workers=np.int32(2)).model_dump() == {"timeout": 3.0, "workers": 2}
    with pytest.raises(ValueError, match="timeout"):
        Options(timeout=True)


def test_check_callable():
    assert check_callable("fn", len) is len
    with pytest.raises(RuntimeConfigError, match="'dataset_fn' has invalid value 3: a callable"):
        check_callable("dataset_fn", 3)


@pytest.mark.parametrize("type_,text,expected", [
    (PositiveInt, " 3 ", 3), (Seconds, "2.5", 2.5), (Seconds, "2", 2.0), (MetricsPort, "0", 0),
    (PositiveInt | None, "4", 4),
])
def test_from_text_reads_a_variable_or_a_flag(type_, text, expected):
    got = check("field", text, from_text(type_))
    assert got == expected and type(got) is type(expected)


@pytest.mark.parametrize("type_,text", [
    (PositiveInt, "1.5"), (PositiveInt, "1e3"), (PositiveInt, "0"), (Seconds, "nan"), (Seconds, "inf"),
    (Seconds, "soon"), (MetricsPort, "65536"),
])
def test_from_text_checks_the_number_the_text_spells(type_, text):
    with pytest.raises(RuntimeConfigError) as info:
        check("KUBEPS_X", text, from_text(type_))
    assert (info.value.field, info.value.value, info.value.allowed) == ("KUBEPS_X", text, allowed_text(type_))


def test_index_in_names_the_count():
    assert check("index", 2, index_in(3, "num_shards")) == 2
    with pytest.raises(RuntimeConfigError, match=r"'index' has invalid value 3: an integer in 0..2 \(num_shards=3\)"):
        check("index", 3, index_in(3, "num_shards"))


def test_a_real_number_may_be_nan_or_infinite():
    assert math.isnan(check("loss", math.nan, RealNumber)) and check("loss", -math.inf, RealNumber) == -math.inf
