"""Optimizers against textbook formulas written out step by step, element by element, in plain Python."""

from __future__ import annotations

import json
import math
import sys
import types

import numpy as np
import pytest

from kubeps.runtime.ops import optimizers as opt
from kubeps.runtime.ops.optimizers import SGD, Adagrad, Adam, Ftrl, Momentum

# ------------------------------------------------------------------------------------------------------------
# Reference implementations: one scalar coordinate at a time, written from the papers / TF docs.
# state is a dict of floats for that coordinate; t is the update number (1-based); lr already scheduled.
# ------------------------------------------------------------------------------------------------------------


def ref_sgd(cfg, w, g, s, lr, t):
    return w - lr * g


def ref_momentum(cfg, w, g, s, lr, t):
    mu = cfg["momentum"]
    s["momentum"] = mu * s["momentum"] + g
    if cfg["nesterov"]:
        return w - (lr * g + lr * mu * s["momentum"])
    return w - lr * s["momentum"]


def ref_adagrad(cfg, w, g, s, lr, t):
    s["accumulator"] = s["accumulator"] + g * g
    return w - lr * g / (math.sqrt(s["accumulator"]) + cfg["epsilon"])


def ref_adam(cfg, w, g, s, lr, t):
    b1, b2, eps = cfg["beta_1"], cfg["beta_2"], cfg["epsilon"]
    s["m"] = b1 * s["m"] + (1 - b1) * g
    s["v"] = b2 * s["v"] + (1 - b2) * g * g
    # Kingma & Ba, section 2, the "more efficient" ordering with epsilon-hat.
    alpha_t = lr * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
    v = s["v"]
    if cfg["amsgrad"]:
        s["vhat"] = max(s["vhat"], s["v"])
        v = s["vhat"]
    return w - alpha_t * s["m"] / (math.sqrt(v) + eps)


def ref_ftrl(cfg, w, g, s, lr, t):
    # McMahan et al. 2013, Algorithm 1 (n = accumulator, z = linear), generalised to n ** -power and with TF's
    # 2 * l2 and l2_shrinkage.
    power = -cfg["learning_rate_power"]
    l1, l2 = cfg["l1_regularization_strength"], cfg["l2_regularization_strength"]
    shrink, beta = cfg["l2_shrinkage_regularization_strength"], cfg["beta"]
    n, z = s["accumulator"], s["linear"]
    sigma = ((n + g * g) ** power - n ** power) / lr
    z = z + (g + 2 * shrink * w) - sigma * w
    n = n + g * g
    s["accumulator"], s["linear"] = n, z
    if abs(z) <= l1:
        return 0.0
    sign = 1.0 if z > 0 else -1.0
    return -(z - sign * l1) / ((beta + n ** power) / lr + 2 * l2)


REFS = {"SGD": ref_sgd, "Momentum": ref_momentum, "Adagrad": ref_adagrad, "Adam": ref_adam, "Ftrl": ref_ftrl}
INITIAL_SLOTS = {
    "SGD": lambda c: {},
    "Momentum": lambda c: {"momentum": 0.0},
    "Adagrad": lambda c: {"accumulator": c["initial_accumulator_value"]},
    "Adam": lambda c: {"m": 0.0, "v": 0.0, **({"vhat": 0.0} if c["amsgrad"] else {})},
    "Ftrl": lambda c: {"accumulator": c["initial_accumulator_value"], "linear": 0.0},
}

