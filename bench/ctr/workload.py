"""The CTR workload that ``bench/ctr_vs_tf.py`` trains on kubeps and on TensorFlow, side by side.

Criteo-like and synthetic, with a known answer: ``FIELDS`` categorical fields of very different cardinalities
(from 10 to 500k values, each drawn from a skewed, Zipf-like popularity) hashed into ONE shared table of
``VOCAB`` rows x ``DIM``, ``DENSE`` dense features, an MLP head ``FIELDS*DIM + DENSE -> 64 -> 32 -> 1`` (ReLU),
sigmoid cross-entropy, Adagrad (TF2's formula: ``accum += g*g; var -= lr * g / (sqrt(accum) + eps)``, ``accum``
starting at 0.1). Labels come from a logistic "teacher" (per-value weights, dense weights and one dense
interaction), so the teacher's own log-loss on held-out data is the best any model can do.

Everything both sides need is written once by :func:`write` into a folder of ``.npy`` files -- the training set,
the held-out set and the initial weights -- so the two runtimes start from the same bytes. Only numpy here: the
TensorFlow side imports this file from its own environment.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import NamedTuple

import numpy as np

FIELDS = 8
VOCAB = 1 << 20
#: the embedding width; a data folder records the one it was written with and :func:`parse_args` adopts it
DIM = 16
DENSE = 13
HIDDEN = (64, 32)
LEARNING_RATE = 0.05
INITIAL_ACCUMULATOR = 0.1
EPSILON = 1e-7
BATCH = 512
STEPS_PER_EXECUTION = 10
SHUFFLE_BUFFER = 10_000
CARDINALITIES = (10, 300, 1_000, 5_000, 20_000, 50_000, 200_000, 500_000)
#: Criteo Kaggle's 26 per-field cardinalities (docs/../shared/reference/recsys-workloads.md), capped at 500k so the
#: teacher's per-value weights stay small; all 26 fields hashed into the one shared table
CRITEO_CARDINALITIES = tuple(min(c, 500_000) for c in (
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306, 10, 5652,
    2173, 4, 7046547, 18, 15, 286181, 105, 142572))
TEACHER_SEED = 20261123


class Shape(NamedTuple):
    """One ``bench/ctr_vs_tf.py --shape``: the categorical fields' cardinalities, the table's width, the batch and
    the MLP head's hidden units."""
    cardinalities: tuple[int, ...]
    dim: int
    batch: int
    hidden: tuple[int, ...]


#: "wide" moves 16x the bytes per step of "standard"; "wdl" is DeepRec's Wide & Deep shape (26 fields x 16,
#: 13 dense, MLP 1024-512-256, batch 512), where the dense part dominates
SHAPES = {"standard": Shape(CARDINALITIES, 16, 512, HIDDEN), "wide": Shape(CARDINALITIES, 64, 2048, HIDDEN),
          "wdl": Shape(CRITEO_CARDINALITIES, 16, 512, (1024, 512, 256))}



