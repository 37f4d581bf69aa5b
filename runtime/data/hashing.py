"""Hashing ids into a fixed number of buckets, vectorised with numpy: :func:`hash_bucket` (TensorFlow's
``tf.strings.to_hash_bucket_fast`` and Keras's ``Hashing`` layer do this job in TF programs).

The hash is fixed: the same id gives the same bucket in every process, on every machine, in every kubeps version
(tests pin golden values). For an id ``x`` and a ``salt`` (default 0), with all arithmetic modulo 2**64:

- an **integer** id (any numpy integer dtype, or Python ints): ``key = uint64(x) ^ salt``, where a negative
  ``x`` is taken as its two's complement (-1 is ``2**64 - 1``);
- a **string** (``str``, encoded as UTF-8, or ``bytes``): ``key = fnv1a64(bytes) ^ salt``, the 64-bit FNV-1a hash
  of its bytes (offset basis ``0xcbf29ce484222325``, prime ``0x100000001b3``);
- then ``hash = splitmix64(key)``: ``z = key + 0x9E3779B97F4A7C15``; ``z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9``;
  ``z = (z ^ (z >> 27)) * 0x94D049BB133111EB``; ``hash = z ^ (z >> 31)`` (the output of Vigna's SplitMix64
  generator at state ``key``: every bit of the key moves about half of the hash's bits;
  :func:`~kubeps.runtime.util.keyhash.mix64` with seed 0);
- ``bucket = hash % num_buckets``, as int64. With ``mask_value`` (as Keras's ``Hashing``), ids equal to it go to
  bucket 0 and the others to ``1 + hash % (num_buckets - 1)``.

An integer id and the string of its digits hash differently (``7`` is not ``"7"``), and the buckets are not
TensorFlow's (its strings go through FarmHash): hash with the same function for training and serving. Numpy
strips trailing NUL bytes from fixed-width byte strings, so ``b"a"`` and ``b"a\\x00"`` are one id.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kubeps.runtime.checks import PositiveInt, check, integer
from kubeps.runtime.errors import RuntimeConfigError
from kubeps.runtime.util.keyhash import fnv1a64, mix64

#: ``salt``: a 64-bit unsigned integer
_SALT: Any = integer(ge=0, le=2**64 - 1, allowed="an integer from 0 to 2**64 - 1")


def _id_array(values: Any) -> np.ndarray:
    """``values`` as an array of integers or byte strings; Python containers are checked value by value (numpy
    would turn ``[1, "a"]`` into the strings ``"1"``, ``"a"``)."""
    if isinstance(values, np.ndarray) and values.dtype.kind != "O":
        return values
    array = np.asarray(values, dtype=object)
    items = array.reshape(-1).tolist()
    if all(isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_)) for v in items):
        return np.array(items, dtype=np.uint64 if any(v > 2**63 - 1 for v in items) else np.int64).reshape(array.shape)
    if all(isinstance(v, (str, bytes, np.str_, np.bytes_)) for v in items):
        encoded = [v.encode("utf-8") if isinstance(v, str) else bytes(v) for v in items]
        return np.array(encoded, dtype=bytes).reshape(array.shape) if encoded else np.zeros(array.shape, "S1")
    kinds = sorted({type(v).__name__ for v in items})
    raise TypeError(f"hash_bucket: ids must be all integers or all strings (str or bytes), got values of types {kinds}")


def _keys(values: Any) -> np.ndarray:
    """The uint64 keys of ``values`` (integers or strings) before mixing."""
    array = _id_array(values)
    if array.dtype.kind in "SU":
        return fnv1a64(array)
    if array.dtype.kind in "iu":
        return array.astype(np.int64, copy=False).view(np.uint64) if array.dtype.kind == "i" else \
            array.astype(np.uint64, copy=False)
    raise TypeError(f"hash_bucket: ids must be integers or strings (str or bytes), got dtype {array.dtype}: "
                    "hash ids, not measurements")


def hash64(values: Any, salt: int = 0) -> np.ndarray:
    """The 64-bit hash (uint64, the shape of ``values``) of integer or string ids (the module's docstring says
    how it is computed)."""
    salt = check("salt", salt, _SALT, owner="hash64")
    return mix64(_keys(values) ^ np.uint64(salt))  # seed 0: SplitMix64's output at state key


def hash_bucket(values: Any, num_buckets: int, salt: int = 0, mask_value: Any = None) -> np.ndarray:
    """The bucket, in ``[0, num_buckets)``, of every id of ``values`` (an array, list or scalar of integers or
    strings) as int64 of the same shape: ``hash64(values, salt) % num_buckets``. With ``mask_value``, those ids
    go to bucket 0 and the others to ``[1, num_buckets)`` (Keras's ``Hashing(mask_value=)``). Use it in a
    ``Dataset.map`` (on batches it runs once per batch) or anywhere ids are hashed."""
    num_buckets = check("num_buckets", num_buckets, PositiveInt, owner="hash_bucket")
    if mask_value is not None and num_buckets < 2:
        raise RuntimeConfigError("num_buckets", num_buckets, f"hash_bucket with mask_value={mask_value!r} needs "
                                 "num_buckets >= 2 (bucket 0 holds the masked ids)")
    hashed = hash64(values, salt)
    if mask_value is None:
        return (hashed % np.uint64(num_buckets)).astype(np.int64)
    buckets = (hashed % np.uint64(num_buckets - 1)).astype(np.int64) + 1
    return np.where(np.asarray(values) == mask_value, 0, buckets)
