"""Tests for gradtools.schedules: hand-computed values, MindSpore parity, optax use."""

import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import gradtools
from gradtools import schedules as S

RTOL = 1e-6  # float32 results against float64 references


def _jit_counting(fn):
    """``jax.jit(fn)`` and a list that grows by one each time ``fn`` is traced."""
    traces = []

    def traced(*args):
        traces.append(None)
        return fn(*args)

    return jax.jit(traced), traces


def _at(schedule, step):
    """``schedule(step)`` under jit with a traced int32 step."""
    out = jax.jit(schedule)(jnp.int32(step))
    assert out.dtype == jnp.float32 and out.shape == ()
    return float(out)


# --- values computed by hand from each formula ------------------------------------------

# (id, schedule, step, expected); the comment gives the formula evaluated.
HAND = [
    # exponential: 0.1 * 0.5 ** (step / 4), staircase: 0.1 * 0.5 ** floor(step / 4)
    ("exp-0", S.exponential_decay(0.1, 0.5, 4), 0, 0.1),
    ("exp-inside", S.exponential_decay(0.1, 0.5, 4), 2, 0.07071067811865477),  # 0.1*0.5**0.5
    ("exp-boundary", S.exponential_decay(0.1, 0.5, 4), 4, 0.05),  # 0.1*0.5**1
    ("exp-past", S.exponential_decay(0.1, 0.5, 4), 6, 0.03535533905932738),  # 0.1*0.5**1.5
    ("exp-far", S.exponential_decay(0.1, 0.5, 4), 40, 9.765625e-05),  # 0.1*0.5**10
    ("exp-stair-inside", S.exponential_decay(0.1, 0.5, 4, staircase=True), 3, 0.1),  # 0.5**0
    ("exp-stair-boundary", S.exponential_decay(0.1, 0.5, 4, staircase=True), 4, 0.05),
    ("exp-stair-past", S.exponential_decay(0.1, 0.5, 4, staircase=True), 7, 0.05),
    ("exp-stair-2", S.exponential_decay(0.1, 0.5, 4, staircase=True), 8, 0.025),  # 0.5**2
    # natural exp (MindSpore's code): 0.1 * exp(-0.1 * step),
    # staircase: 0.1 * exp(-0.1 * floor(step / 4) * 4)
    ("nat-0", S.natural_exp_decay(0.1, 0.1, 4), 0, 0.1),
    ("nat-inside", S.natural_exp_decay(0.1, 0.1, 4), 2, 0.0818730753077982),  # exp(-0.2)
    ("nat-boundary", S.natural_exp_decay(0.1, 0.1, 4), 4, 0.06703200460356394),  # exp(-0.4)
    ("nat-past", S.natural_exp_decay(0.1, 0.1, 4), 25, 0.008208499862389881),  # exp(-2.5)
    ("nat-stair-inside", S.natural_exp_decay(0.1, 0.1, 4, staircase=True), 3, 0.1),
    (
        "nat-stair-boundary",
        S.natural_exp_decay(0.1, 0.1, 4, staircase=True),
        4,
        0.06703200460356394,
    ),
    ("nat-stair-past", S.natural_exp_decay(0.1, 0.1, 4, staircase=True), 7, 0.06703200460356394),
    ("nat-stair-2", S.natural_exp_decay(0.1, 0.1, 4, staircase=True), 8, 0.044932896411722156),
    # inverse time: 0.1 / (1 + 0.5 * step / 4), staircase: floor(step / 4)
    ("inv-0", S.inverse_time_decay(0.1, 0.5, 4), 0, 0.1),
    ("inv-inside", S.inverse_time_decay(0.1, 0.5, 4), 2, 0.08),  # 0.1 / 1.25
    ("inv-boundary", S.inverse_time_decay(0.1, 0.5, 4), 4, 0.06666666666666667),  # 0.1 / 1.5
    ("inv-past", S.inverse_time_decay(0.1, 0.5, 4), 40, 0.016666666666666666),  # 0.1 / 6
    ("inv-stair-inside", S.inverse_time_decay(0.1, 0.5, 4, staircase=True), 3, 0.1),
    (
        "inv-stair-boundary",
        S.inverse_time_decay(0.1, 0.5, 4, staircase=True),
        4,
        0.06666666666666667,
    ),
    ("inv-stair-past", S.inverse_time_decay(0.1, 0.5, 4, staircase=True), 9, 0.05),  # 0.1 / 2
    # cosine: 0.01 + 0.5 * 0.09 * (1 + cos(pi * min(step, 4) / 4))
    ("cos-0", S.cosine_decay(0.01, 0.1, 4), 0, 0.1),
    ("cos-inside", S.cosine_decay(0.01, 0.1, 4), 1, 0.08681980515339463),  # cos(pi/4)
    ("cos-inside-3", S.cosine_decay(0.01, 0.1, 4), 3, 0.023180194846605363),  # cos(3pi/4)
    ("cos-boundary", S.cosine_decay(0.01, 0.1, 4), 4, 0.01),
    ("cos-past", S.cosine_decay(0.01, 0.1, 4), 9, 0.01),
    # polynomial: 0.09 * (1 - min(step, 4) / 4) ** 2 + 0.01
    ("poly-0", S.polynomial_decay(0.1, 0.01, 4, 2.0), 0, 0.1),
    ("poly-inside", S.polynomial_decay(0.1, 0.01, 4, 2.0), 1, 0.060625),  # 0.09*0.75**2+0.01
    ("poly-inside-2", S.polynomial_decay(0.1, 0.01, 4, 2.0), 2, 0.0325),  # 0.09*0.25+0.01
    ("poly-boundary", S.polynomial_decay(0.1, 0.01, 4, 2.0), 4, 0.01),
    ("poly-past", S.polynomial_decay(0.1, 0.01, 4, 2.0), 9, 0.01),
    # update_decay_steps: d = 4 * max(ceil(step / 4), 1); 0.09 * (1 - step / d) ** 2 + 0.01
    ("poly-upd-0", S.polynomial_decay(0.1, 0.01, 4, 2.0, update_decay_steps=True), 0, 0.1),
    ("poly-upd-boundary", S.polynomial_decay(0.1, 0.01, 4, 2.0, update_decay_steps=True), 4, 0.01),
    # d = 8: 0.09 * (3/8) ** 2 + 0.01
    ("poly-upd-5", S.polynomial_decay(0.1, 0.01, 4, 2.0, update_decay_steps=True), 5, 0.02265625),
    ("poly-upd-8", S.polynomial_decay(0.1, 0.01, 4, 2.0, update_decay_steps=True), 8, 0.01),
    # d = 12: 0.09 * (3/12) ** 2 + 0.01
    ("poly-upd-9", S.polynomial_decay(0.1, 0.01, 4, 2.0, update_decay_steps=True), 9, 0.015625),
    # the last int32 step: d = 4 * ceil((2**31 - 1) / 4) = 2**31 (past int32), 0.1 * 1 / 2**31
    (
        "poly-upd-int32-max",
        S.polynomial_decay(0.1, 0.0, 4, update_decay_steps=True),
        2**31 - 1,
        0.1 / 2**31,
    ),
    # warmup: 0.1 * min(step, 4) / 4
    ("warmup-0", S.warmup(0.1, 4), 0, 0.0),
    ("warmup-inside", S.warmup(0.1, 4), 1, 0.025),
    ("warmup-boundary", S.warmup(0.1, 4), 4, 0.1),
    ("warmup-past", S.warmup(0.1, 4), 10, 0.1),
    # piecewise: values[t] on [milestones[t-1], milestones[t]); the last value holds
    ("pw-0", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 0, 0.1),
    ("pw-inside", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 1, 0.1),
    ("pw-boundary", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 2, 0.05),
    ("pw-boundary-2", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 5, 0.01),
    ("pw-end", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 10, 0.01),
    ("pw-past", S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 100, 0.01),
    ("pw-empty-interval", S.piecewise_constant([2, 2, 5], [0.3, 0.2, 0.1]), 2, 0.1),
    ("pw-single", S.piecewise_constant([3], [0.2]), 7, 0.2),
    # with_warmup(cosine(0.01, 0.1, 4), 2): 0.1 * step / 2 below 2, then cosine(step - 2)
    ("ww-0", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2), 0, 0.0),
    ("ww-inside", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2), 1, 0.05),
    ("ww-boundary", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2), 2, 0.1),  # cosine(0)
    ("ww-after", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2), 3, 0.08681980515339463),
    ("ww-past", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2), 20, 0.01),
    # init_value 0.02: 0.02 + (0.1 - 0.02) * 1 / 2
    ("ww-init", S.with_warmup(S.cosine_decay(0.01, 0.1, 4), 2, init_value=0.02), 1, 0.06),
    # per_epoch(exponential(0.1, 0.5, 2), 3): 0.1 * 0.5 ** (floor(step / 3) / 2)
    ("epoch-0", S.per_epoch(S.exponential_decay(0.1, 0.5, 2), 3), 2, 0.1),
    ("epoch-1", S.per_epoch(S.exponential_decay(0.1, 0.5, 2), 3), 3, 0.07071067811865477),
    ("epoch-2", S.per_epoch(S.exponential_decay(0.1, 0.5, 2), 3), 8, 0.05),
    # from_list: values[min(step, 2)]
    ("list-0", S.from_list([0.3, 0.2, 0.1]), 0, 0.3),
    ("list-end", S.from_list([0.3, 0.2, 0.1]), 2, 0.1),
    ("list-past", S.from_list([0.3, 0.2, 0.1]), 5, 0.1),
]