def hash_ids(values: np.ndarray) -> np.ndarray:
    """``(field, value)`` pairs -> ids in ``[0, VOCAB)`` (multiplicative hashing, as a hashed feature column)."""
    field = np.arange(values.shape[1], dtype=np.uint64)[None, :]
    key = field * np.uint64(1_000_003) + values.astype(np.uint64)
    mixed = (key * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(24)
    return (mixed % np.uint64(VOCAB)).astype(np.int64)


class Teacher:
    def __init__(self, seed: int = TEACHER_SEED):
        rng = np.random.default_rng(seed)
        scale = 0.6 * np.sqrt(8 / len(CARDINALITIES))  # the logit's variance of 8 fields, whatever their number
        self.value_weights = [rng.normal(0.0, scale, size=c) for c in CARDINALITIES]
        self.dense_weights = rng.normal(0.0, 0.4, size=DENSE)
        self.bias = -1.2

    def sample(self, n: int, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        # Zipf-like popularity: value = floor(card * u**3) puts most mass on a few values, a long tail on the rest
        values = np.stack([np.minimum((c * rng.random(n) ** 3).astype(np.int64), c - 1) for c in CARDINALITIES], 1)
        dense = rng.normal(size=(n, DENSE)).astype(np.float32)
        logit = self.bias + dense @ self.dense_weights + 0.8 * np.tanh(dense[:, 0] * dense[:, 1])
        for f in range(FIELDS):
            logit += self.value_weights[f][values[:, f]]
        p = 1.0 / (1.0 + np.exp(-logit))
        labels = (rng.random(n) < p).astype(np.float32)
        return {"ids": hash_ids(values), "dense": dense, "labels": labels, "p": p}


def head_weights(hidden: tuple[int, ...], seed: int = 0) -> dict[str, np.ndarray]:
    """Glorot-uniform kernels and zero biases of an MLP head ``FIELDS*DIM + DENSE -> hidden... -> 1`` other than the
    data folder's (``--head``: the dense-heavy variant), the same for every program given the same ``seed``."""
    rng = np.random.default_rng(seed + 7)
    sizes = (FIELDS * DIM + DENSE, *hidden, 1)
    out = {}
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        out[f"w{i}"] = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
        out[f"b{i}"] = np.zeros(fan_out, np.float32)
    return out


def init_weights(folder: str, hidden: tuple[int, ...]) -> dict[str, np.ndarray]:
    """The initial weights of a run: the data folder's, with the head of ``hidden`` when it is not :data:`HIDDEN`."""
    init = dict(load(folder, "init"))
    if tuple(hidden) != HIDDEN:
        init = {"embedding": init["embedding"], **head_weights(tuple(hidden))}
    return init


def use_shape(name: str) -> Shape:
    """Make shape ``name`` this process's (:data:`FIELDS`, :data:`CARDINALITIES`, :data:`DIM`, :data:`HIDDEN`,
    which the teacher and the models read when they are built)."""
    global FIELDS, CARDINALITIES, DIM, HIDDEN
    if name not in SHAPES:
        raise ValueError(f"shape {name!r}: expected one of {sorted(SHAPES)}")
    shape = SHAPES[name]
    CARDINALITIES, DIM, HIDDEN = shape.cardinalities, shape.dim, shape.hidden
    FIELDS = len(CARDINALITIES)
    return shape


def initial_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Keras' defaults: the table ``U(-0.05, 0.05)``, kernels Glorot-uniform, biases zero."""
    rng = np.random.default_rng(seed)
    out = {"embedding": rng.uniform(-0.05, 0.05, size=(VOCAB, DIM)).astype(np.float32)}
    sizes = (FIELDS * DIM + DENSE, *HIDDEN, 1)
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        out[f"w{i}"] = rng.uniform(-limit, limit, size=(fan_in, fan_out)).astype(np.float32)
        out[f"b{i}"] = np.zeros(fan_out, np.float32)
    return out


def write(folder: str, train_examples: int = 1 << 20, eval_examples: int = 100_000, seed: int = 0) -> dict:
    """Write the training set, the held-out set and the initial weights to ``folder``; returns the metadata."""
    os.makedirs(folder, exist_ok=True)
    teacher = Teacher()
    train = teacher.sample(train_examples, seed=seed + 1)
    held_out = teacher.sample(eval_examples, seed=seed + 2)
    for name in ("ids", "dense", "labels"):
        np.save(os.path.join(folder, f"train_{name}.npy"), train[name])
    for name in ("ids", "dense", "labels", "p"):
        np.save(os.path.join(folder, f"eval_{name}.npy"), held_out[name])
    for name, array in initial_weights(seed).items():
        np.save(os.path.join(folder, f"init_{name}.npy"), array)
    meta = {"train_examples": train_examples, "eval_examples": eval_examples, "seed": seed, "shape": shape_name(),
            "teacher_logloss": log_loss(held_out["labels"], held_out["p"]),
            "base_logloss": log_loss(held_out["labels"], np.full(eval_examples, held_out["labels"].mean()))}
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)
    return meta


def weight_names(hidden: tuple[int, ...] | None = None) -> tuple[str, ...]:
    """The weight arrays of a model with ``hidden`` (default :data:`HIDDEN`) in model order: the table, then the
    head's kernels and biases (``w0``, ``b0``, ...)."""
    layers = len(HIDDEN if hidden is None else hidden) + 1
    return ("embedding", *(f"{k}{i}" for i in range(layers) for k in ("w", "b")))


def shape_name() -> str:
    """The name of this process's shape (set by :func:`use_shape`)."""
    return next(name for name, shape in SHAPES.items()
                if (shape.cardinalities, shape.dim, shape.hidden) == (CARDINALITIES, DIM, HIDDEN))


def load(folder: str, prefix: str) -> dict[str, np.ndarray]:
    """The arrays of one split (``train`` or ``eval``) or the initial weights (``init``), memory-mapped."""
    names = weight_names() if prefix == "init" else ("ids", "dense", "labels") + (("p",) if prefix == "eval" else ())
    return {n: np.load(os.path.join(folder, f"{prefix}_{n}.npy"), mmap_mode="r") for n in names}


def log_loss(labels: np.ndarray, p: np.ndarray) -> float:
    p = np.clip(p, 1e-7, 1 - 1e-7)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels > 0.5
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def evaluate(weights: dict[str, np.ndarray], folder: str) -> dict[str, float]:
    """Log-loss and AUC of trained weights (numpy arrays named as :data:`WEIGHTS`) on the held-out set: the same
    numpy forward pass scores both runtimes' models."""
    held_out = load(folder, "eval")
    ids, dense = np.asarray(held_out["ids"]), np.asarray(held_out["dense"])
    x = np.concatenate([weights["embedding"][ids].reshape(len(ids), -1), dense], axis=1)
    layers = sum(1 for name in weights if name.startswith("w"))  # the head's depth (``--head``)
    for i in range(layers):
        x = x @ weights[f"w{i}"] + weights[f"b{i}"]
        if i < layers - 1:
            x = np.maximum(x, 0.0)
    p = 1.0 / (1.0 + np.exp(-x[:, 0].astype(np.float64)))
    labels = np.asarray(held_out["labels"])
    return {"eval_logloss": log_loss(labels, p), "eval_auc": auc(labels, p),
            "teacher_logloss": log_loss(labels, np.asarray(held_out["p"]))}


def timed_training(coordinator, train_fn, iterator, args, weights, runtime: str) -> dict:
    """The chief's side of both programs: ``--warmup-executions`` executions of ``train_fn`` (not timed), then the
    rest timed up to the last ``join()`` between ``TIMED START``/``TIMED END`` lines (the driver reads every task's
    CPU time at both), then the final weights (``weights()``) scored; prints and returns the ``RESULT``."""
    spe, batch = args.steps_per_execution, args.batch_size
    executions = args.steps // spe
    warmup = min(args.warmup_executions, executions)
    for _ in range(warmup):
        coordinator.schedule(train_fn, args=(iterator,))
    coordinator.join()
    print(f"TIMED START {time.time():.6f}", flush=True)
    started = time.perf_counter()
    losses = [coordinator.schedule(train_fn, args=(iterator,)) for _ in range(executions - warmup)]
    coordinator.join()
    elapsed = time.perf_counter() - started
    print(f"TIMED END {time.time():.6f}", flush=True)
    timed_steps = (executions - warmup) * spe
    # a function's result: its mean loss, or (mean loss, embedding rows it pulled) where the model counts them
    fetched = [r.fetch() for r in losses]
    result = {"examples_per_s": timed_steps * batch / elapsed, "train_seconds": elapsed, "steps": executions * spe,
              "train_logloss": float(np.mean([f[0] if isinstance(f, tuple) else f for f in fetched[-20:]]))
              if fetched else float("nan")}
    if fetched and all(isinstance(f, tuple) for f in fetched):
        result["pull_bytes_per_example"] = sum(f[1] for f in fetched) * DIM * 4 / (timed_steps * batch)
    result.update(evaluate(weights(), args.data))
    print(f"{runtime}: {timed_steps} timed steps of {batch} in {elapsed:.1f} s: {result['examples_per_s']:.0f} "
          f"examples/s; eval log-loss {result['eval_logloss']:.4f} (teacher {result['teacher_logloss']:.4f})",
          flush=True)
    print("RESULT " + json.dumps(result), flush=True)
    return result


def parse_args(description: str, argv=None) -> argparse.Namespace:
    """The command line both programs take (the driver passes the same arguments to each)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", required=True, help="folder written by workload.write")
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--batch-size", type=int, default=BATCH)
    p.add_argument("--steps-per-execution", type=int, default=STEPS_PER_EXECUTION)
    p.add_argument("--warmup-executions", type=int, default=4)
    p.add_argument("--head", type=hidden_units,
                   help="the MLP head's hidden units, e.g. 1024,1024,512,256 (the dense-heavy variant; default: the "
                        "data folder's shape's)")
    p.add_argument("--overlap", action="store_true",
                   help="pull the next batch's embedding rows while the current step computes (one step stale)")
    p.add_argument("--dense-staleness", type=int, default=0,
                   help="ParameterServerStrategy(dense_staleness=N): a worker reuses the dense weights it pulled for N "
                        "more of its steps (kubeps sides)")
    p.add_argument("--hot-rows", type=int, default=0,
                   help="rows of the table each worker caches (its most looked-up ids; 0: no cache); kubeps numpy side")
    p.add_argument("--hot-refresh-steps", type=int, default=20,
                   help="lookups between two pulls of the cached rows (how stale a cached row may be)")
    args = p.parse_args(argv)
    with open(os.path.join(args.data, "meta.json")) as f:
        use_shape(json.load(f).get("shape", "standard"))  # the fields, the table's width and the head: the folder's
    args.head = args.head or HIDDEN
    return args


def hidden_units(text: str) -> tuple[int, ...]:
    """``"1024,1024,512,256"`` -> ``(1024, 1024, 512, 256)``: positive integers separated by commas."""
    try:
        units = tuple(int(part) for part in text.split(","))
    except ValueError:
        units = ()
    if not units or min(units) < 1:
        raise argparse.ArgumentTypeError(f"--head={text!r}; allowed: positive integers separated by ',' "
                                         f"(e.g. 1024,1024,512,256)")
    return units
