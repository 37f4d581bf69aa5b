"""A small CTR-like training program for the chaos tests (runs as every task under a local cluster).

Model: every example has ``--fields`` categorical ids out of ``--vocab``; ``logit = sum_f emb[id_f] . w + b``, trained
with Adagrad on the parameter servers (``emb`` sharded in 2, sparse updates). The data comes from a fixed "teacher"
(one hidden effect per id), so the best log-loss is known and an undisturbed run converges near it.

The chief schedules ``--closures`` closures of ``--steps-per-closure`` steps, joins every ``--checkpoint-every``
closures and saves a checkpoint (the last one ``final``), then writes the eval log-loss to ``--out``. It restores
the latest checkpoint on start, so a restarted chief resumes. Every closure appends ``S index worker pid time`` to
``--runs-log`` when it starts and ``E ...`` when it ends (re-runs = at-least-once duplicates); the chief appends
progress events to ``--progress``.
The evaluator task runs the SidecarEvaluator on the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

BIAS = -0.5


def teacher(vocab: int) -> np.ndarray:
    return np.random.default_rng(1234).normal(size=vocab) * 1.5


def make_batch(rng, theta, vocab, fields, batch):
    ids = rng.integers(0, vocab, size=(batch, fields))
    logit = theta[ids].sum(axis=1) / np.sqrt(fields) + BIAS
    y = (rng.random(batch) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return ids, y


class CTRBatches:
    """The per-worker dataset: an endless stream of ``(ids, labels)`` batches."""

    def __init__(self, vocab, fields, batch, seed):
        self.vocab, self.fields, self.batch, self.seed = vocab, fields, batch, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        theta = teacher(self.vocab)
        while True:
            yield make_batch(rng, theta, self.vocab, self.fields, self.batch)


def log_loss(emb, w, b, ids, y) -> float:
    logit = emb[ids].sum(axis=1) @ w + b[0]
    p = np.clip(1.0 / (1.0 + np.exp(-logit)), 1e-7, 1 - 1e-7)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log(1 - p)))


def eval_set(args):
    return make_batch(np.random.default_rng(777), teacher(args.vocab), args.vocab, args.fields, 20000)


def parse(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=200)
    p.add_argument("--fields", type=int, default=6)
    p.add_argument("--dim", type=int, default=4)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--closures", type=int, default=60)
    p.add_argument("--steps-per-closure", type=int, default=4)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--closure-sleep", type=float, default=0.0, help="extra seconds per closure (longer runs)")
    p.add_argument("--lr", type=float, default=0.3)
    p.add_argument("--checkpoint-dir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--runs-log", required=True)
    p.add_argument("--progress", required=True)
    p.add_argument("--metrics", default=None)
    return p.parse_args(argv)


def event(args, **fields) -> None:
    with open(args.progress, "a") as f:
        f.write(json.dumps({"time": time.time(), "pid": os.getpid(), **fields}) + "\n")


def chief(args) -> None:
    from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, StepCounter
    from kubeps.runtime.coordinator import ClusterCoordinator
    from kubeps.runtime.errors import PSUnavailableError
    from kubeps.runtime.optimizers import Adagrad
    from kubeps.runtime.partitioners import FixedShardsPartitioner
    from kubeps.runtime.strategy import ParameterServerStrategy
    from kubeps.runtime.training import IndexedSlices
    from kubeps.runtime.variables import Variable, embedding_lookup

    strategy = ParameterServerStrategy.from_tf_config(variable_partitioner=FixedShardsPartitioner(2))
    deadline = time.monotonic() + 60
    for ps in range(strategy.num_ps):  # all tasks start together: wait for the servers to listen
        while True:
            try:
                strategy.transport.call(ps, "Ping", {})
                break
            except PSUnavailableError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    rng = np.random.default_rng(0)
    with strategy.scope():
        emb = Variable(rng.normal(size=(args.vocab, args.dim)).astype(np.float32) * 0.1, name="emb")
        w = Variable(np.full(args.dim, 0.5, np.float32), name="w")
        b = Variable(np.zeros(1, np.float32), name="b")
    opt = Adagrad(args.lr)
    step = StepCounter()
    manager = CheckpointManager(Checkpoint(model=[emb, w, b], step=step), args.checkpoint_dir, max_to_keep=3)
    t0 = time.monotonic()
    start = manager.restore_or_initialize()
    event(args, event="start", restored_step=start, restore_seconds=round(time.monotonic() - t0, 3),
          checkpoint=manager.latest_checkpoint)
    coordinator = ClusterCoordinator(strategy)
    vocab, fields, batch, k, sleep = args.vocab, args.fields, args.batch, args.steps_per_closure, args.closure_sleep
    runs_log = args.runs_log

    def dataset_fn(ctx):
        return CTRBatches(vocab, fields, batch, seed=1000 * ctx.input_pipeline_id + os.getpid())

    iterator = iter(coordinator.create_per_worker_dataset(dataset_fn))

    def step_fn(it, index):
        from kubeps.runtime.context import get_current_worker_index

        with open(runs_log, "a") as f:  # one short line per write: atomic with O_APPEND
            f.write(f"S {index} {get_current_worker_index()} {os.getpid()} {time.time():.3f}\n")
        total = 0.0
        for _ in range(k):
            ids, y = next(it)
            e = embedding_lookup(emb, ids)                      # [B, F, D]
            s = e.sum(axis=1)                                   # [B, D]
            wv, bv = w.numpy(), b.numpy()
            p = 1.0 / (1.0 + np.exp(-(s @ wv + bv[0])))
            g = ((p - y) / len(y)).astype(np.float32)           # dloss/dlogit
            grad_e = np.repeat((g[:, None] * wv[None, :])[:, None, :], ids.shape[1], axis=1)
            opt.apply_gradients([
                (IndexedSlices(grad_e.reshape(-1, wv.shape[0]), ids.reshape(-1)), emb),
                (s.T @ g, w),
                (np.array([g.sum()], np.float32), b),
            ])
            pc = np.clip(p, 1e-7, 1 - 1e-7)
            total += float(-np.mean(y * np.log(pc) + (1 - y) * np.log(1 - pc)))
        if sleep:
            time.sleep(sleep)
        with open(runs_log, "a") as f:
            f.write(f"E {index} {get_current_worker_index()} {os.getpid()} {time.time():.3f}\n")
        return total / k

    n, every = args.closures, args.checkpoint_every
    for chunk in range(start, n, every):
        end = min(chunk + every, n)
        values = [coordinator.schedule(step_fn, args=(iterator, i)) for i in range(chunk, end)]
        coordinator.join()
        losses = [v.fetch() for v in values]
        step.assign(end)
        t1 = time.monotonic()
        path = manager.save(final=(end == n))
        event(args, event="checkpoint", step=end, path=path, save_seconds=round(time.monotonic() - t1, 3),
              train_loss=float(np.mean(losses)))
    ids, y = eval_set(args)
    result = {"log_loss": log_loss(emb.numpy(), w.numpy(), b.numpy(), ids, y), "closures": n,
              "restored_step": start, "steps_per_closure": k}
    with open(args.out, "w") as f:
        json.dump(result, f)
    event(args, event="done", **result)
    coordinator.shutdown()


def evaluator(args) -> None:
    from kubeps.runtime.evaluator import SidecarEvaluator

    ids, y = eval_set(args)

    def eval_fn(values, batches):
        losses = [log_loss(values["model/emb"], values["model/w"], values["model/b"], i, l) for i, l in batches]
        return {"log_loss": float(np.mean(losses))}

    SidecarEvaluator(eval_fn, [(ids, y)], args.checkpoint_dir, metrics_path=args.metrics, poll_interval=0.2,
                     timeout=300).start()


def main() -> None:
    args = parse()
    task = json.loads(os.environ["TF_CONFIG"])["task"]["type"]
    if task in ("ps", "worker"):
        from kubeps.runtime.server import main as serve

        sys.exit(serve())
    if task == "evaluator":
        evaluator(args)
        return
    from kubeps.runtime.supervisor import run_coordinator

    run_coordinator(lambda: chief(args))


if __name__ == "__main__":
    main()