@pytest.mark.parametrize(
    "schedule, step, expected", [c[1:] for c in HAND], ids=[c[0] for c in HAND]
)
def test_hand_computed_values(schedule, step, expected, strict_dtypes):
    np.testing.assert_allclose(_at(schedule, step), expected, rtol=RTOL, atol=0)


# --- the values printed in MindSpore's documentation ----------------------------------


def test_mindspore_documented_values(strict_dtypes):
    got = S.to_list(S.piecewise_constant([2, 5, 10], [0.1, 0.05, 0.01]), 10)
    want = [0.1, 0.1, 0.05, 0.05, 0.05, 0.01, 0.01, 0.01, 0.01, 0.01]
    np.testing.assert_array_equal(np.float32(got), np.float32(want))
    # MindSpore prints float32 scalars: the float32 results are these numbers, exactly on
    # XLA:CPU; XLA:GPU's cos may be two ulps off (0.055000007 on an H100).
    ulps = 0 if jax.default_backend() == "cpu" else 2
    for schedule, want in [
        (S.cosine_decay(0.01, 0.1, 4), 0.055),
        (S.polynomial_decay(0.1, 0.01, 4, 0.5), 0.07363961),
        (S.exponential_decay(0.1, 0.9, 4), 0.09486833),
        (S.warmup(0.1, 2), 0.1),
    ]:
        np.testing.assert_array_max_ulp(np.float32(_at(schedule, 2)), np.float32(want), ulps)


