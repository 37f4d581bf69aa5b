"""kp.summary writes TensorBoard event files with tensorboardX; TensorBoard's reader reads them back."""

from __future__ import annotations

import math
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

import kubeps.runtime as kp
from kubeps.runtime.contract import LOGDIR_ENV
from kubeps.runtime.errors import RuntimeConfigError

pytest.importorskip("tensorboardX")


def test_scalars_round_trip_through_tensorboards_reader(tmp_path, read_scalars):
    with kp.summary.create_file_writer(tmp_path / "train") as writer:
        writer.scalar("loss", 0.5, step=10)
        writer.scalar("loss", np.float32(0.25), step=20)
        writer.scalars({"auc": np.array([0.75]), "global_step/sec": 3}, step=20)
    scalars = read_scalars(tmp_path / "train")
    assert scalars["loss"] == [(10, 0.5), (20, 0.25)]
    assert scalars["auc"] == [(20, 0.75)] and scalars["global_step/sec"] == [(20, 3.0)]


def test_the_default_writer_as_in_tf_summary(tmp_path, read_scalars):
    writer = kp.summary.create_file_writer(str(tmp_path))
    assert kp.summary.scalar("loss", 1.0, step=0) is False  # no default writer: nothing written, as in TF
    with writer.as_default():
        assert kp.summary.scalar("loss", 1.0, step=1) is True
    assert kp.summary.scalar("loss", 2.0, step=2) is False
    writer.close()
    writer.close()  # twice: a no-op
    assert read_scalars(tmp_path) == {"loss": [(1, 1.0)]}
    with pytest.raises(RuntimeError, match="is closed"):
        writer.scalar("loss", 1.0, step=3)


def test_log_dir_from_the_argument_else_the_settings(tmp_path, monkeypatch):
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "unread"))  # read where the task starts, never here
    assert kp.summary.resolve_logdir(None, "train") is None
    with pytest.raises(RuntimeConfigError, match=r"'logdir' has invalid value None: .*KUBEPS_LOGDIR of the task's "
                                                 r"settings .*; neither is set"):
        kp.summary.create_file_writer()
    monkeypatch.setenv(LOGDIR_ENV, str(tmp_path / "job"))
    settings = kp.TFConfigClusterResolver().settings
    assert kp.summary.resolve_logdir(None, "eval", settings) == str(tmp_path / "job" / "eval")
    assert kp.summary.resolve_logdir(str(tmp_path / "arg"), "train") == str(tmp_path / "arg" / "train")
    assert kp.summary.resolve_logdir(f"file://{tmp_path}/u") == f"{tmp_path}/u"
    assert kp.summary.resolve_logdir("s3://bucket/job/", "train") == "s3://bucket/job/train"
    assert kp.summary.resolve_logdir("gs://bucket/job", "eval") == "gs://bucket/job/eval"
    kp.summary.create_file_writer(settings=settings).close()
    assert (tmp_path / "job").is_dir() and not (tmp_path / "unread").exists()


@pytest.mark.parametrize("logdir", ["memory://x", "", 7])
def test_log_dirs_that_cannot_be_written_are_refused_naming_what_can(logdir):
    with pytest.raises(RuntimeConfigError, match=r"'logdir' has invalid value .*a local directory, a file:// URL, "
                                                 r"or an s3:// or gs:// URL"):
        kp.summary.create_file_writer(logdir)


def test_bad_values_name_the_tag_and_what_is_allowed(tmp_path, read_scalars):
    with kp.summary.create_file_writer(tmp_path) as writer:
        with pytest.raises(RuntimeConfigError, match=r"'summary scalar 'loss'' has invalid value 'x': a real number"):
            writer.scalar("loss", "x", step=1)
        with pytest.raises(RuntimeConfigError, match=r"'summary scalar 'ok'' has invalid value True"):
            writer.scalar("ok", True, step=1)
        with pytest.raises(RuntimeConfigError, match=r"'step' has invalid value -1: an int >= 0"):
            writer.scalar("loss", 1.0, step=-1)
        with pytest.raises(RuntimeConfigError, match=r"'name' has invalid value '': a non-empty string"):
            writer.scalar("", 1.0, step=1)
        writer.scalar("loss", float("nan"), step=np.int64(4))  # a diverged loss is written, and shown, as NaN
    [(step, value)] = read_scalars(tmp_path)["loss"]
    assert step == 4 and math.isnan(value)
    with pytest.raises(RuntimeConfigError, match=r"'flush_secs' has invalid value 0"):
        kp.summary.create_file_writer(tmp_path, flush_secs=0)
    with pytest.raises(RuntimeConfigError, match=r"'max_queue' has invalid value 0"):
        kp.summary.create_file_writer(tmp_path, max_queue=0)


