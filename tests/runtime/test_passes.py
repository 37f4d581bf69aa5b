"""The pass ledger of a worker's iterator: how many records of the pass under way it handed out, whatever sits
between the pipeline's ``repeat`` and the consumer (``batch`` across passes, ``prefetch`` running ahead)."""

from __future__ import annotations

import time

import numpy as np
import pytest

from kubeps.runtime.data import Dataset
from kubeps.runtime.data.passes import PassLedger
from kubeps.runtime.worker.state import MeasuredIterator, records_in_pass


def _worker_iterator(dataset) -> MeasuredIterator:
    """As a worker builds a per-worker iterator (kubeps.runtime.worker.state.rpc_create_resource)."""
    ledger = PassLedger()
    with ledger.active():
        inner = iter(dataset)
    return MeasuredIterator(inner, ledger)


@pytest.mark.parametrize("name, dataset, take, in_pass", [
    # repeat on blocks, batches cut across the pass boundary: 4 batches of 3 = 12 records, the second pass from 10
    ("blocks, batch after repeat", lambda: Dataset.range(10).repeat().batch(3).prefetch(2), 4, 2),
    # batches of 4, 4, 2 per pass: 5 batches = 18 records, the second pass from 10
    ("batch before repeat", lambda: Dataset.range(10).batch(4).repeat().prefetch(3), 5, 8),
    ("elements (map)", lambda: Dataset.range(10).map(lambda x: x * 2).repeat().prefetch(4), 13, 3),
    ("elements, third pass", lambda: Dataset.range(10).map(lambda x: x).repeat(), 25, 5),
    # the outer repeat's pass is two inner passes (10 records): 7 batches of 2 = 14 records
    ("nested repeat", lambda: Dataset.range(5).repeat(2).batch(2).repeat().prefetch(1), 7, 4),
    ("no repeat: one pass", lambda: Dataset.range(10).batch(4), 2, 8),
])
def test_the_records_of_the_pass_under_way(name, dataset, take, in_pass):
    iterator = _worker_iterator(dataset())
    for _ in range(take):
        next(iterator)
    assert iterator.ledger.in_pass() == in_pass, name
    assert records_in_pass({"it": iterator, "ds": object()}) == in_pass


def test_an_exhausted_iterator_has_no_pass_under_way():
    iterator = _worker_iterator(Dataset.range(10).batch(4))
    assert [len(b) for b in iterator] == [4, 4, 2]
    assert iterator.ledger.in_pass() == 0


def test_a_pass_started_far_ahead_by_prefetch_counts_only_once_the_consumer_gets_there():
    iterator = _worker_iterator(Dataset.range(6).repeat().batch(2).prefetch(8))
    next(iterator)
    deadline = 50
    while iterator.ledger._produced < 16 and deadline:  # the producer is a pass or more ahead
        time.sleep(0.01)
        deadline -= 1
    assert iterator.ledger.in_pass() == 2
    next(iterator), next(iterator)  # 6 records: the first pass exactly
    assert iterator.ledger.in_pass() == 0
    next(iterator)
    assert iterator.ledger.in_pass() == 2


def test_two_iterators_of_one_dataset_keep_their_own_ledgers():
    dataset = Dataset.from_tensor_slices(np.arange(8)).repeat().batch(3)
    first, second = _worker_iterator(dataset), _worker_iterator(dataset)
    next(first), next(first), next(first)
    next(second)
    assert (first.ledger.in_pass(), second.ledger.in_pass()) == (1, 3)