# The example outputs printed in the docstrings of MindSpore's nn.dynamic_lr functions
# (arguments: learning rate(s), total_step, step_per_epoch, decay_epoch, ...).
DOC_LISTS = [
    (  # exponential_decay_lr(0.1, 0.9, 6, 2, 1)
        S.exponential_decay(0.1, 0.9, 1),
        2,
        [
            0.1,
            0.1,
            0.09000000000000001,
            0.09000000000000001,
            0.08100000000000002,
            0.08100000000000002,
        ],
    ),
    (  # natural_exp_decay_lr(0.1, 0.9, 6, 2, 2, is_stair=True)
        S.natural_exp_decay(0.1, 0.9, 2, staircase=True),
        2,
        [0.1, 0.1, 0.1, 0.1, 0.016529888822158657, 0.016529888822158657],
    ),
    (  # inverse_decay_lr(0.1, 0.5, 6, 1, 1, is_stair=True)
        S.inverse_time_decay(0.1, 0.5, 1, staircase=True),
        1,
        [0.1, 0.06666666666666667, 0.05, 0.04, 0.03333333333333333, 0.028571428571428574],
    ),
    (  # cosine_decay_lr(0.01, 0.1, 6, 2, 2)
        S.cosine_decay(0.01, 0.1, 2),
        2,
        [0.1, 0.1, 0.05500000000000001, 0.05500000000000001, 0.01, 0.01],
    ),
    (  # polynomial_decay_lr(0.1, 0.01, 6, 2, 2, 0.5)
        S.polynomial_decay(0.1, 0.01, 2, 0.5),
        2,
        [0.1, 0.1, 0.07363961030678928, 0.07363961030678928, 0.01, 0.01],
    ),
    (  # warmup_lr(0.1, 6, 2, 2): epoch = floor(i / 2), no + 1
        S.warmup(0.1, 2),
        2,
        [0.0, 0.0, 0.05, 0.05, 0.1, 0.1],
    ),
]


