"""The ``read_scalars`` fixture: reading event files back with TensorBoard's own reader (``EventAccumulator``): what ``tensorboard --logdir``
shows is what the tests see. Lighter than tbparse, which wraps the same reader and adds pandas."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest


def _read_scalars(logdir: Path | str) -> dict[str, list[tuple[int, float]]]:
    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
    acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@pytest.fixture
def read_scalars() -> Callable[[Path | str], dict[str, list[tuple[int, float]]]]:
    """``read_scalars(logdir) -> {tag: [(step, value), ...]}`` of the event files in ``logdir`` (not its
    subdirectories), as TensorBoard loads them (purged steps hidden, all points kept)."""
    return _read_scalars
