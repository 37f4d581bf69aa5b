"""Keras optimizers and learning-rate schedules mapped to kubeps's (``kubeps_optimizer``, ``kubeps_schedule``)
against Keras itself: the same gradients applied to the same weights by Keras's optimizer and by the kubeps
optimizer a parameter server runs, step by step, dense and row-sparse, hyper-parameters and weight decay included;
schedules evaluated at the same steps; the refusals name the optimizer or schedule and the reason."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")  # as kubeps sets it: keras picks its backend on import
pytest.importorskip("jax")
pytest.importorskip("keras")

from kubeps.runtime.errors import RuntimeConfigError  # noqa: E402
from kubeps.runtime.models import keras_fit  # noqa: E402
from kubeps.runtime.models.keras_layers import keras  # noqa: E402
from kubeps.runtime.ops import optimizers as kopt  # noqa: E402

S = keras.optimizers.schedules

#: Keras optimizers, each with hyper-parameters away from their defaults; the kubeps class they map to
OPTIMIZERS = [
    (lambda: keras.optimizers.RMSprop(0.01), "RMSprop"),
    (lambda: keras.optimizers.RMSprop(0.02, rho=0.8, momentum=0.5, epsilon=1e-3, centered=True), "RMSprop"),
    (lambda: keras.optimizers.RMSprop(0.01, rho=0.7, momentum=0.3, weight_decay=0.05), "RMSprop"),
    (lambda: keras.optimizers.Adadelta(0.5), "Adadelta"),
    (lambda: keras.optimizers.Adadelta(1.0, rho=0.8, epsilon=1e-4), "Adadelta"),
    (lambda: keras.optimizers.Nadam(0.01), "Nadam"),
    (lambda: keras.optimizers.Nadam(0.02, beta_1=0.7, beta_2=0.95, epsilon=1e-4), "Nadam"),
    (lambda: keras.optimizers.AdamW(0.01), "AdamW"),
    (lambda: keras.optimizers.AdamW(0.02, weight_decay=0.1, beta_1=0.8, amsgrad=True), "AdamW"),
    (lambda: keras.optimizers.Adam(0.01, weight_decay=0.05), "Adam"),
    (lambda: keras.optimizers.Adamax(0.01, beta_1=0.8, beta_2=0.9), "Adamax"),
    (lambda: keras.optimizers.Lion(0.01, beta_1=0.8, beta_2=0.95), "Lion"),
    (lambda: keras.optimizers.SGD(0.1, momentum=0.5, weight_decay=0.1), "Momentum"),
    (lambda: keras.optimizers.Nadam(S.ExponentialDecay(0.05, decay_steps=2, decay_rate=0.5)), "Nadam"),
    (lambda: keras.optimizers.RMSprop(S.PiecewiseConstantDecay([1, 3], [0.05, 0.02, 0.01]), centered=True),
     "RMSprop"),
    (lambda: keras.optimizers.AdamW(S.CosineDecay(0.0, 4, warmup_target=0.05, warmup_steps=2), weight_decay=0.1),
     "AdamW"),
]
IDS = [f"{i}-{name}" for i, (_, name) in enumerate(OPTIMIZERS)]
STEPS = 6


def _keras_slots(optimizer, variable) -> dict[str, np.ndarray]:
    """Keras's slot variables of ``variable`` (named ``<variable>_<slot>``), by slot name."""
    prefix = variable.name + "_"
    return {v.name[len(prefix):]: np.asarray(v) for v in optimizer.variables if v.name.startswith(prefix)}


@pytest.mark.parametrize("make, name", OPTIMIZERS, ids=IDS)
def test_a_keras_optimizer_and_its_kubeps_optimizer_apply_the_same_dense_updates(make, name):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3)).astype(np.float32)
    grads = [rng.normal(size=(4, 3)).astype(np.float32) for _ in range(STEPS)]
    theirs = make()
    ours = keras_fit.kubeps_optimizer(make())
    assert type(ours).__name__ == name
    variable = keras.Variable(w0.copy(), name="w")
    var = w0.copy()
    slots = ours.init_slots(var)
    for step, g in enumerate(grads, start=1):
        theirs.apply_gradients([(g, variable)])
        ours.apply_dense(var, g, slots, step)
        np.testing.assert_allclose(var, np.asarray(variable), rtol=2e-5, atol=2e-6, err_msg=f"step {step}")
    keras_slots = _keras_slots(theirs, variable)
    if name not in ("Adam", "AdamW", "Momentum"):  # Keras's Adam and SGD name their slots otherwise
        assert sorted(keras_slots) == sorted(slots)
        for slot, value in slots.items():
            np.testing.assert_allclose(value, keras_slots[slot], rtol=2e-5, atol=2e-6, err_msg=slot)