@pytest.mark.parametrize("schedule, steps_per_epoch, want", DOC_LISTS)
def test_mindspore_documented_lists(schedule, steps_per_epoch, want, strict_dtypes):
    got = S.to_list(S.per_epoch(schedule, steps_per_epoch), len(want))
    assert all(isinstance(v, float) for v in got)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)


# --- NumPy references of MindSpore's nn.dynamic_lr list functions ---------------------
# Written from the formulas of MindSpore's code, one value per step i with
# epoch = floor(i / step_per_epoch). With step_per_epoch = 1 they are also the values
# of the matching nn.learning_rate_schedule classes at global_step = i.


def ref_exponential_decay_lr(lr, rate, total, spe, de, stair):
    return [lr * rate ** ((i // spe) // de if stair else (i // spe) / de) for i in range(total)]


def ref_natural_exp_decay_lr(lr, rate, total, spe, de, stair):
    return [
        lr * math.exp(-rate * ((i // spe) // de * de if stair else i // spe)) for i in range(total)
    ]


def ref_inverse_decay_lr(lr, rate, total, spe, de, stair):
    return [
        lr / (1 + rate * ((i // spe) // de if stair else (i // spe) / de)) for i in range(total)
    ]


def ref_cosine_decay_lr(min_lr, max_lr, total, spe, de):
    return [
        min_lr + 0.5 * (max_lr - min_lr) * (1 + math.cos(math.pi * min(i // spe, de) / de))
        for i in range(total)
    ]


def ref_polynomial_decay_lr(lr, end, total, spe, de, power, update):
    out = []
    for i in range(total):
        epoch = i // spe
        if update:
            d, t = de * max(math.ceil(epoch / de), 1), epoch
        else:
            d, t = de, min(epoch, de)
        out.append((lr - end) * (1 - t / d) ** power + end)
    return out


def ref_warmup_lr(lr, total, spe, we):
    return [lr * min(i // spe, we) / we for i in range(total)]


def ref_piecewise_constant_lr(milestone, learning_rates):
    out, last = [], 0
    for m, v in zip(milestone, learning_rates):
        out += [v] * (m - last)
        last = m
    return out


TOTAL = 23


@pytest.mark.parametrize("spe, de", [(1, 1), (1, 4), (3, 2), (2, 5)])
@pytest.mark.parametrize("stair", [False, True])
def test_decay_lists_match_mindspore_reference(spe, de, stair):
    def both(schedule, ref):
        got = S.to_list(S.per_epoch(schedule, spe), TOTAL)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=0)

    both(
        S.exponential_decay(0.1, 0.8, de, staircase=stair),
        ref_exponential_decay_lr(0.1, 0.8, TOTAL, spe, de, stair),
    )
    both(
        S.natural_exp_decay(0.1, 0.15, de, staircase=stair),
        ref_natural_exp_decay_lr(0.1, 0.15, TOTAL, spe, de, stair),
    )
    both(
        S.inverse_time_decay(0.1, 0.7, de, staircase=stair),
        ref_inverse_decay_lr(0.1, 0.7, TOTAL, spe, de, stair),
    )


@pytest.mark.parametrize("spe, de", [(1, 1), (1, 7), (3, 2), (2, 5)])
def test_bounded_lists_match_mindspore_reference(spe, de):
    def both(schedule, ref):
        got = S.to_list(S.per_epoch(schedule, spe), TOTAL)
        np.testing.assert_allclose(got, ref, rtol=RTOL, atol=0)

    both(S.cosine_decay(0.0, 0.1, de), ref_cosine_decay_lr(0.0, 0.1, TOTAL, spe, de))
    both(S.cosine_decay(0.01, 0.1, de), ref_cosine_decay_lr(0.01, 0.1, TOTAL, spe, de))
    for update in (False, True):
        both(
            S.polynomial_decay(0.1, 0.01, de, 1.5, update_decay_steps=update),
            ref_polynomial_decay_lr(0.1, 0.01, TOTAL, spe, de, 1.5, update),
        )
    both(S.warmup(0.1, de), ref_warmup_lr(0.1, TOTAL, spe, de))


def test_piecewise_matches_mindspore_reference():
    milestone, rates = [1, 4, 4, 9, 15], [0.5, 0.3, 0.2, 0.1, 0.05]
    got = S.to_list(S.piecewise_constant(milestone, rates), 15)
    np.testing.assert_allclose(got, ref_piecewise_constant_lr(milestone, rates), rtol=RTOL)


def test_with_warmup_is_warmup_lr_then_the_schedule():
    cosine = S.cosine_decay(0.01, 0.1, 5)
    got = S.to_list(S.with_warmup(cosine, 3), 12)
    want = ref_warmup_lr(0.1, 3, 1, 3) + ref_cosine_decay_lr(0.01, 0.1, 9, 1, 5)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=0)


def test_with_warmup_hands_over_to_the_schedule_at_warmup_steps():
    # With init_value 0.02, the warmup line's end, 0.02 + (0.1 - 0.02), is 0.1 + 1 ulp in float32.
    cosine = S.cosine_decay(0.01, 0.1, 4)
    warm = S.with_warmup(cosine, 2, init_value=0.02)
    assert float(warm(2)) == float(cosine(0)) == np.float32(0.1)


@pytest.mark.parametrize(
    "build, want",
    [
        (lambda: S.piecewise_constant([2, 4], [0.1, 0.0]), [0.1, 0.1, 0.0, 0.0, 0.0]),
        (lambda: S.from_list([0.2, 0.0]), [0.2, 0.0, 0.0, 0.0, 0.0]),
        (lambda: S.exponential_decay(0.0, 0.5, 2), [0.0] * 5),
        (lambda: S.natural_exp_decay(0.0, 0.5, 2), [0.0] * 5),
        (lambda: S.inverse_time_decay(0.0, 0.5, 2), [0.0] * 5),
        (lambda: S.warmup(0.0, 2), [0.0] * 5),
        (lambda: S.polynomial_decay(0.0, 0.0, 2), [0.0] * 5),
        (lambda: S.cosine_decay(0.0, 0.1, 2), [0.1, 0.05, 0.0, 0.0, 0.0]),
    ],
    ids=["piecewise", "from_list", "exp", "natural_exp", "inverse", "warmup", "poly", "cosine"],
)
def test_a_learning_rate_of_zero_is_valid(build, want):
    # A rate of 0 (a frozen phase, a decay to 0) is allowed: only negatives are rejected.
    np.testing.assert_allclose(S.to_list(build(), 5), want, rtol=RTOL, atol=1e-9)


def test_polynomial_may_rise_as_optax_polynomial_schedule_does():
    ours, theirs = S.polynomial_decay(0.0, 0.1, 4, 2.0), optax.polynomial_schedule(0.0, 0.1, 2.0, 4)
    steps = jnp.arange(7)
    np.testing.assert_allclose(jax.vmap(ours)(steps), jax.vmap(theirs)(steps), rtol=RTOL)


def test_hyperparameters_may_be_traced():
    # Built inside jit (as optax.inject_hyperparams does with a schedule factory).
    @jax.jit
    def values(lr, rate, min_lr, max_lr, step):
        return (
            S.exponential_decay(lr, rate, 4)(step),
            S.exponential_decay(lr, rate, 4, staircase=True)(step),
            S.cosine_decay(min_lr, max_lr, 8)(step),
        )

    exp, stair, cos = values(0.1, 0.5, 0.01, 0.1, jnp.int32(6))
    np.testing.assert_allclose(exp, 0.1 * 0.5 ** (6 / 4), rtol=RTOL)
    np.testing.assert_allclose(stair, 0.1 * 0.5 ** (6 // 4), rtol=RTOL)
    np.testing.assert_allclose(cos, 0.01 + 0.045 * (1 + math.cos(math.pi * 6 / 8)), rtol=RTOL)


def test_cosine_decay_keeps_its_relative_precision_near_the_end():
    # 1 + cos(pi * t / n) cancels in float32 as t nears n; the float64 reference does not.
    n = 10_000
    schedule = jax.jit(S.cosine_decay(0.0, 1.0, n))
    for step in (n - 1, n - 10, n - 100):
        want = 0.5 * (1 + math.cos(math.pi * step / n))
        np.testing.assert_allclose(float(schedule(jnp.int32(step))), want, rtol=1e-5)


def test_from_list_round_trips_to_list():
    values = ref_cosine_decay_lr(0.01, 0.1, 10, 2, 3)
    got = S.to_list(S.from_list(values), 13)
    np.testing.assert_allclose(got, values + [values[-1]] * 3, rtol=RTOL, atol=0)


# --- optax defines the same schedules ---------------------------------------------------


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (S.cosine_decay(0.01, 0.1, 7), optax.cosine_decay_schedule(0.1, 7, alpha=0.1)),
        (S.polynomial_decay(0.1, 0.02, 6, 2.0), optax.polynomial_schedule(0.1, 0.02, 2.0, 6)),
        (S.exponential_decay(0.1, 0.7, 3), optax.exponential_decay(0.1, 3, 0.7)),
        (
            S.exponential_decay(0.1, 0.7, 3, staircase=True),
            optax.exponential_decay(0.1, 3, 0.7, staircase=True),
        ),
        (S.warmup(0.1, 5), optax.linear_schedule(0.0, 0.1, 5)),
        (
            S.with_warmup(S.cosine_decay(0.01, 0.1, 6), 4),
            optax.warmup_cosine_decay_schedule(0.0, 0.1, 4, 10, end_value=0.01),
        ),
    ],
)
def test_matches_optax(ours, theirs):
    steps = jnp.arange(14)
    np.testing.assert_allclose(jax.vmap(ours)(steps), jax.vmap(theirs)(steps), rtol=1e-6, atol=0)


# --- as learning_rate= of optax optimizers, under jit ---------------------------------

ALL = [
    S.piecewise_constant([2, 5], [0.1, 0.01]),
    S.exponential_decay(0.1, 0.9, 2, staircase=True),
    S.natural_exp_decay(0.1, 0.1, 2),
    S.inverse_time_decay(0.1, 0.5, 2),
    S.cosine_decay(0.0, 0.1, 4),
    S.polynomial_decay(0.1, 0.0, 4, update_decay_steps=True),
    S.warmup(0.1, 3),
    S.with_warmup(S.cosine_decay(0.0, 0.1, 4), 2),
    S.per_epoch(S.warmup(0.1, 2), 2),
    S.from_list([0.1, 0.05]),
]


@pytest.mark.parametrize("schedule", ALL)
def test_traced_step_traces_once(schedule, strict_dtypes):
    f, traces = _jit_counting(schedule)
    for step in range(6):
        out = f(jnp.int32(step))
        assert out.dtype == jnp.float32
        np.testing.assert_allclose(out, schedule(step), rtol=1e-7)  # Python int step, eager
    assert len(traces) == 1


@pytest.mark.parametrize("optimizer", [optax.sgd, optax.adam])
def test_learning_rate_of_optax_optimizers(optimizer):
    schedule = S.with_warmup(S.cosine_decay(0.01, 0.1, 3), 2)
    tx, direction = optimizer(schedule), optimizer(1.0)  # lr 1: the unscaled update
    params = {"w": jnp.array([1.0, -2.0], jnp.float32), "b": jnp.array(0.5, jnp.float32)}

    def both(state, ref_state, grads):
        updates, state = tx.update(grads, state, params)
        ref_updates, ref_state = direction.update(grads, ref_state, params)
        return updates, ref_updates, state, ref_state

    step, traces = _jit_counting(both)

    state, ref_state = tx.init(params), direction.init(params)
    # by hand: warmup 0, 0.1 / 2; then 0.01 + 0.09 * (1 + cos(pi * t / 3)) / 2 for t = 0..3; held
    rates = [0.0, 0.05, 0.1, 0.0775, 0.0325, 0.01, 0.01]
    for k, lr in enumerate(rates):  # the k-th applied update uses schedule(k)
        grads = {name: p * (k + 1.0) for name, p in params.items()}
        updates, ref_updates, state, ref_state = step(state, ref_state, grads)
        want = {name: lr * u for name, u in ref_updates.items()}
        chex.assert_trees_all_close(updates, want, rtol=1e-6)
    assert len(traces) == 1  # the traced count moves the schedule without recompiling


# --- step counting ------------------------------------------------------------------------


def test_skipped_steps_do_not_advance_the_schedule():
    values = [1.0, 0.5, 0.25, 0.125, 0.0625]
    tx = gradtools.dynamic_loss_scale(optax.sgd(S.from_list(values)), init_scale=1.0)
    params = {"w": jnp.array([1.0, 2.0])}
    finite_pattern = [True, False, True, False, False, True, True]
    step, traces = _jit_counting(lambda state, grads: tx.update(grads, state, params))

    state, applied = tx.init(params), 0  # NumPy reference: the count of applied updates
    for finite in finite_pattern:
        g = np.array([2.0, 3.0]) if finite else np.array([2.0, np.inf])
        updates, state = step(state, {"w": jnp.asarray(g, jnp.float32)})
        want = -values[applied] * g if finite else np.zeros(2)
        np.testing.assert_allclose(updates["w"], want, rtol=1e-7)
        applied += finite
        ((_, inner),) = optax.tree.get_all_with_path(state, "ScaleByScheduleState")
        assert int(inner.count) == applied
    assert int(gradtools.metrics(state)["skipped_steps"]) == finite_pattern.count(False)
    assert len(traces) == 1


def test_metrics_reads_the_learning_rate():
    schedule = S.exponential_decay(0.1, 0.5, 1)  # 0.1 * 0.5 ** k at the k-th applied update
    tx = gradtools.dynamic_loss_scale(
        optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), init_scale=1.0
    )
    params = {"w": jnp.array([1.0, 2.0])}
    state = tx.init(params)
    m = gradtools.metrics(state)
    assert m["learning_rate"].dtype == jnp.float32
    np.testing.assert_allclose(m["learning_rate"], 0.1, rtol=RTOL)  # schedule(0) at init

    step = jax.jit(tx.update)
    applied = 0
    for finite in [True, True, False, True]:
        g = jnp.array([1.0, 1.0 if finite else jnp.inf])
        _, state = step({"w": g}, state, params)
        applied += finite
        m = gradtools.metrics(state)
        # the rate of the last applied update, schedule(applied - 1); a skip keeps it
        np.testing.assert_allclose(m["learning_rate"], 0.1 * 0.5 ** (applied - 1), rtol=RTOL)
        assert bool(m["finite"]) == finite


# --- bad input ------------------------------------------------------------------------------

BAD = [
    (lambda: S.piecewise_constant([2, 5, 3], [0.1, 0.05, 0.01]), "milestones"),
    (lambda: S.piecewise_constant([2, 5], [0.1, 0.05, 0.01]), "milestones=.*values="),
    (lambda: S.piecewise_constant([], []), "non-empty"),
    (lambda: S.piecewise_constant([0, 5], [0.1, 0.05]), r"milestones\[0\]=0"),
    (lambda: S.piecewise_constant([2, 5], [0.1, -0.05]), r"values\[1\]=-0.05"),
    (lambda: S.exponential_decay(0.1, 0.9, 0), "decay_steps=0"),
    (lambda: S.exponential_decay(0.1, 0.9, 2.5), "decay_steps=2.5"),
    (lambda: S.exponential_decay(-0.1, 0.9, 2), "learning_rate=-0.1"),
    (lambda: S.exponential_decay(0.1, -0.9, 2), "decay_rate=-0.9"),
    (lambda: S.exponential_decay(0.1, 0.9, 2, staircase=1), "staircase=1"),
    (lambda: S.natural_exp_decay(0.1, -0.5, 2), "decay_rate=-0.5"),
    (lambda: S.natural_exp_decay(0.1, 0.5, -1), "decay_steps=-1"),
    (lambda: S.inverse_time_decay(0.1, 0.5, 0), "decay_steps=0"),
    (lambda: S.inverse_time_decay(float("nan"), 0.5, 1), "learning_rate=nan"),
    (lambda: S.cosine_decay(0.1, 0.1, 4), "min_lr=0.1 must be < max_lr=0.1"),
    (lambda: S.cosine_decay(0.2, 0.1, 4), "min_lr=0.2"),
    (lambda: S.cosine_decay(-0.01, 0.1, 4), "min_lr=-0.01"),
    (lambda: S.cosine_decay(0.01, 0.1, 0), "decay_steps=0"),
    (lambda: S.polynomial_decay(0.1, -0.01, 4), "end_learning_rate=-0.01"),
    (lambda: S.polynomial_decay(0.1, 0.01, 4, 0.0), "power=0.0"),
    (lambda: S.polynomial_decay(0.1, 0.01, 0), "decay_steps=0"),
    (lambda: S.warmup(0.1, 0), "warmup_steps=0"),
    (lambda: S.warmup(-0.1, 2), "learning_rate=-0.1"),
    (lambda: S.with_warmup(S.warmup(0.1, 2), 0), "warmup_steps=0"),
    (lambda: S.with_warmup(S.warmup(0.1, 2), 2, init_value=-1.0), "init_value=-1.0"),
    (lambda: S.per_epoch(S.warmup(0.1, 2), 0), "steps_per_epoch=0"),
    (lambda: S.to_list(S.warmup(0.1, 2), 0), "total_steps=0"),
    (lambda: S.from_list([]), "non-empty"),
    (lambda: S.from_list([[0.1, 0.2]]), "1-D"),
    (lambda: S.from_list([0.1, -0.2]), "values=.*>= 0"),
    (lambda: S.from_list(["0.5", "0.25"]), r"values=\['0.5', '0.25'\] .* not of strings"),
    (lambda: S.from_list([0.5, "0.25"]), r"values=\[0.5, '0.25'\] .* not of strings"),
    (lambda: S.from_list([True, False]), r"values=\[True, False\] .* not of bools"),
    (lambda: S.from_list([0.5, 0.25 + 1j]), r"values=.* not of complex numbers"),
    (lambda: S.from_list([0.5, None]), r"values=\[0.5, None\] .* not of other objects"),
    (lambda: S.piecewise_constant([2], [np.complex128(0.1 + 1j)]), "values.* not complex"),
]


def test_from_list_takes_ints_and_numpy_and_jax_numbers():
    values = [1, np.float64(0.5), jnp.float32(0.25), np.int32(0)]
    got = S.to_list(S.from_list(values), 5)
    assert got == [1.0, 0.5, 0.25, 0.0, 0.0]


@pytest.mark.parametrize("build, match", BAD, ids=[m for _, m in BAD])
def test_bad_input_raises(build, match):
    with pytest.raises(ValueError, match=match):
        build()


@pytest.mark.parametrize("combinator", [S.with_warmup, S.per_epoch, S.to_list])
def test_schedule_must_be_callable(combinator):
    with pytest.raises(TypeError, match="schedule=0.1"):
        combinator(0.1, 2)
