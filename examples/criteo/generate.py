"""Criteo-format click logs, generated offline, with a known answer.

    python examples/criteo/generate.py --out /tmp/criteo --lines 1000000 --files 4 [--gzip] [--seed 0]

writes ``train-00000.txt`` ... (``.txt.gz`` with ``--gzip``) and ``teacher.json`` into ``--out``. Each line is in
Criteo's format (the Kaggle Display Advertising set): tab-separated, the label, 13 integer features ``I1``-``I13``
and 26 categorical features ``C1``-``C26`` as 8-hex-digit 32-bit hashes, any feature possibly empty; read them
with ``kp.Dataset.from_files(paths, reader="criteo")``.

- **Ids**: field ``C{f+1}`` draws a rank ``r`` in ``[0, CARDINALITIES[f])`` (the Kaggle set's published distinct
  values per field, 33.8M in all) from a heavy-tailed, Zipf-like law: ``P(rank >= k) = 1 - ln(k+1)/ln(card+1)``,
  so a few ids are most of the traffic and most ids are rare. The hex written is a fixed bijection of
  ``(field, rank)`` to 32 bits (:func:`scramble`; :func:`unscramble` inverts it).
- **Integer features**: counts, ``floor(exp(N(mu_j, sigma_j)))`` (``I2`` sometimes -1 to -3, as in Criteo).
- **Empty values**: each field is empty at its own rate (:data:`EMPTY_RATES`): most rarely, ``I1``, ``I10``,
  ``C19``, ``C20``, ``C25``, ``C26`` often, ``I12`` and ``C22`` mostly, resembling the Kaggle set.
- **Labels** come from a logistic teacher (:class:`Teacher`, fixed by ``--teacher-seed``, independent of the
  data's ``--seed``, so a training set and an eval set written with two seeds share it). Its logit is a bias, a
  weight per integer feature on ``log1p(max(x, 0))`` (standardised), and per categorical field a weight for each
  of its ``HEAD_IDS`` most frequent ids and for "empty" (the rarer ids weigh 0), so what can be learned from data
  is what decides the label. ``teacher.json`` records the teacher's own log-loss on the lines written (the best a
  model can do on them) and its expectation.

A later training program imports :data:`CARDINALITIES` and :class:`Teacher` from here.
"""

from __future__ import annotations

import argparse
import gzip
import json
import math
import os
import sys
from typing import Any

import numpy as np

#: distinct values of C1-C26 in Criteo's Kaggle set (as used by DLRM, TorchRec and DeepCTR)
CARDINALITIES = (1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
                 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572)
NUM_DENSE = 13
NUM_CATEGORICAL = len(CARDINALITIES)
#: the rate at which each field is empty: I1-I13, then C1-C26
EMPTY_RATES = (0.45, 0.0, 0.21, 0.22, 0.03, 0.22, 0.04, 0.001, 0.04, 0.45, 0.04, 0.77, 0.22,
               0.0, 0.0, 0.03, 0.03, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0, 0.0, 0.03, 0.0, 0.0,
               0.44, 0.44, 0.03, 0.76, 0.0, 0.03, 0.44, 0.44)
#: log-normal parameters of the integer features' counts
DENSE_MU = (0.8, 2.0, 2.2, 1.6, 7.5, 3.9, 1.4, 2.4, 3.8, 0.3, 0.9, 0.2, 1.5)
DENSE_SIGMA = (1.2, 1.6, 1.4, 1.0, 1.8, 1.6, 1.3, 1.0, 1.3, 0.5, 0.8, 0.6, 1.1)
#: the ids of each field (its most frequent) that the teacher gives a weight: few enough that a model sees each of
#: them often, so the teacher's log-loss is within reach of a model trained on a million lines
HEAD_IDS = 100

_M32 = np.uint64(0xFFFFFFFF)
_A = 0x9E3779B1
_B = 0x85EBCA77
_A_INV = pow(_A, -1, 2**32)
_B_INV = pow(_B, -1, 2**32)


def _mul32(x: np.ndarray, k: int) -> np.ndarray:
    return (x * np.uint64(k)) & _M32


def _xorshift16(x: np.ndarray) -> np.ndarray:
    return x ^ (x >> np.uint64(16))  # its own inverse on 32 bits


