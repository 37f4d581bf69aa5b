"""kubeps.runtime.util.nest: the one nested-structure walker (its docstring examples run as doctests too)."""

from collections import OrderedDict, namedtuple

import pytest

from kubeps.runtime.util import nest

Pair = namedtuple("Pair", "a b")


def test_map_keeps_container_types_and_order():
    structure = OrderedDict([("z", Pair(1, [2, (3,)])), ("a", 4)])
    mapped = nest.map_structure(str, structure)
    assert mapped == OrderedDict([("z", Pair("1", ["2", ("3",)])), ("a", "4")])
    assert type(mapped) is OrderedDict and type(mapped["z"]) is Pair
    assert nest.flatten(structure) == [1, 2, 3, 4]


def test_pack_is_the_inverse_of_flatten_and_checks_the_count():
    structure = {"x": [1, 2], "y": Pair(3, (4,))}
    assert nest.pack(structure, nest.flatten(structure)) == structure
    with pytest.raises(ValueError, match="4 leaves but 5"):
        nest.pack(structure, [0] * 5)
    with pytest.raises(ValueError, match="more leaves than the 3"):
        nest.pack(structure, [0] * 3)


def test_lists_can_be_leaves():
    assert nest.map_structure(len, ([1, 2], {"k": [3]}), lists=False) == (2, {"k": 1})
    assert nest.flatten_with_paths(([1, 2],), lists=False) == [("[0]", [1, 2])]


def test_flatten_and_first_leaf_agree_with_the_paths_walk():
    structures = [
        {"x": [1, 2], "y": Pair(3, (4,))},
        ((), {"e": {}}, [5, (6, [])]),
        ({}, ()),
        7,
        OrderedDict([("b", ([8],)), ("a", 9)]),
    ]
    for structure in structures:
        for lists in (True, False):
            leaves = [leaf for _, leaf in nest.flatten_with_paths(structure, lists=lists)]
            assert nest.flatten(structure, lists=lists) == leaves
            if leaves:
                assert nest.first_leaf(structure, lists=lists) == leaves[0]
            else:
                with pytest.raises(IndexError, match="no leaves"):
                    nest.first_leaf(structure, lists=lists)
    assert nest.first_leaf(((), [[], 2]), lists=False) == [[], 2]  # with lists=False a list is a leaf, empty or not
