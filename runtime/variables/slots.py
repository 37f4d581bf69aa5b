"""Optimizer slots of one variable (or shard), keyed by what they are: ``{optimizer class: {slot name: array}}``.

A parameter server and a local variable keep them the same way, and checkpoints save them under the same keys. The
key is the optimizer's class (:func:`kubeps.runtime.rpc.protocol.slot_key`), never its hyperparameters, so slots
survive a learning-rate change on resume, and a variable holds at most one slot set per optimizer class.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

__all__ = ["slots_for"]

log = logging.getLogger("kubeps.runtime.variables.slots")

_warned: set[tuple[tuple[str, ...], str]] = set()
_warned_lock = threading.Lock()


def slots_for(groups: dict[str, dict[str, Any]], key: str, optimizer: Any, value: Any, owner: str) -> dict[str, Any]:
    """The slots ``optimizer`` (whose slot key is ``key``) updates ``value`` with, created in ``groups`` when absent.

    Slots saved by the same optimizer class with other hyperparameters are reused; a slot the optimizer has and the
    group lacks (Adam's ``vhat`` after switching ``amsgrad`` on) starts from its initial value. A variable whose
    slots belong to another optimizer class (Adagrad slots restored into an Ftrl run) gets fresh slots for this one,
    and a warning says so (once per pair of classes in this process). Call with ``value``'s lock held."""
    group = groups.get(key)
    if group is None:
        others = tuple(sorted(k for k in groups if groups[k]))
        if others:
            with _warned_lock:
                first = (others, key) not in _warned
                _warned.add((others, key))
            if first:
                log.warning(
                    "variable %r has optimizer slots for %s but is now updated with %s: %s's slots start from their "
                    "initial values (was a checkpoint saved with another optimizer restored?); warned once for "
                    "this pair of optimizers", owner, ", ".join(others), key, key)
        group = groups[key] = optimizer.init_slots(value)
        return group
    slot_names = getattr(optimizer, "slot_names", None)
    if slot_names is None:
        return group
    wanted = tuple(slot_names())
    missing = [name for name in wanted if name not in group]
    if missing:
        fresh = optimizer.init_slots(value)
        for name in missing:
            group[name] = fresh[name]
    if len(group) != len(wanted):
        return {name: group[name] for name in wanted}  # the same arrays: updates land in the group
    return group