CASES = [
    SGD(0.1),
    SGD(opt.ExponentialDecay(0.2, decay_steps=2, decay_rate=0.5)),
    Momentum(0.05, momentum=0.9),
    Momentum(0.05, momentum=0.8, nesterov=True),
    Momentum(opt.PiecewiseConstantDecay([1, 3], [0.1, 0.05, 0.01]), momentum=0.5),
    Adagrad(0.1),
    Adagrad(0.3, initial_accumulator_value=0.5, epsilon=1e-3),
    Adam(0.01),
    Adam(0.02, beta_1=0.5, beta_2=0.9, epsilon=1e-3, amsgrad=True),
    Adam(opt.CosineDecay(0.05, decay_steps=4, alpha=0.1)),
    Ftrl(0.1),
    Ftrl(0.2, learning_rate_power=-0.5, initial_accumulator_value=0.1, l1_regularization_strength=0.05,
         l2_regularization_strength=0.1),
    Ftrl(0.1, learning_rate_power=-0.3, initial_accumulator_value=0.2, l1_regularization_strength=0.01,
         l2_regularization_strength=0.02, l2_shrinkage_regularization_strength=0.03, beta=0.5),
]
IDS = [repr(c) for c in CASES]


def lr_at(o, t):
    lr = o.get_config()["config"]["learning_rate"]
    if isinstance(lr, dict):  # schedules are evaluated at the number of updates already applied
        return opt.schedule_from_config(lr)(t - 1)
    return lr


def reference_dense(o, w0, grads):
    name, cfg = o.get_config()["class_name"], o.get_config()["config"]
    w = [float(x) for x in w0.ravel()]
    states = [INITIAL_SLOTS[name](cfg) for _ in w]
    for t, g in enumerate(grads, start=1):
        lr = lr_at(o, t)
        gl = g.ravel()
        for i in range(len(w)):
            w[i] = REFS[name](cfg, w[i], float(gl[i]), states[i], lr, t)
    return np.array(w).reshape(w0.shape), states


def reference_sparse(o, w0, updates):
    """updates: list of (ids, values); duplicates summed with a dict, only touched rows change."""
    name, cfg = o.get_config()["class_name"], o.get_config()["config"]
    rows, cols = w0.shape
    w = [[float(x) for x in r] for r in w0]
    states = [[INITIAL_SLOTS[name](cfg) for _ in range(cols)] for _ in range(rows)]
    for t, (ids, vals) in enumerate(updates, start=1):
        summed: dict[int, list[float]] = {}
        for k, r in enumerate(ids):
            acc = summed.setdefault(int(r), [0.0] * cols)
            for c in range(cols):
                acc[c] += float(vals[k, c])
        lr = lr_at(o, t)
        for r, g in summed.items():
            for c in range(cols):
                w[r][c] = REFS[name](cfg, w[r][c], g[c], states[r][c], lr, t)
    return np.array(w), states


def slots_as_arrays(states, shape, names):
    flat = [s for row in states for s in (row if isinstance(row, list) else [row])]
    return {n: np.array([s[n] for s in flat]).reshape(shape) for n in names}


