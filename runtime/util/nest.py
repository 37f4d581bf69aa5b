"""Nested structures: map, flatten and pack, as TensorFlow's ``util/nest`` (one walker instead of one per module).

A *structure* is a leaf or a container of structures. Containers are ``dict`` (and subclasses; values in insertion
order), ``tuple`` (namedtuples included) and ``list``; everything else is a leaf. With ``lists=False`` a list is a
leaf, as ``tf.data`` treats it (TF's ``data/util/nest``). Rebuilt containers keep their type.

Pure functions over plain Python values: no I/O, no numpy.

>>> from collections import namedtuple
>>> Point = namedtuple("Point", "x y")
>>> map_structure(lambda v: v * 10, {"a": [1, 2], "b": Point(3, 4)})
{'a': [10, 20], 'b': Point(x=30, y=40)}
>>> flatten({"a": [1, 2], "b": (3,)})
[1, 2, 3]
>>> pack({"a": [None, None], "b": (None,)}, ["x", "y", "z"])
{'a': ['x', 'y'], 'b': ('z',)}
>>> flatten_with_paths({"ids": (1, 2), "label": 0})
[("['ids'][0]", 1), ("['ids'][1]", 2), ("['label']", 0)]
>>> flatten([1, [2]], lists=False)
[[1, [2]]]
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

__all__ = ["first_leaf", "flatten", "flatten_with_paths", "is_namedtuple", "is_nested", "map_structure", "pack"]


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(value, "_fields")


def is_nested(value: Any, *, lists: bool = True) -> bool:
    """Whether ``value`` is a container (dict, tuple, or -- unless ``lists=False`` -- list)."""
    return isinstance(value, _containers(lists))


def _items(value: Any) -> list[tuple[Any, Any]]:
    return list(value.items()) if isinstance(value, dict) else list(enumerate(value))


def _rebuild(value: Any, children: Sequence[Any]) -> Any:
    if isinstance(value, dict):
        return type(value)(zip(value.keys(), children))
    if is_namedtuple(value):
        return type(value)(*children)
    return type(value)(children)


def _containers(lists: bool) -> tuple[type, ...]:
    return (dict, tuple, list) if lists else (dict, tuple)


def _children(container: Any) -> Any:
    """A container's children in order: a dict's values, a tuple's or list's items."""
    return container.values() if isinstance(container, dict) else container


def map_structure(fn: Callable[[Any], Any], structure: Any, *, lists: bool = True) -> Any:
    """``structure`` with every leaf replaced by ``fn(leaf)``, leaves visited depth-first in order."""
    containers = _containers(lists)

    # the walkers below run per block and per batch of every input pipeline, once per leaf: kept to one call a level
    def walk(value: Any) -> Any:
        return _rebuild(value, [walk(v) if isinstance(v, containers) else fn(v) for v in _children(value)])

    return walk(structure) if isinstance(structure, containers) else fn(structure)


def flatten(structure: Any, *, lists: bool = True) -> list[Any]:
    """The leaves of ``structure``, depth-first in order."""
    containers = _containers(lists)
    if not isinstance(structure, containers):
        return [structure]
    out: list[Any] = []

    def walk(value: Any) -> None:
        for v in _children(value):
            if isinstance(v, containers):
                walk(v)
            else:
                out.append(v)

    walk(structure)
    return out


_NO_LEAF = object()


def first_leaf(structure: Any, *, lists: bool = True) -> Any:
    """``flatten(structure)[0]`` without walking the rest; ``IndexError`` when the structure has no leaf."""
    leaf = _first_leaf(structure, lists)
    if leaf is _NO_LEAF:
        raise IndexError("first_leaf: the structure has no leaves")
    return leaf


def _first_leaf(structure: Any, lists: bool) -> Any:
    if not isinstance(structure, _containers(lists)):
        return structure
    for child in _children(structure):
        leaf = _first_leaf(child, lists)
        if leaf is not _NO_LEAF:
            return leaf
    return _NO_LEAF


def flatten_with_paths(structure: Any, *, lists: bool = True, path: str = "") -> list[tuple[str, Any]]:
    """``(path, leaf)`` pairs; a path reads like the indexing that reaches the leaf (``"['ids'][0]"``)."""
    if not is_nested(structure, lists=lists):
        return [(path, structure)]
    out: list[tuple[str, Any]] = []
    for key, value in _items(structure):
        out.extend(flatten_with_paths(value, lists=lists, path=f"{path}[{key!r}]"))
    return out


def pack(structure: Any, flat: Sequence[Any], *, lists: bool = True) -> Any:
    """``structure``'s shape filled with ``flat``'s values in order (the inverse of :func:`flatten`)."""
    values: Iterator[Any] = iter(flat)
    try:
        packed = map_structure(lambda _: next(values), structure, lists=lists)
    except StopIteration:
        raise ValueError(f"pack: the structure has more leaves than the {len(flat)} values given") from None
    left = sum(1 for _ in values)
    if left:
        raise ValueError(f"pack: the structure has {len(flat) - left} leaves but {len(flat)} values were given")
    return packed