@pytest.mark.parametrize("make, name", OPTIMIZERS, ids=IDS)
def test_row_sparse_updates_equal_keras_on_the_summed_rows_and_leave_untouched_rows_alone(make, name):
    """Every update touches rows 0-3 of 5 (in shuffled order, with duplicate ids): Keras's dense update of the
    summed gradient on those rows; row 4 and its slots never change (lazy sparse updates, as TF's SparseApply*)."""
    rng = np.random.default_rng(1)
    table = rng.normal(size=(5, 2)).astype(np.float32)
    theirs = make()
    ours = keras_fit.kubeps_optimizer(make())
    touched = keras.Variable(table[:4].copy(), name="rows")
    var = table.copy()
    slots = ours.init_slots(var)
    fresh = {k: v[4].copy() for k, v in slots.items()}
    for step in range(1, STEPS + 1):
        ids = rng.permutation(np.array([0, 1, 2, 3, 0, 2, 2]))
        values = rng.normal(size=(ids.size, 2)).astype(np.float32)
        summed = np.zeros((4, 2), np.float32)
        np.add.at(summed, ids, values)
        theirs.apply_gradients([(summed, touched)])
        ours.apply_sparse(var, ids.astype(np.int32), values, slots, step)
        np.testing.assert_allclose(var[:4], np.asarray(touched), rtol=2e-5, atol=2e-6, err_msg=f"step {step}")
    np.testing.assert_array_equal(var[4], table[4])
    for k, v in slots.items():
        np.testing.assert_array_equal(v[4], fresh[k])


SCHEDULES = [
    (S.ExponentialDecay(0.1, decay_steps=7, decay_rate=0.5), "ExponentialDecay"),
    (S.ExponentialDecay(0.1, decay_steps=7, decay_rate=0.5, staircase=True), "ExponentialDecay"),
    (S.InverseTimeDecay(0.2, decay_steps=5, decay_rate=0.3), "InverseTimeDecay"),
    (S.InverseTimeDecay(0.2, decay_steps=5, decay_rate=0.3, staircase=True), "InverseTimeDecay"),
    (S.PiecewiseConstantDecay([10, 20, 35], [0.1, 0.05, 0.02, 0.001]), "PiecewiseConstantDecay"),
    (S.PiecewiseConstantDecay([10.5, 20.0], [0.1, 0.05, 0.02]), "PiecewiseConstantDecay"),
    (S.PolynomialDecay(0.1, decay_steps=30, end_learning_rate=0.01, power=2.0), "PolynomialDecay"),
    (S.PolynomialDecay(0.1, decay_steps=30, end_learning_rate=0.01, power=0.5, cycle=True), "PolynomialDecay"),
    (S.CosineDecay(0.1, decay_steps=40, alpha=0.1), "CosineDecay"),
    (S.CosineDecay(0.0, decay_steps=40, alpha=0.05, warmup_target=0.2, warmup_steps=10), "CosineDecay"),
    (S.CosineDecayRestarts(0.1, first_decay_steps=10, alpha=0.05), "CosineDecayRestarts"),
    (S.CosineDecayRestarts(0.1, first_decay_steps=10, t_mul=1.0, m_mul=0.8), "CosineDecayRestarts"),
]


@pytest.mark.parametrize("schedule, name", SCHEDULES, ids=[f"{i}-{n}" for i, (_, n) in enumerate(SCHEDULES)])
def test_a_keras_schedule_maps_to_a_kubeps_schedule_with_the_same_rate_at_every_step(schedule, name):
    ours = keras_fit.kubeps_schedule(schedule)
    assert type(ours).__name__ == name
    assert kopt.schedule_from_config(ours.get_config()) == ours  # it crosses to the parameter servers as JSON
    # float32 (Keras) against float64: within 1e-7 absolute where 1 + cos(x) cancels near the end of a period
    steps = list(range(0, 100)) + [150, 1000, 10_000]
    for k in steps:
        np.testing.assert_allclose(ours(k), float(schedule(k)), rtol=2e-6, atol=1e-7, err_msg=f"step {k}")