@pytest.mark.parametrize("o", CASES, ids=IDS)
def test_dense_matches_reference(o):
    rng = np.random.default_rng(0)
    w0 = rng.normal(size=(4, 3))
    grads = [rng.normal(size=(4, 3)) for _ in range(5)]
    var = w0.copy()
    slots = o.init_slots(var)
    for t, g in enumerate(grads, start=1):
        o.apply_dense(var, g, slots, t)
    want, states = reference_dense(o, w0, grads)
    np.testing.assert_allclose(var, want, rtol=1e-12, atol=1e-12)
    for name, arr in slots_as_arrays(states, w0.shape, o.slot_names()).items():
        np.testing.assert_allclose(slots[name], arr, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("o", CASES, ids=IDS)
def test_sparse_matches_reference_with_duplicates(o):
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(6, 2))
    updates = [
        (np.array([0, 2, 2, 5]), rng.normal(size=(4, 2))),
        (np.array([5, 5, 5]), rng.normal(size=(3, 2))),
        (np.array([1, 0, 3, 1, 0]), rng.normal(size=(5, 2))),
        (np.array([2]), rng.normal(size=(1, 2))),
    ]
    var = w0.copy()
    slots = o.init_slots(var)
    for t, (ids, vals) in enumerate(updates, start=1):
        o.apply_sparse(var, ids, vals, slots, t)
    want, states = reference_sparse(o, w0, updates)
    np.testing.assert_allclose(var, want, rtol=1e-12, atol=1e-12)
    for name, arr in slots_as_arrays(states, w0.shape, o.slot_names()).items():
        np.testing.assert_allclose(slots[name], arr, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(var[4], w0[4])  # never touched


@pytest.mark.parametrize("o", CASES, ids=IDS)
def test_float32_in_place_close_to_float64(o):
    rng = np.random.default_rng(2)
    w0 = rng.normal(size=(5, 4))
    v32, v64 = w0.astype(np.float32), w0.copy()
    s32, s64 = o.init_slots(v32), o.init_slots(v64)
    buf = v32
    for t in range(1, 4):
        g = rng.normal(size=(5, 4))
        ids = np.array([0, 3, 3])
        vals = rng.normal(size=(3, 4))
        o.apply_dense(v32, g.astype(np.float32), s32, 2 * t - 1)
        o.apply_dense(v64, g, s64, 2 * t - 1)
        o.apply_sparse(v32, ids.astype(np.int32), vals.astype(np.float32), s32, 2 * t)
        o.apply_sparse(v64, ids, vals, s64, 2 * t)
    assert v32 is buf and v32.dtype == np.float32
    assert all(s.dtype == np.float32 and s.shape == (5, 4) for s in s32.values())
    np.testing.assert_allclose(v32, v64, rtol=1e-4, atol=1e-5)


def test_sparse_equals_dense_for_sgd_and_adagrad():
    # Without momentum-like state, a sparse update equals the dense update of the scattered gradient.
    rng = np.random.default_rng(3)
    for o in (SGD(0.1), Adagrad(0.1)):
        w0 = rng.normal(size=(8, 3))
        ids = np.array([7, 1, 1, 4, 7, 7])
        vals = rng.normal(size=(6, 3))
        dense_g = np.zeros_like(w0)
        np.add.at(dense_g, ids, vals)
        a, b = w0.copy(), w0.copy()
        sa, sb = o.init_slots(a), o.init_slots(b)
        o.apply_sparse(a, ids, vals, sa, 1)
        o.apply_dense(b, dense_g, sb, 1)
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_ftrl_l1_produces_exact_zeros():
    o = Ftrl(0.1, l1_regularization_strength=10.0)
    var = np.ones((3, 2))
    slots = o.init_slots(var)
    o.apply_dense(var, np.full((3, 2), 0.5), slots, 1)
    assert np.all(var == 0.0)


def test_slot_names_and_init_values():
    v = np.zeros((2, 3), np.float32)
    assert SGD().slot_names() == ()
    assert Momentum().slot_names() == ("momentum",)
    assert Adagrad().slot_names() == ("accumulator",)
    assert Adam().slot_names() == ("m", "v")
    assert Adam(amsgrad=True).slot_names() == ("m", "v", "vhat")
    assert Ftrl().slot_names() == ("accumulator", "linear")
    assert np.all(Adagrad(initial_accumulator_value=0.25).init_slots(v)["accumulator"] == 0.25)
    s = Ftrl(initial_accumulator_value=0.3).init_slots(v)
    assert np.all(s["accumulator"] == np.float32(0.3)) and np.all(s["linear"] == 0)
    assert s["linear"].dtype == np.float32


# ------------------------------------------------------------------------------------------------------------
# Configuration
# ------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("o", CASES, ids=IDS)
def test_config_round_trips_through_json(o):
    cfg = json.loads(json.dumps(o.get_config()))
    assert cfg["class_name"] == type(o).__name__
    back = opt.optimizer_from_config(cfg)
    assert type(back) is type(o) and back.get_config() == o.get_config()
    assert back.slot_names() == o.slot_names()


def test_optimizer_from_config_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"'optimizer class_name' has invalid value 'RMSNope': one of .*'Adam'"):
        opt.optimizer_from_config({"class_name": "RMSNope", "config": {}})
    with pytest.raises(ValueError, match=r"'Adam config' has invalid value \['beta1'\]: the arguments of Adam: .*beta_1"):
        opt.optimizer_from_config({"class_name": "Adam", "config": {"beta1": 0.9}})
    with pytest.raises(ValueError, match=r"'Adam.beta_1' has invalid value 1.5: a finite number >= 0 and < 1"):
        opt.optimizer_from_config({"class_name": "Adam", "config": {"beta_1": 1.5}})
    with pytest.raises(ValueError, match=r"'SGD.learning_rate' has invalid value 'fast': a finite number > 0"):
        opt.optimizer_from_config({"class_name": "SGD", "config": {"learning_rate": "fast"}})
    with pytest.raises(ValueError, match=r"mapping"):
        opt.optimizer_from_config(["SGD"])
    with pytest.raises(ValueError, match=r"'learning-rate schedule class_name' has invalid value 'Warp'"):
        SGD({"class_name": "Warp", "config": {}})
    with pytest.raises(ValueError, match=r"'ExponentialDecay config' .*: all of the required arguments \['decay_rate'\]"):
        SGD({"class_name": "ExponentialDecay", "config": {"initial_learning_rate": 0.1, "decay_steps": 3}})


