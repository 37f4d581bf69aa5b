"""The CTR example as a Keras 3 model trained with ``keras_fit.fit`` against the hand-written numpy example, in one
run: examples/s and eval log-loss of both, and the ratio Keras/numpy (numpy is the baseline, measured in the same
run).

    .venv/bin/python bench/ctr_keras.py [--rounds 3] [--json OUT] [--smoke] [-- extra flags for both examples]

Each round runs ``kubeps local --ps 2 --workers 2`` on ``examples/ctr/train.py`` and ``examples/keras/train.py``
(default flags: 2400 steps of 512, 20 steps per scheduled function, Adagrad 0.1, the same synthetic data),
alternating which goes first, and reads the ``RESULT`` line each prints. Both time their training loop (the numpy
example from its first ``schedule`` to its last ``join``; ``fit`` likewise, so the Keras figure includes the
workers' one-off XLA compilation in its first epoch); the Keras example's epochs 2 and later, after compilation,
are reported as its steady state. Both log-losses come from the numpy example's ``evaluate``. ``--smoke`` runs
each example with 1 ps and 1 worker for a few steps on a small data set (``SMOKE``, the examples' own flags): a
check that the benchmark runs, its figures meaningless.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = {"numpy": ROOT / "examples" / "ctr" / "train.py", "keras": ROOT / "examples" / "keras" / "train.py"}
_SMALL = ["--train-examples", "8192", "--eval-examples", "2048", "--steps-per-execution", "5"]
#: ``--smoke``: each example's flags for a run of a few steps (two Keras epochs: the steady state is epoch 2's)
SMOKE = {"numpy": [*_SMALL, "--steps", "40"], "keras": [*_SMALL, "--epochs", "2", "--steps-per-epoch", "20"]}


def run(name: str, extra: list[str], tasks: int = 2) -> dict:
    cmd = [sys.executable, "-m", "kubeps.runtime.cli", "local", "--ps", str(tasks), "--workers", str(tasks),
           str(EXAMPLES[name]), "--", *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [line for line in done.stdout.splitlines() if line.startswith("[chief-0] RESULT ")]
    if done.returncode or not lines:
        raise SystemExit(f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return json.loads(lines[-1].split(" RESULT ", 1)[1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default=None, help="write every round's results here")
    p.add_argument("--smoke", action="store_true", help="a few steps of each example on a small data set")
    p.add_argument("extra", nargs="*", help="flags for both examples (after --)")
    args = p.parse_args(argv)
    rounds: list[dict[str, dict]] = []
    for r in range(args.rounds):
        order = ["numpy", "keras"] if r % 2 == 0 else ["keras", "numpy"]
        results = {name: run(name, SMOKE[name] + args.extra, tasks=1) if args.smoke else run(name, args.extra)
                   for name in order}
        steady = results["keras"]["epoch_examples_per_s"][1:]
        results["keras"]["steady_examples_per_s"] = statistics.median(steady) if steady else float("nan")
        rounds.append(results)
        print(f"round {r + 1}: numpy {results['numpy']['examples_per_s']:.0f} examples/s, log-loss "
              f"{results['numpy']['logloss']:.5f}; keras {results['keras']['examples_per_s']:.0f} examples/s "
              f"(steady {results['keras']['steady_examples_per_s']:.0f}), log-loss {results['keras']['logloss']:.5f}",
              flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    numpy_eps, keras_eps = median("numpy", "examples_per_s"), median("keras", "examples_per_s")
    keras_steady = median("keras", "steady_examples_per_s")
    print(f"\n| path | examples/s (median of {args.rounds}) | ratio to numpy | eval log-loss |")
    print("| --- | --- | --- | --- |")
    print(f"| numpy (examples/ctr) | {numpy_eps:.0f} | 1 | {median('numpy', 'logloss'):.5f} |")
    print(f"| Keras fit (examples/keras) | {keras_eps:.0f} | {keras_eps / numpy_eps:.2f} | "
          f"{median('keras', 'logloss'):.5f} |")
    print(f"| Keras fit, epochs 2-5 (compiled) | {keras_steady:.0f} | {keras_steady / numpy_eps:.2f} | |")
    print(f"log-loss Keras/numpy - 1: {100 * (median('keras', 'logloss') / median('numpy', 'logloss') - 1):+.3f} %")
    if args.json:
        Path(args.json).write_text(json.dumps(rounds, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
