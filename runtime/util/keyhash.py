"""Stable 64-bit hashing of embedding keys, vectorised with numpy: which parameter server owns a key, where a key
sits in a ps's index, the values a new row starts with, and string ids as int64 keys.

Why a mixer and not ``key mod n``: ids are often sequential or share low bits (an auto-increment user id, a
timestamp-derived item id, ids that are all even), and ``key mod n`` then puts whole ranges or whole residue classes
on one ps. :func:`mix64` is SplitMix64's finaliser (Steele, Lea, Flood 2014; the ``mix`` step of ``java.util.
SplittableRandom`` and the seeding of xoshiro): a bijection on 64-bit words in which every input bit flips each
output bit with probability about 1/2, so any run of keys spreads evenly. It is pure integer arithmetic: the same on
every machine, process and numpy version (unlike Python's ``hash()``, salted per process).

Each use mixes with its own seed (:data:`SHARD_SEED`, :data:`INDEX_SEED`, the initializer's seed): the keys that land
on one ps share their shard bits, and an index that took its slot from those same bits would use a fraction of its
slots.

Strings hash to int64 keys with BLAKE2b (8-byte digest of the UTF-8 bytes, read little-endian as a signed
int64): stable everywhere, and two distinct strings share a key with probability about ``n**2 / 2**65`` for ``n``
strings (one in 3.6 million for a billion strings). :func:`fnv1a64` hashes a whole array of byte strings at once
(FNV-1a, one numpy step per byte position), for ids hashed into buckets (:mod:`kubeps.runtime.data.hashing`).
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

__all__ = ["INDEX_SEED", "SHARD_SEED", "fnv1a64", "hash_strings", "key_normal", "key_uniform", "mix64", "shard_of", "to_keys"]

_GOLDEN = 0x9E3779B97F4A7C15
_FNV_OFFSET = np.uint64(0xCBF29CE484222325)
_FNV_PRIME = np.uint64(0x100000001B3)
_MASK = (1 << 64) - 1
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
#: seed of the mix that picks a key's parameter server; of the mix that picks its slot in a ps's index
SHARD_SEED = 0x5EED_0001
INDEX_SEED = 0x5EED_0002


def mix64(keys: np.ndarray, seed: int = 0) -> np.ndarray:
    """SplitMix64 of ``keys + (seed + 1) * golden``: a uint64 array of the keys' shape (int64 keys are taken by
    their bit pattern)."""
    z = np.asarray(keys)
    z = z.view(np.uint64) if z.dtype == np.int64 else z.astype(np.uint64)
    with np.errstate(over="ignore"):
        z = z + np.uint64(((seed + 1) * _GOLDEN) & _MASK)
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def shard_of(keys: np.ndarray, num_shards: int) -> np.ndarray:
    """The parameter server (``0 .. num_shards - 1``) owning each key: the high 32 bits of its mix, mod
    ``num_shards`` (int64 array)."""
    return ((mix64(keys, SHARD_SEED) >> np.uint64(32)) % np.uint64(num_shards)).astype(np.int64)


def fnv1a64(strings: np.ndarray) -> np.ndarray:
    """The 64-bit FNV-1a hash (offset basis ``0xcbf29ce484222325``, prime ``0x100000001b3``) of the UTF-8 bytes of
    every string of a fixed-width ``'S'`` (bytes) or ``'U'`` (str) array, as uint64 of its shape: one numpy step
    per byte position, over all strings at once (an ASCII ``'U'`` array is hashed from its code points, which are
    its UTF-8 bytes, without encoding it). Numpy pads with NULs, so a string ends at its last non-NUL character
    (inner NULs are kept)."""
    strings = np.asarray(strings)
    if strings.dtype.kind not in "SU":
        raise TypeError(f"fnv1a64 takes a numpy bytes ('S') or str ('U') array, got dtype {strings.dtype}")
    flat = np.ascontiguousarray(strings.reshape(-1))
    units: np.ndarray  # the strings' code units, one row each: bytes, or the code points of an ASCII str array
    if strings.dtype.kind == "U":
        units = flat.view(np.uint32).reshape(flat.size, -1)
        if units.size and units.max() >= 0x80:  # not ASCII: hash the UTF-8 encoding
            return fnv1a64(np.char.encode(strings, "utf-8"))
    else:
        units = flat.view(np.uint8).reshape(flat.size, -1)
    out = np.full(flat.shape, _FNV_OFFSET, dtype=np.uint64)
    if units.size == 0:
        return out.reshape(strings.shape)
    width = units.shape[1]
    nonzero = units != 0
    lengths = np.where(nonzero.any(axis=1), width - np.argmax(nonzero[:, ::-1], axis=1), 0)
    with np.errstate(over="ignore"):  # arithmetic modulo 2**64
        for k in range(int(lengths.max())):
            step = (out ^ units[:, k].astype(np.uint64)) * _FNV_PRIME
            out = np.where(lengths > k, step, out)
    return out.reshape(strings.shape)


def hash_strings(values: Any) -> np.ndarray:
    """String ids as int64 keys: BLAKE2b-64 of each string's UTF-8 bytes (bytes are hashed as they are)."""
    flat = np.asarray(values, dtype=object).reshape(-1)
    out = np.empty(flat.size, dtype=np.int64)
    for i, s in enumerate(flat):
        raw = s if isinstance(s, bytes) else str(s).encode("utf-8")
        out[i] = int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little", signed=True)
    return out.reshape(np.shape(values))


def to_keys(ids: Any, what: str = "ids") -> np.ndarray:
    """Ids as int64 keys: integers as they are (uint64 by bit pattern), strings or bytes hashed
    (:func:`hash_strings`). Anything else is refused, naming ``what``."""
    arr = np.asarray(ids)
    if arr.dtype.kind == "i":
        return arr.astype(np.int64, copy=False)
    if arr.dtype.kind == "u":
        return arr.astype(np.uint64, copy=False).view(np.int64)
    if arr.dtype.kind in "US" or (arr.dtype == object and all(isinstance(v, (str, bytes)) for v in arr.reshape(-1))):
        return hash_strings(arr)
    raise ValueError(f"{what}: dtype {arr.dtype} is not allowed; allowed: integer ids (any int or uint dtype) or "
                     "strings (hashed to int64 keys)")


def _unit(keys: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Uniform floats in [0, 1), shape ``(len(keys), dim)``, a function of (key, column, seed) only."""
    base = mix64(keys, seed)[:, None]
    cols = (np.arange(dim, dtype=np.uint64) * np.uint64(_GOLDEN))[None, :]
    with np.errstate(over="ignore"):
        z = mix64(base + cols)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def key_uniform(keys: np.ndarray, dim: int, seed: int, minval: float, maxval: float) -> np.ndarray:
    """Rows drawn from U(minval, maxval), each a function of its key: a row created again (after an eviction, on
    another ps after a restore) starts from the same values."""
    return minval + (maxval - minval) * _unit(keys, dim, seed)


def key_normal(keys: np.ndarray, dim: int, seed: int, mean: float, stddev: float) -> np.ndarray:
    """Rows drawn from N(mean, stddev**2) by Box-Muller, each a function of its key."""
    u1 = 1.0 - _unit(keys, dim, seed)  # (0, 1]: log is finite
    u2 = _unit(keys, dim, seed ^ 0x6A09E667)
    return mean + stddev * np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