def scramble(field: int, ranks: np.ndarray) -> np.ndarray:
    """The 32-bit hash written for ids of rank ``ranks`` in field ``field`` (a bijection for each field)."""
    x = (np.asarray(ranks).astype(np.uint64) + np.uint64((field * 0x61C88647) & 0xFFFFFFFF)) & _M32
    return _xorshift16(_mul32(_xorshift16(_mul32(x, _A)), _B)).astype(np.int64)


def unscramble(field: int, hashes: np.ndarray) -> np.ndarray:
    """The ranks of the 32-bit hashes of field ``field`` (:func:`scramble`'s inverse)."""
    x = _mul32(_xorshift16(_mul32(_xorshift16(np.asarray(hashes).astype(np.uint64)), _B_INV)), _A_INV)
    return ((x - np.uint64((field * 0x61C88647) & 0xFFFFFFFF)) & _M32).astype(np.int64)


def _unit_normal(field: int, ranks: np.ndarray, seed: int) -> np.ndarray:
    """A fixed N(0, 1) draw per (seed, field, rank), by hashing: no table of millions of weights."""
    z = (np.asarray(ranks).astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ np.uint64(seed * 1_000_003 + field)
    u = []
    for salt in (0x243F6A8885A308D3, 0x13198A2E03707344):
        h = z ^ np.uint64(salt)
        h = (h ^ (h >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        h = (h ^ (h >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        h = h ^ (h >> np.uint64(31))
        u.append(((h >> np.uint64(11)).astype(np.float64) + 0.5) / 2.0**53)
    return np.sqrt(-2 * np.log(u[0])) * np.cos(2 * np.pi * u[1])


class Teacher:
    """The logistic model that labels the generated lines: :meth:`probability` of a block as the ``criteo`` reader
    gives it (``{"dense": float32[n, 13], "categorical": int64[n, 26]}``)."""

    def __init__(self, seed: int = 0, bias: float = -1.6, dense_scale: float = 0.3, categorical_scale: float = 0.45):
        rng = np.random.default_rng([seed, 57])
        self.seed = seed
        self.bias = bias
        self.dense_weights = rng.normal(0.0, dense_scale, NUM_DENSE)
        self.categorical_scale = categorical_scale

    def logits(self, block: dict[str, np.ndarray]) -> np.ndarray:
        dense = np.log1p(np.maximum(np.asarray(block["dense"], np.float64), 0.0))
        logit = self.bias + ((dense - DENSE_MU) / DENSE_SIGMA) @ self.dense_weights
        categorical = np.asarray(block["categorical"])
        for f in range(NUM_CATEGORICAL):
            ids = categorical[:, f]
            empty = ids < 0
            ranks = np.where(empty, CARDINALITIES[f], unscramble(f, np.where(empty, 0, ids)))  # "empty": one more id
            weight = self.categorical_scale * _unit_normal(f, ranks, self.seed)
            logit += np.where(empty | (ranks < HEAD_IDS), weight, 0.0)
        return logit

    def probability(self, block: dict[str, np.ndarray]) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-self.logits(block)))


def log_loss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-12, 1 - 1e-12)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def sample(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """``n`` examples' features as the reader gives them (dense as float32, categorical int64, -1 when empty),
    plus ``dense_empty`` (where an integer feature is empty: it is written as nothing, read as 0)."""
    counts = np.floor(np.exp(rng.normal(DENSE_MU, DENSE_SIGMA, (n, NUM_DENSE)))).astype(np.int64)
    counts[:, 1] = np.where(rng.random(n) < 0.05, -rng.integers(1, 4, n), counts[:, 1])
    empty = rng.random((n, NUM_DENSE + NUM_CATEGORICAL)) < np.asarray(EMPTY_RATES)
    counts[empty[:, :NUM_DENSE]] = 0
    categorical = np.empty((n, NUM_CATEGORICAL), np.int64)
    for f, card in enumerate(CARDINALITIES):
        ranks = np.minimum(np.floor(np.exp(rng.random(n) * math.log(card + 1))).astype(np.int64) - 1, card - 1)
        categorical[:, f] = scramble(f, ranks)
    categorical[empty[:, NUM_DENSE:]] = -1
    return {"counts": counts, "dense": counts.astype(np.float32), "categorical": categorical,
            "dense_empty": empty[:, :NUM_DENSE]}


def _decimal(values: np.ndarray) -> np.ndarray:
    return values.astype("S20")


def _hex8(values: np.ndarray) -> np.ndarray:
    nibbles = (values[:, None] >> np.arange(28, -1, -4)) & 0xF
    return np.frombuffer(b"0123456789abcdef", np.uint8)[nibbles].copy().view("S8").reshape(-1)


def format_lines(labels: np.ndarray, examples: dict[str, np.ndarray]) -> bytes:
    """The lines of ``examples`` in Criteo's format, built column by column into one buffer."""
    n = len(labels)
    columns = [_decimal(labels)]
    for j in range(NUM_DENSE):
        text = _decimal(examples["counts"][:, j])
        columns.append(np.where(examples["dense_empty"][:, j], b"", text))
    for f in range(NUM_CATEGORICAL):
        ids = examples["categorical"][:, f]
        columns.append(np.where(ids < 0, b"", _hex8(np.maximum(ids, 0))))
    lengths = np.stack([np.char.str_len(c) for c in columns], axis=1) + 1  # each field and its tab (or newline)
    ends = np.cumsum(lengths.reshape(-1)).reshape(n, len(columns))
    out = np.full(int(ends[-1, -1]) if n else 0, ord("\t"), dtype=np.uint8)
    out[ends[:, -1] - 1] = ord("\n")
    starts = ends - lengths
    for j, column in enumerate(columns):
        width = column.dtype.itemsize
        chars = np.ascontiguousarray(column).view(np.uint8).reshape(n, width)
        inside = np.arange(width) < (lengths[:, j] - 1)[:, None]
        out[(starts[:, j, None] + np.arange(width))[inside]] = chars[inside]
    return out.tobytes()


def generate(out: str, lines: int, files: int = 1, gzipped: bool = False, seed: int = 0, teacher_seed: int = 0,
             chunk: int = 100_000) -> dict[str, Any]:
    """Write ``lines`` lines into ``files`` files under ``out`` and ``teacher.json``; returns what it records."""
    if lines < 1 or files < 1 or files > lines:
        raise ValueError(f"lines={lines}, files={files}: allowed: lines >= files >= 1")
    os.makedirs(out, exist_ok=True)
    rng = np.random.default_rng([seed, 2014])
    teacher = Teacher(teacher_seed)
    names, loss_sum, entropy_sum, positives = [], 0.0, 0.0, 0
    for i in range(files):
        name = f"train-{i:05d}.txt" + (".gz" if gzipped else "")
        names.append(name)
        todo = lines // files + (1 if i < lines % files else 0)
        path = os.path.join(out, name)
        with (gzip.open(path, "wb", compresslevel=1) if gzipped else open(path, "wb")) as f:
            while todo:
                n = min(chunk, todo)
                todo -= n
                examples = sample(rng, n)
                p = teacher.probability(examples)
                labels = (rng.random(n) < p).astype(np.int64)
                f.write(format_lines(labels, examples))
                loss_sum += log_loss(labels, p) * n
                entropy_sum += log_loss(p, p) * n
                positives += int(labels.sum())
    record = {
        "format": "criteo", "files": names, "lines": lines, "seed": seed, "teacher_seed": teacher_seed,
        "positive_rate": positives / lines,
        "teacher_logloss": loss_sum / lines,  # the teacher's log-loss on these lines: the best a model can do
        "expected_logloss": entropy_sum / lines,  # its expectation (the teacher's mean binary entropy)
        "cardinalities": list(CARDINALITIES), "head_ids": HEAD_IDS,
    }
    with open(os.path.join(out, "teacher.json"), "w") as f:
        json.dump(record, f, indent=1)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder to write the files and teacher.json into")
    parser.add_argument("--lines", type=int, default=1_000_000)
    parser.add_argument("--files", type=int, default=1)
    parser.add_argument("--gzip", action="store_true", help="write .txt.gz files")
    parser.add_argument("--seed", type=int, default=0, help="the data's seed (another seed: other lines)")
    parser.add_argument("--teacher-seed", type=int, default=0, help="the teacher's seed (keep it for an eval set)")
    args = parser.parse_args(argv)
    record = generate(args.out, args.lines, args.files, args.gzip, args.seed, args.teacher_seed)
    print(f"wrote {record['lines']} lines in {len(record['files'])} file(s) to {args.out}: positive rate "
          f"{record['positive_rate']:.3f}, teacher log-loss {record['teacher_logloss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
