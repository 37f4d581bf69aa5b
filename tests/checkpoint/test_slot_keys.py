"""Optimizer slots are keyed by what they are (optimizer class + slot name, as TensorFlow keys them), so
a learning-rate change on resume keeps them; another optimizer class, or a slot of another shape, says so; old
checkpoints (slots keyed by the optimizer's whole config) still restore."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kubeps.runtime.checkpoint import Checkpoint, CheckpointManager, CheckpointMismatchError, CheckpointReader
from kubeps.runtime.ops.optimizers import Adagrad, Ftrl
from kubeps.runtime.ps.state import MAX_OPTIMIZERS, ParameterServerState
from kubeps.runtime.rpc.protocol import slot_key
from kubeps.runtime.variables.variable import Variable
from kubeps.runtime.settings import TaskSettings

pytestmark = pytest.mark.timeout(120)

G = np.full(4, 2.0, np.float32)  # each Adagrad update adds g^2 = 4 to the accumulator (initial 0.1)


def test_ps_slots_survive_a_learning_rate_change():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros(4, np.float32))
    state.apply_dense("v", Adagrad(learning_rate=0.1).get_config(), G)
    state.apply_dense("v", Adagrad(learning_rate=0.05).get_config(), G)
    _, slots, updates = state.snapshot("v")
    assert list(slots) == ["Adagrad"] and updates == 2
    np.testing.assert_allclose(slots["Adagrad"]["accumulator"], 0.1 + 4 + 4)


def test_ps_keeps_its_optimizers_and_slot_sets_bounded():
    state = ParameterServerState(settings=TaskSettings())
    state.create("v", np.zeros(4, np.float32))
    for step in range(3 * MAX_OPTIMIZERS):  # e.g. a learning rate computed on the worker, new every step
        state.apply_dense("v", Adagrad(learning_rate=0.1 / (step + 1)).get_config(), G)
    assert len(state._optimizers) <= MAX_OPTIMIZERS
    assert list(state.snapshot("v")[1]) == ["Adagrad"]


def test_another_optimizer_class_gets_its_own_slots_and_a_warning(caplog):
    state = ParameterServerState(settings=TaskSettings())
    state.create("emb", np.zeros(4, np.float32))
    state.load("emb", np.zeros(4, np.float32), {"Adagrad": {"accumulator": np.full(4, 9.0, np.float32)}}, 7)
    with caplog.at_level(logging.WARNING, logger="kubeps.runtime.variables.slots"):
        state.apply_dense("emb", Ftrl(learning_rate=0.1).get_config(), G)
    assert "variable 'emb' has optimizer slots for Adagrad but is now updated with Ftrl" in caplog.text
    _, slots, _ = state.snapshot("emb")
    assert set(slots) == {"Adagrad", "Ftrl"} and set(slots["Ftrl"]) == {"accumulator", "linear"}
    np.testing.assert_array_equal(slots["Adagrad"]["accumulator"], 9.0)  # untouched, still saved


def test_a_slot_the_group_lacks_starts_from_its_initial_value():
    from kubeps.runtime.ops.optimizers import Adam

    state = ParameterServerState(settings=TaskSettings())
    state.create("w", np.zeros(4, np.float32))
    state.apply_dense("w", Adam(learning_rate=0.1).get_config(), G)
    state.apply_dense("w", Adam(learning_rate=0.1, amsgrad=True).get_config(), G)  # needs "vhat" too
    assert set(state.snapshot("w")[1]["Adam"]) == {"m", "v", "vhat"}
    state.apply_dense("w", Adam(learning_rate=0.1).get_config(), G)  # and back: "vhat" is kept, not passed


def test_slot_key_names_a_bad_config():
    assert slot_key(Adagrad(0.1).get_config()) == "Adagrad"
    with pytest.raises(ValueError, match="'class_name' has invalid value None"):
        slot_key({"config": {}})


def _local_model(lr: float):
    w = Variable(np.zeros(4, np.float32), name="w")
    return w, Adagrad(learning_rate=lr)


def test_resume_with_another_learning_rate_keeps_the_accumulator(tmp_path):
    w, opt = _local_model(0.1)
    opt.apply_gradients([(G, w)])
    CheckpointManager(Checkpoint(model=[w]), str(tmp_path)).save()

    w2, opt2 = _local_model(0.05)  # the resumed run changed the learning rate
    CheckpointManager(Checkpoint(model=[w2]), str(tmp_path)).restore()
    opt2.apply_gradients([(G, w2)])
    path = CheckpointManager(Checkpoint(model=[w2]), str(tmp_path)).save()
    manifest = json.loads((Path(path) / "manifest.json").read_text())
    assert list(manifest["variables"]["model/w"]["slots"]) == ["Adagrad"]  # one slot set, not two
    np.testing.assert_allclose(CheckpointReader(path).get("model/w", slot="accumulator"), 0.1 + 4 + 4)


def _rewrite_manifest(path: str, edit) -> None:
    manifest_file = Path(path) / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    edit(manifest)
    manifest_file.write_text(json.dumps(manifest))


def test_old_checkpoints_keyed_by_the_whole_config_still_restore(tmp_path, caplog):
    w, opt = _local_model(0.1)
    opt.apply_gradients([(G, w)])
    path = CheckpointManager(Checkpoint(model=[w]), str(tmp_path)).save()
    old_key = json.dumps(Adagrad(learning_rate=0.1).get_config(), sort_keys=True, separators=(",", ":"))
    other_key = json.dumps(Adagrad(learning_rate=0.05).get_config(), sort_keys=True, separators=(",", ":"))

    def to_old_keys(manifest):  # as kubeps wrote it before: two sets after a resume with another rate
        slots = manifest["variables"]["model/w"]["slots"]
        group = slots.pop("Adagrad")
        slots[old_key] = group
        slots[other_key] = group

    _rewrite_manifest(path, to_old_keys)
    w2, opt2 = _local_model(0.05)
    with caplog.at_level(logging.WARNING, logger="kubeps.runtime.checkpoint.format"):
        CheckpointManager(Checkpoint(model=[w2]), str(tmp_path)).restore()
    assert "two Adagrad slot sets" in caplog.text
    opt2.apply_gradients([(G, w2)])
    np.testing.assert_allclose(w2.local_state()[1]["Adagrad"]["accumulator"], 0.1 + 4 + 4)


def test_a_slot_of_another_shape_is_a_mismatch(tmp_path):
    w = Variable(np.zeros((4, 2), np.float32), name="w")
    Adagrad(0.1).apply_gradients([(np.ones((4, 2), np.float32), w)])
    path = CheckpointManager(Checkpoint(model=[w]), str(tmp_path)).save()

    def reshape_slot(manifest):
        manifest["variables"]["model/w"]["slots"]["Adagrad"]["accumulator"]["shape"] = [4, 3]

    _rewrite_manifest(path, reshape_slot)
    w2 = Variable(np.zeros((4, 2), np.float32), name="w")
    with pytest.raises(CheckpointMismatchError, match=r"variable 'model/w': Adagrad slot 'accumulator' in checkpoint "
                                                      r".* has shape \[4, 3\]; expected the variable's shape \[4, 2\]"):
        CheckpointManager(Checkpoint(model=[w2]), str(tmp_path)).restore()