def test_purge_step_hides_what_a_crashed_run_wrote_after_the_checkpoint(tmp_path, read_scalars):
    """A chief restored from the checkpoint at step 20 writes steps 30, 40 again: TensorBoard shows them once."""
    with kp.summary.create_file_writer(tmp_path) as first:
        for step in (10, 20, 30, 40):
            first.scalar("loss", 1.0, step)
    time.sleep(1.1)  # event file names carry the second they were created in; the resumed one sorts after
    with kp.summary.create_file_writer(tmp_path, purge_step=21) as resumed:
        for step in (30, 40):
            resumed.scalar("loss", 2.0, step)
    assert read_scalars(tmp_path)["loss"] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]


def test_import_kubeps_runtime_does_not_load_the_writer():
    code = ("import sys, kubeps.runtime as kp; kp.TrainMetricsLogger; kp.summary.resolve_logdir('x'); "
            "print('tensorboardX' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"]


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_train_metrics_logger_writes_loss_and_rates_between_calls(tmp_path, read_scalars):
    clock = _Clock()
    with kp.summary.create_file_writer(tmp_path) as writer:
        logger = kp.TrainMetricsLogger(writer, batch_size=512, start_step=100, clock=clock)
        clock.now += 2.0
        assert logger.log(120, loss=0.5) == {"loss": 0.5, "global_step/sec": 10.0, "examples/sec": 5120.0}
        clock.now += 4.0
        assert logger.log(140, loss=np.float64(0.25), auc=0.8) == {
            "loss": 0.25, "auc": 0.8, "global_step/sec": 5.0, "examples/sec": 2560.0}
        assert logger.log(140, loss=0.2) == {"loss": 0.2}  # same step: no rate
        with pytest.raises(RuntimeConfigError, match=r"'step' has invalid value 130: an int >= 140"):
            logger.log(130, loss=0.1)
        with pytest.raises(RuntimeConfigError, match=r"'summary scalar 'loss'' has invalid value \[1, 2\]"):
            logger.log(150, loss=[1, 2])
    scalars = read_scalars(tmp_path)
    assert scalars["loss"] == [(120, 0.5), (140, 0.25), (140, pytest.approx(0.2))]
    assert scalars["global_step/sec"] == [(120, 10.0), (140, 5.0)]
    assert scalars["examples/sec"] == [(120, 5120.0), (140, 2560.0)]


def test_train_metrics_logger_without_a_batch_size_and_bad_arguments():
    written = []

    class Recorder:
        def scalar(self, name, value, step):
            written.append((name, value, step))

    clock = _Clock()
    logger = kp.TrainMetricsLogger(Recorder(), clock=clock)
    clock.now += 0.5
    logger.log(10, loss=1.0)
    assert written == [("loss", 1.0, 10), ("global_step/sec", 20.0, 10)]
    with pytest.raises(RuntimeConfigError, match=r"'batch_size' has invalid value 0: None or an int >= 1"):
        kp.TrainMetricsLogger(Recorder(), batch_size=0)
    with pytest.raises(RuntimeConfigError, match=r"'start_step' has invalid value -5"):
        kp.TrainMetricsLogger(Recorder(), start_step=-5)
    with pytest.raises(RuntimeConfigError, match=r"'writer' has invalid value .*scalar\(name, value, step\)"):
        kp.TrainMetricsLogger(object())


def test_the_writer_is_thread_safe(tmp_path, read_scalars):
    with kp.summary.create_file_writer(tmp_path, max_queue=3) as writer:
        def write(tag):
            for step in range(200):
                writer.scalar(tag, step * 0.5, step)
        threads = [threading.Thread(target=write, args=(f"t{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    scalars = read_scalars(tmp_path)
    assert sorted(scalars) == ["t0", "t1", "t2", "t3"]
    assert all(s == [(step, step * 0.5) for step in range(200)] for s in scalars.values())