def test_the_update_at_step_k_uses_the_keras_rate_at_iteration_k_minus_one():
    """Keras evaluates the schedule at ``optimizer.iterations`` (0 for the first update); a ps at the variable's
    update count minus one: SGD makes the rate visible as the step a unit gradient takes."""
    schedule = S.PiecewiseConstantDecay([0, 2], [0.5, 0.25, 0.125])
    ours = keras_fit.kubeps_optimizer(keras.optimizers.SGD(schedule))
    var = np.zeros(1, np.float32)
    taken = []
    for step in range(1, 6):
        before = var.copy()
        ours.apply_dense(var, np.ones(1, np.float32), {}, step)
        taken.append(float((before - var)[0]))
    assert taken == [0.5, 0.25, 0.25, 0.125, 0.125] == [float(schedule(k)) for k in range(5)]


def test_schedules_and_optimizers_kubeps_cannot_run_are_refused_with_the_reason():
    class Halving(S.LearningRateSchedule):
        def __call__(self, step):
            return 0.1 * 0.5 ** (step // 10)

    with pytest.raises(RuntimeConfigError, match=r"learning_rate.*Halving.*cannot run a schedule's Python code; "
                                                  r"allowed: Keras's ExponentialDecay"):
        keras_fit.kubeps_optimizer(keras.optimizers.SGD(Halving()))

    class Subclassed(S.ExponentialDecay):
        pass

    with pytest.raises(RuntimeConfigError, match="Subclassed"):
        keras_fit.kubeps_schedule(Subclassed(0.1, 10, 0.5))
    with pytest.raises(RuntimeConfigError, match=r"ExponentialDecay decay_steps.*2\.5.*whole number of steps"):
        keras_fit.kubeps_schedule(S.ExponentialDecay(0.1, 2.5, 0.5))
    with pytest.raises(RuntimeConfigError, match=r"CosineDecayRestarts.*'CosineDecayRestarts.t_mul' has invalid value 0\.5: a finite number >= 1"):
        keras_fit.kubeps_schedule(S.CosineDecayRestarts(0.1, 10, t_mul=0.5))
    for make, why in [(lambda: keras.optimizers.Adafactor(0.1), "rows and columns"),
                      (lambda: keras.optimizers.Muon(0.1), "orthogonalizes")]:
        with pytest.raises(RuntimeConfigError, match=f"cannot run it on the parameter servers.*{why}"):
            keras_fit.kubeps_optimizer(make())


@pytest.mark.parametrize("optimizer", [
    kopt.RMSprop(0.01, rho=0.8, momentum=0.2, epsilon=1e-5, centered=True),
    kopt.Adadelta(kopt.InverseTimeDecay(1.0, 10, 0.5), rho=0.9),
    kopt.Nadam(0.01, beta_1=0.8, weight_decay=0.01),
    kopt.AdamW(kopt.CosineDecayRestarts(0.01, 5), weight_decay=0.1, amsgrad=True),
    kopt.Adamax(0.01),
    kopt.Lion(kopt.PolynomialDecay(0.01, 10, cycle=True)),
], ids=repr)
def test_the_kubeps_optimizers_cross_to_a_parameter_server_as_json(optimizer):
    import json

    config = json.loads(json.dumps(optimizer.get_config()))
    assert kopt.optimizer_from_config(config) == optimizer


@pytest.mark.parametrize("make, match", [
    (lambda: kopt.RMSprop(0.1, rho=1.0), r"RMSprop.*rho"),
    (lambda: kopt.RMSprop(0.1, epsilon=0), r"RMSprop.*epsilon"),
    (lambda: kopt.Adadelta(0.1, epsilon=0), r"Adadelta.*epsilon"),
    (lambda: kopt.Nadam(0.1, beta_2=1.0), r"Nadam.*beta_2"),
    (lambda: kopt.AdamW(0.1, weight_decay=-1.0), r"AdamW.*weight_decay"),
    (lambda: kopt.AdamW(0.1, weight_decay=None), r"'AdamW.weight_decay' has invalid value None: .*use Adam"),
    (lambda: kopt.Lion(0.1, beta_1=1.5), r"Lion.*beta_1"),
    (lambda: kopt.CosineDecayRestarts(0.1, 0), r"CosineDecayRestarts.*first_decay_steps"),
])
def test_bad_hyper_parameters_are_refused_by_name(make, match):
    with pytest.raises(ValueError, match=match):
        make()