@pytest.mark.parametrize("make, match", [
    (lambda: SGD(0.0), r"'SGD.learning_rate' has invalid value 0.0: a finite number > 0"),
    (lambda: SGD(lambda step: 0.1), r"plain callables cannot be sent"),
    (lambda: Momentum(momentum=1.0), r"'Momentum.momentum' has invalid value 1.0: a finite number >= 0 and < 1"),
    (lambda: Momentum(nesterov="yes"), r"'Momentum.nesterov' has invalid value 'yes': True or False"),
    (lambda: Adagrad(initial_accumulator_value=-1), r"'Adagrad.initial_accumulator_value' has invalid value -1: a finite number >= 0"),
    (lambda: Adagrad(initial_accumulator_value=0, epsilon=0), r"'Adagrad.epsilon' has invalid value 0: > 0 when initial_accumulator_value=0 .*divide by zero"),
    (lambda: Adam(epsilon=0), r"'Adam.epsilon' has invalid value 0: a finite number > 0"),
    (lambda: Ftrl(learning_rate_power=0.5), r"'Ftrl.learning_rate_power' has invalid value 0.5: a finite number <= 0"),
    (lambda: Ftrl(l1_regularization_strength=-0.1), r"'Ftrl.l1_regularization_strength' has invalid value -0.1: a finite number >= 0"),
    (lambda: opt.ExponentialDecay(0.1, 0, 0.5), r"'ExponentialDecay.decay_steps' has invalid value 0: an integer >= 1"),
    (lambda: opt.PiecewiseConstantDecay([5, 2], [1.0, 0.5, 0.1]), r"strictly increasing"),
    (lambda: opt.PiecewiseConstantDecay([5], [1.0]), r"len\(boundaries\) \+ 1 = 2"),
])
def test_bad_arguments_are_rejected(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_update_inputs_are_rejected():
    o = Adagrad(0.1)
    v = np.zeros((4, 2))
    s = o.init_slots(v)
    with pytest.raises(ValueError, match=r"'Adagrad.step' has invalid value 0: an integer >= 1 \(the variable's update count"):
        o.apply_dense(v, np.zeros((4, 2)), s, 0)
    with pytest.raises(ValueError, match=r"grad has shape \(2, 4\); expected the variable's shape \(4, 2\)"):
        o.apply_dense(v, np.zeros((2, 4)), s, 1)
    with pytest.raises(ValueError, match=r"slots has keys \[\]; expected \['accumulator'\]"):
        o.apply_dense(v, np.zeros((4, 2)), {}, 1)
    with pytest.raises(ValueError, match=r"row id 4; allowed: 0 <= id < 4"):
        o.apply_sparse(v, np.array([1, 4]), np.zeros((2, 2)), s, 1)
    with pytest.raises(ValueError, match=r"row id -1"):
        o.apply_sparse(v, np.array([-1]), np.zeros((1, 2)), s, 1)
    with pytest.raises(ValueError, match=r"values has shape \(3, 2\); expected"):
        o.apply_sparse(v, np.array([1, 2]), np.zeros((3, 2)), s, 1)
    with pytest.raises(ValueError, match=r"indices has dtype float64"):
        o.apply_sparse(v, np.array([1.0]), np.zeros((1, 2)), s, 1)
    assert np.all(v == 0) and np.all(s["accumulator"] == 0.1)  # nothing applied by a rejected call
    o.apply_sparse(v, np.array([], np.int64), np.zeros((0, 2)), s, 1)  # empty update is a no-op
    assert np.all(v == 0)


# ------------------------------------------------------------------------------------------------------------
# Schedules
# ------------------------------------------------------------------------------------------------------------


def test_schedules_follow_tf_formulas():
    e = opt.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5)
    assert e(0) == pytest.approx(0.1) and e(10) == pytest.approx(0.05) and e(5) == pytest.approx(0.1 * 0.5 ** 0.5)
    es = opt.ExponentialDecay(0.1, decay_steps=10, decay_rate=0.5, staircase=True)
    assert es(9) == pytest.approx(0.1) and es(19) == pytest.approx(0.05)
    it = opt.InverseTimeDecay(1.0, decay_steps=2, decay_rate=0.5)
    assert it(4) == pytest.approx(1 / 2)
    pc = opt.PiecewiseConstantDecay([10, 20], [1.0, 0.5, 0.1])
    assert [pc(s) for s in (0, 10, 11, 20, 21, 1000)] == [1.0, 1.0, 0.5, 0.5, 0.1, 0.1]
    pd = opt.PolynomialDecay(1.0, decay_steps=10, end_learning_rate=0.0, power=2.0)
    assert pd(5) == pytest.approx(0.25) and pd(50) == 0.0
    c = opt.CosineDecay(1.0, decay_steps=10, alpha=0.2)
    assert c(0) == pytest.approx(1.0) and c(5) == pytest.approx(0.6) and c(10) == pytest.approx(0.2)
    assert c(99) == pytest.approx(0.2)
    w = opt.CosineDecay(0.0, decay_steps=10, warmup_target=1.0, warmup_steps=4)
    assert w(2) == pytest.approx(0.5) and w(4) == pytest.approx(1.0) and w(14) == pytest.approx(0.0)


def test_first_update_uses_schedule_at_zero():
    o = SGD(opt.PiecewiseConstantDecay([0], [1.0, 0.1]))
    assert o.lr_at(1) == 1.0 and o.lr_at(2) == 0.1
    v = np.zeros(3)
    o.apply_dense(v, np.ones(3), {}, 1)
    np.testing.assert_allclose(v, -1.0)


# ------------------------------------------------------------------------------------------------------------
# apply_gradients delegates to the transport
# ------------------------------------------------------------------------------------------------------------


def test_apply_gradients_delegates_to_the_push(monkeypatch):
    calls = []
    fake = types.ModuleType("kubeps.runtime.variables.push")
    fake.apply_gradients = lambda optimizer, gv: calls.append((optimizer, list(gv))) or "pushed"
    import kubeps.runtime.variables as pkg

    monkeypatch.setitem(sys.modules, "kubeps.runtime.variables.push", fake)
    monkeypatch.setattr(pkg, "push", fake, raising=False)
    o = Adam(0.01)
    g, v = np.ones(2), np.zeros(2)
    assert o.apply_gradients([(g, v)]) == "pushed"
    assert calls[0][0] is o and calls[0][1][0][0] is g
