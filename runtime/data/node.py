"""The pipeline node: one step of a dataset's pipeline, a source or a transformation of its parent's elements.

A :class:`~kubeps.runtime.data.dataset.Dataset` wraps the last node of its pipeline and adds the ``tf.data``
methods, each of which returns a new ``Dataset`` around a new node whose parent is the old one. Nodes do not know
``Dataset``: the sources (``sources.py``) and transformations (``transforms.py``, ``shuffle.py``, ``prefetch.py``)
sit below it and it delegates to them, as ``tf.data`` keeps each transformation in its own ``ops`` module. A node
holds no threads or locks, so a pipeline pickles (cloudpickle) to be shipped to a worker.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

from kubeps.runtime.data.structure import unblock


class Node:
    """One step of a pipeline. Every ``iterate()`` starts a fresh pass over its elements."""

    def __init__(self, parent: Node | None = None):
        self.parent = parent  #: the node whose elements this one transforms; None for a source

    @property
    def upstream(self) -> Node:
        """The parent of a transformation (a source has none: asking is a bug)."""
        if self.parent is None:
            raise TypeError(f"{type(self).__name__} is a source: it has no parent node")
        return self.parent

    def iterate(self) -> Iterator[Any]:  # pragma: no cover - every concrete node overrides it
        raise NotImplementedError

    def blocks(self) -> Iterator[Any] | None:
        """The elements as *blocks* -- structures of arrays whose leading axis runs over consecutive elements --,
        or None where this node works element by element.

        Array sources (``from_tensor_slices``, ``from_tensors``, ``range``) and the transformations that only
        pick, drop or reorder elements (``shard``, ``shuffle``, ``repeat``, ``take``, ``skip``) pass blocks on, so
        a ``batch`` above them is cut with array slicing and gathers: no Python step per element. ``map``,
        ``filter``, ``interleave`` and the other sources work per element (map after ``batch`` to vectorise)."""
        return None

    # -- introspection for auto-sharding and repr ------------------------------------------------------------------
    def root(self) -> Node:
        """The pipeline's source."""
        node = self
        while node.parent is not None:
            node = node.parent
        return node

    def with_root(self, root: Node) -> Node:
        """A copy of this pipeline whose source is replaced by ``root``."""
        if self.parent is None:
            return root
        clone = copy.copy(self)
        clone.parent = self.parent.with_root(root)
        return clone

    def chain(self) -> list[Node]:
        """The pipeline's nodes, source first."""
        nodes = []
        node: Node | None = self
        while node is not None:
            nodes.append(node)
            node = node.parent
        return nodes[::-1]

    @classmethod
    def kind(cls) -> str:
        """The node's kind, from its class name: ``TensorSlicesNode`` -> ``TensorSlices``."""
        return cls.__name__.removesuffix("Node")

    def describe(self) -> str:
        """This step in a dataset's repr (``map``, ``batch(32)``, ``list_files(4 files)``)."""
        return self.kind().lower()


class RowwiseNode(Node):
    """A transformation that only picks, drops or reorders elements: block-wise when its input is, else per
    element. Subclasses give both forms (``_on_blocks``, ``_on_elements``) of the same sequence."""

    def blocks(self) -> Iterator[Any] | None:
        parent = self.upstream.blocks()
        return None if parent is None else self._on_blocks(parent)

    def iterate(self) -> Iterator[Any]:
        blocks = self.blocks()
        return unblock(blocks) if blocks is not None else self._on_elements()

    def _on_blocks(self, parent: Iterator[Any]) -> Iterator[Any]:  # pragma: no cover - overridden
        raise NotImplementedError

    def _on_elements(self) -> Iterator[Any]:  # pragma: no cover - overridden
        raise NotImplementedError
