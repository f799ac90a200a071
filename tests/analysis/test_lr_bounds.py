"""LR bounds on curves built from formulas with known true bounds (src/rangefinder/analysis/synthetic.py)."""

import math

import numpy as np
import pytest

from rangefinder.analysis import analyze_lr_curve
from rangefinder.analysis.lr_bounds import FLAG_ORDER, MID_POSITION
from rangefinder.analysis.synthetic import RangeTestShape, lr_sweep, noisy, true_lr_bounds
from rangefinder.defaults import LOW_QUALITY
from rangefinder.errors import RangefinderError

U = RangeTestShape(rise=0.05)  # descent around 1e-5, turns up from ~1e-3
DECADE = 0.2  # bounds must be within 0.2 decade of the truth


def decades(a, b):
    return abs(math.log10(a / b))


def true_mid(lo, hi, ramp="exp"):
    p = MID_POSITION
    return lo ** (1 - p) * hi ** p if ramp == "exp" else (1 - p) * lo + p * hi


def check_bounds(b, shape, lr_min=1e-7, lr_max=1e-2, ramp="exp", tol=DECADE):
    lo, hi = true_lr_bounds(shape, lr_min, lr_max, ramp, start=shape.base)
    assert b.status == "ok", b.to_dict()
    assert decades(b.lr_low, lo) <= tol, (b.lr_low, lo)
    assert decades(b.lr_high, hi) <= tol, (b.lr_high, hi)
    assert b.lr_low < b.lr_mid < b.lr_high
    assert decades(b.lr_mid, true_mid(lo, hi, ramp)) <= tol


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_u_shape(seed):
    lr = lr_sweep(40)
    b = analyze_lr_curve(lr, noisy(U.loss(lr), 0.002, seed), seed=seed)
    check_bounds(b, U)
    assert b.flags == ["rose_after_min"]
    assert b.quality_label == "high"
    lo, hi = b.lr_mid_ci80
    assert lo < b.lr_mid < hi
    # The JSON keys of the issue.
    d = b.to_dict()
    for k in ("status", "lr_low", "lr_high", "lr_mid", "flags", "quality", "quality_label", "lr_mid_ci80",
              "points_used", "lr_steepest", "lr_min_div10"):
        assert k in d


def test_the_classic_picks_are_the_steepest_fall_and_the_minimum_over_ten():
    """lr_steepest and lr_min_div10 are fastai's picks on the raw points (design.md 1.2): on a noiseless U the steepest
    fall is the sigmoid's centre, lr_fall, and the minimum's LR over ten is exact."""
    lr = lr_sweep(40)
    y = U.loss(lr)
    b = analyze_lr_curve(lr, y)
    assert b.status == "ok"
    assert b.lr_min_div10 == pytest.approx(lr[np.argmin(y)] / 10, rel=1e-12)
    half_step = math.log10(lr[2] / lr[1]) / 2
    assert decades(b.lr_steepest, U.lr_fall) <= half_step, b.lr_steepest


def test_quality_is_the_geometric_mean_of_its_parts_less_a_fifth_for_each_censored_end():
    """design.md 1.2: the four parts' geometric mean, times 0.8 for each censored flag (a bound past the sweep's end is
    less sure than the parts alone say)."""
    lr = lr_sweep(40)

    def mean_of_parts(b):
        return math.prod(b.quality_parts.values()) ** (1 / len(b.quality_parts))

    plain = analyze_lr_curve(lr, noisy(U.loss(lr), 0.002, 0))
    assert plain.flags == ["rose_after_min"] and plain.quality == pytest.approx(mean_of_parts(plain), abs=2e-4)
    censored = analyze_lr_curve(lr, noisy(RangeTestShape(lr_fall=3e-3, fall_width=0.5).loss(lr), 0.002, 0))
    assert censored.flags == ["upper_censored"]
    assert censored.quality == pytest.approx(0.8 * mean_of_parts(censored), abs=2e-4)


def test_the_80_percent_interval_is_as_wide_as_lr_mid_scatters_over_fresh_noise():
    """lr_mid_ci80 is the 10th to 90th percentile of the bootstrap replicates' midpoints: over 30 curves of fresh noise
    it is about as wide as lr_mid's own 10-90 % spread (wider: one replicate is not bagged) and holds the centre of
    that spread in about 80 % of them (a 25-75 % interval was half as wide and held it in 60 %)."""
    lr = lr_sweep(40)
    runs = [analyze_lr_curve(lr, noisy(U.loss(lr), 0.003, s), seed=s) for s in range(30)]
    mids = np.log10([b.lr_mid for b in runs])
    lo, hi = np.percentile(mids, [10, 90])
    intervals = np.log10([b.lr_mid_ci80 for b in runs])
    assert 0.9 <= np.mean(intervals[:, 1] - intervals[:, 0]) / (hi - lo) <= 2.5
    centre = np.median(mids)
    assert np.mean((intervals[:, 0] <= centre) & (centre <= intervals[:, 1])) >= 0.7


def test_deterministic():
    lr = lr_sweep(40)
    y = noisy(U.loss(lr), 0.003, 7)
    assert analyze_lr_curve(lr, y).to_dict() == analyze_lr_curve(lr, y).to_dict()


def test_heavy_noise_keeps_the_midpoint():
    # Noise a tenth of the whole drop per point: the midpoint (what one trains at) stays within 0.2 decade.
    lr = lr_sweep(40)
    hits = 0
    for seed in range(5):
        b = analyze_lr_curve(lr, noisy(U.loss(lr), 0.004, seed))
        lo, hi = true_lr_bounds(U, 1e-7, 1e-2, start=U.base)
        assert b.status == "ok"
        hits += decades(b.lr_mid, true_mid(lo, hi)) <= DECADE
    assert hits >= 4


def test_never_rises_flattens():
    shape = RangeTestShape(rise=0.0)
    lr = lr_sweep(40)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    check_bounds(b, shape)
    assert "rose_after_min" not in b.flags and "upper_censored" not in b.flags
    # After the minimum the smoothed curve wanders up and down with the noise; that is no turn up (a rise must pass a
    # fifth of the drop and two standard errors). Called "rose" at any wiggle, 5 of these 10 curves were.
    for seed in range(1, 10):
        assert "rose_after_min" not in analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, seed), seed=seed).flags, seed


def test_still_falling_at_the_end_is_upper_censored():
    shape = RangeTestShape(lr_fall=3e-3, fall_width=0.5)
    lr = lr_sweep(40)
    for seed in range(3):
        b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, seed))
        assert b.status == "ok" and "upper_censored" in b.flags
    assert any("Raise lr_max" in a for a in b.advice)


def test_already_descending_is_lower_censored():
    shape = RangeTestShape(lr_fall=1e-7, rise=0.05)
    lr = lr_sweep(40)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    assert b.status == "ok" and "lower_censored" in b.flags
    assert decades(b.lr_low, true_lr_bounds(shape, 1e-7, 1e-2, start=shape.base)[0]) <= DECADE


def test_rising_from_start():
    shape = RangeTestShape(drop=0.0, lr_rise=1e-7, rise=0.02)
    lr = lr_sweep(40)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    assert b.status == "rising_from_start"
    assert b.lr_low is None and b.lr_high is None and b.lr_mid is None and b.lr_mid_ci80 is None


def test_explodes_then_nan():
    lr = lr_sweep(40)
    y = noisy(U.loss(lr), 0.002, 0)
    y[-6:] = [0.9, 3.0, 40.0, np.inf, np.nan, np.nan]
    b = analyze_lr_curve(lr, y)
    check_bounds(b, U)
    assert "diverged" in b.flags and b.points_dropped >= 5


def test_diverged_before_any_descent():
    lr = lr_sweep(20)
    y = noisy(np.full(lr.shape, 0.2), 0.002, 0)
    y[6:] = np.nan
    b = analyze_lr_curve(lr, y)
    assert b.status == "diverged" and b.lr_mid is None


def test_outlier_spikes():
    lr = lr_sweep(40)
    b = analyze_lr_curve(lr, noisy(U.loss(lr), 0.002, 0, spikes=3, spike_size=10))
    check_bounds(b, U)


def test_ten_point_linear_sweep():
    shape = RangeTestShape(lr_fall=4e-4, fall_width=0.08, lr_rise=1e-3, rise=0.05, rise_width=0.05)
    lr = lr_sweep(10, 1e-4, 1.2e-3, "linear")
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))  # ramp inferred from the spacing
    assert b.ramp == "linear"
    check_bounds(b, shape, 1e-4, 1.2e-3, "linear")
    # interpolated in LR on a linear sweep
    assert b.lr_mid == pytest.approx((1 - MID_POSITION) * b.lr_low + MID_POSITION * b.lr_high, rel=1e-12)


def test_flat_noise_false_ok_rate():
    # 500 seeds of pure noise: "ok" (a claimed descent) at most 2% of the time.
    lr = lr_sweep(10)  # the default range test: 10 epochs, a validation each, plus the baseline
    ok = sum(analyze_lr_curve(lr, noisy(np.full(lr.shape, 0.2), 0.002, s), seed=s).status == "ok"
             for s in range(500))
    assert ok <= 10, ok


def test_flat_noise_many_points():
    lr = lr_sweep(40)
    ok = sum(analyze_lr_curve(lr, noisy(np.full(lr.shape, 0.2), 0.002, s), seed=s).status == "ok"
             for s in range(100))
    assert ok <= 3, ok
    b = analyze_lr_curve(lr, noisy(np.full(lr.shape, 0.2), 0.002, 0))
    assert b.status == "no_descent" and b.lr_mid is None


def test_bad_input():
    with pytest.raises(RangefinderError, match="at least 3"):
        analyze_lr_curve([0, 1e-6, 1e-5], [0.2, np.nan, np.nan])
    with pytest.raises(RangefinderError, match="differ in length"):
        analyze_lr_curve([0, 1e-6], [0.2, 0.1, 0.3])
    # What the config refuses, refused from Python too (a notebook's call): a negative seed failed in NumPy's
    # seeding, a factor of 1 or less read a falling curve as diverged.
    lr, y = [0, 1e-5, 1e-4, 1e-3], [0.2, 0.19, 0.18, 0.3]
    # A column of text, or pandas' NA in an object column: NumPy's ValueError and TypeError, not RangefinderError.
    with pytest.raises(RangefinderError, match=r"^val_loss must be numbers, one per row \(.*'diverged'"):
        analyze_lr_curve(lr, [0.2, 0.19, 0.18, "diverged"])
    with pytest.raises(RangefinderError, match=r"^stabilize_loss must be numbers"):
        analyze_lr_curve(lr, y, stabilize_loss=np.array([0.2, 0.19, 0.18, object()], dtype=object))
    with pytest.raises(RangefinderError, match=r"^seed must be a whole number of 0 or more \(got -1\)"):
        analyze_lr_curve(lr, y, seed=-1)
    for factor in (0.5, 1.0, float("nan")):
        with pytest.raises(RangefinderError, match=r"^divergence_factor must be above 1"):
            analyze_lr_curve(lr, y, divergence_factor=factor)


def test_a_sweep_that_diverged_before_three_points_is_told_to_end_lower_not_to_validate_more_often():
    """The tiny model's sweep over 10..1e6 (metrics.csv's lr and val_loss): its validation loss was NaN at the first
    epoch's validation. The refusal said "validate more often during the sweep", which no number of validations
    changes; it names the LR where the sweep diverged. Too few points that are all finite keep that advice."""
    with pytest.raises(RangefinderError) as refused:
        analyze_lr_curve([0.0, 10.0], [0.21332472539506853, np.nan])
    assert str(refused.value) == (
        "the sweep diverged at lr 10 (its validation loss stopped being finite there), leaving 1 finite (lr, "
        "val_loss) point; a range test needs at least 3: sweep a range that ends below 10 (lr_range_test.lr_max, "
        "and lr_min under it)")
    with pytest.raises(RangefinderError, match=r"has 2 finite .*\(validate more often during the sweep\)$"):
        analyze_lr_curve([0.0, 1e-5], [0.2, 0.19])
    # A loss not finite from the baseline at lr 0 on is no divergence: "end below 0" was the advice.
    with pytest.raises(RangefinderError) as refused:
        analyze_lr_curve([0.0, 1e-6, 1e-5], [np.nan, np.nan, 0.2])
    assert str(refused.value) == (
        "the validation loss is not finite at lr 0, the sweep's lowest, before any LR could make it diverge; the "
        "model gives no finite loss: check the base model, and set training.mixed_precision no where fp16 overflows")
    with pytest.raises(RangefinderError, match=r"^the sweep diverged at lr 1e-05 "):  # rows out of LR order
        analyze_lr_curve([1e-4, 0.0, 1e-5], [np.nan, 0.2, np.inf])


@pytest.mark.parametrize("lr", [[-1, 0, 1], [-3, -2, -1, -0.5, 0.1, 0.2, 0.3]], ids=["as-baselines", "as-linear-ramp"])
def test_a_negative_lr_is_refused(lr):
    # [-1, 0, 1] was read as two baselines and said "never fell by more than its noise"; the second as a linear ramp
    # with status ok and negative bounds.
    with pytest.raises(RangefinderError, match=r"rows? ha(s|ve) a negative lr \(the first: -"):
        analyze_lr_curve(lr, np.linspace(1.0, 0.5, len(lr)))


def test_a_curve_whose_lr_does_not_climb_is_refused():
    # A constant-LR fine-tune's curve passed to analyze-lr said "no descent: validate more often".
    with pytest.raises(RangefinderError, match=r"1 distinct lr value \(0.0001\).*use select-steps"):
        analyze_lr_curve(np.full(10, 1e-4), np.linspace(0.3, 0.2, 10))
    with pytest.raises(RangefinderError, match=r"2 distinct lr values \(0, 0.0001\)"):
        analyze_lr_curve(np.r_[0, np.full(9, 1e-4)], np.linspace(0.3, 0.2, 10))


def test_narrow_valley_in_eleven_points_is_not_called_rising():
    # The default sweep (10 validations + baseline, half a decade apart) can miss a valley 2-3 points wide; it
    # must then say "no descent, validate more often", never "rising from the start" (which says lower the range).
    lr = lr_sweep(10)
    statuses = {analyze_lr_curve(lr, noisy(U.loss(lr), 0.002, s), seed=s).status for s in range(10)}
    assert "rising_from_start" not in statuses


def test_eleven_point_sweep_of_a_broad_u():
    shape = RangeTestShape(fall_width=0.5, lr_fall=1e-5, rise=0.05, lr_rise=3e-3, rise_width=0.4)
    lr = lr_sweep(10)
    b = analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, 0))
    # Half a decade between points: the bounds are read to within one step.
    check_bounds(b, shape, tol=0.5)


# A small, clean descent and then a rise many times its size: the range test on a base model with little left to
# learn (bench/discovery_quality, stripes seed 0; measured on the tiny model). Read whole, the rise swamps the
# permutation test and the curve looked like "rising from the start".
STRIPES_LR = [0, 1.4e-05, 2.5e-05, 4.5e-05, 8.2e-05, 0.00015, 0.00027, 0.0005, 0.0009, 0.0016, 0.003, 0.0055, 0.01]
STRIPES_LOSS = [0.1066, 0.1062, 0.1055, 0.1044, 0.1033, 0.1038, 0.1072, 0.1099, 0.1211, 0.1320, 0.1605, 0.2603,
                0.3322]


def test_small_descent_before_a_large_rise_is_read():
    whole = analyze_lr_curve(STRIPES_LR, STRIPES_LOSS, ramp="exp", rise_cut_points=None)
    assert whole.status in ("rising_from_start", "no_descent")
    b = analyze_lr_curve(STRIPES_LR, STRIPES_LOSS, ramp="exp")
    assert b.status == "ok", b.to_dict()
    # The descent runs from the baseline to 8.2e-5 and turns by 1.5e-4; the bounds sit inside that stretch.
    assert 1.4e-5 <= b.lr_low < b.lr_mid < b.lr_high <= 1.5e-4
    assert "rose_after_min" in b.flags and "upper_censored" not in b.flags
    assert b.points_used == 6 and b.points_dropped == 7
    assert b.fit.dropped_lr.tolist() == STRIPES_LR[6:]


def test_small_descent_before_a_large_rise_synthetic():
    shape = RangeTestShape(base=0.1, drop=0.004, lr_fall=3e-5, fall_width=0.2, rise=0.08, lr_rise=2e-3,
                           rise_width=0.3)
    lr = lr_sweep(12, 1e-5, 1e-2)
    lo, hi = true_lr_bounds(shape, 1e-5, 1e-2, start=shape.base)
    runs = [analyze_lr_curve(lr, noisy(shape.loss(lr), 0.0003, s), seed=s, bootstrap=50) for s in range(12)]
    ok = [b for b in runs if b.status == "ok"]
    assert len(ok) >= 6, [b.status for b in runs]
    for b in ok:
        assert decades(b.lr_low, lo) <= 0.5 and decades(b.lr_high, hi) <= 0.5, (b.lr_low, b.lr_high, lo, hi)
    whole = [analyze_lr_curve(lr, noisy(shape.loss(lr), 0.0003, s), seed=s, bootstrap=0, rise_cut_points=None)
             for s in range(12)]
    assert sum(b.status == "ok" for b in whole) <= 1


def test_flat_then_rising_false_ok_rate():
    # Nothing learned, then the top LRs hurt: reading the part before the climb must not invent a descent.
    shape = RangeTestShape(drop=0.0, rise=0.05, lr_rise=1e-3)
    lr = lr_sweep(10)
    ok = sum(analyze_lr_curve(lr, noisy(shape.loss(lr), 0.002, s), seed=s, bootstrap=0).status == "ok"
             for s in range(300))
    assert ok <= 6, ok


def test_mid_position_places_the_midpoint_between_the_bounds():
    lr = lr_sweep(24)
    y = noisy(U.loss(lr), 0.002, 0)
    at = {p: analyze_lr_curve(lr, y, mid_position=p) for p in (0.0, 0.5, 1.0)}
    b = at[0.5]
    assert at[0.0].lr_mid == pytest.approx(b.lr_low) and at[1.0].lr_mid == pytest.approx(b.lr_high)
    assert b.lr_mid == pytest.approx(math.sqrt(b.lr_low * b.lr_high))  # geometric mean on an exp sweep
    # The 80% interval moves with the midpoint.
    assert at[1.0].lr_mid_ci80[0] > b.lr_mid_ci80[0]
    with pytest.raises(RangefinderError, match="mid_position"):
        analyze_lr_curve(lr, y, mid_position=1.5)


# The LoRA range test of tests/methods/test_discovery_by_method.py (default sweep 1e-6..1, exp ramp, validation every
# half epoch, zoom off) as one CPU measured it: flat to ~1e-3, down 15% to its minimum at 0.027 over three points,
# then an explosion; the validation loss is deterministic, so the flat part varies by 1e-6. The most common shape of
# a range test. It was read as "diverged before any real descent": the robust LOWESS passes set the three points
# of the fall aside as outliers (the flat part fits to 1e-6, so the fall lies far beyond 6 MADs) and flattened it,
# and the bend swelled the noise estimate from ~1e-4 to 0.0028.
LORA_LR = [0.0, 1.8233480008684409e-06, 6.061898993497573e-06, 2.0153376859417328e-05, 6.70018750350959e-05,
           0.0002227542951999558, 0.0007405684692262437, 0.002462092401494624, 0.008185467307069028,
           0.027213387683753056, 0.09047357242349298, 0.30078825180430974, 1.0]
LORA_LOSS = [0.18395818886347115, 0.18395730596967041, 0.1839552808087319, 0.18394584581255913,
             0.18391722277738154, 0.1838152534328401, 0.18347256048582494, 0.1821866105310619, 0.1768346130847931,
             0.15731067792512476, 0.19073234917595983, 0.9365795142948627, 1.2686858102679253]


def check_descent_then_explosion(b):
    assert b.status == "ok", b.to_dict()
    # lr_low: a fifth of the way down, between the points at 7.4e-4 (0.3% of the drop) and 8.2e-3 (51%);
    # lr_high: at or below the minimum's LR.
    assert 7.4e-4 <= b.lr_low < b.lr_mid < b.lr_high <= 0.0273, b.to_dict()
    # Few points lie between the bounds, so the score may be under LOW_QUALITY: then (only then) flagged as such.
    assert [f for f in b.flags if f != "low_quality"] == ["rose_after_min", "diverged"], b.flags
    assert ("low_quality" in b.flags) == (b.quality < LOW_QUALITY) and b.flags == sorted(b.flags, key=FLAG_ORDER.index)


def test_descent_then_explosion_is_read():
    b = analyze_lr_curve(LORA_LR, LORA_LOSS, ramp="exp")
    check_descent_then_explosion(b)
    # Noiseless, so tighter: 20% down lies between the points at 2.5e-3 (7%) and 8.2e-3; 80% between 8.2e-3 and
    # the minimum. The part read ends before the climb above the start (0.19 at 0.09).
    assert 2.46e-3 < b.lr_low < 8.19e-3 and 8.19e-3 < b.lr_high < 0.0272
    assert b.points_used == 10 and b.points_dropped == 3
    assert b.noise_sigma < 1e-3 and b.p_descent <= 0.01


def test_descent_then_explosion_right_after_the_minimum():
    # No point between the minimum and the explosion: the read part ends on its minimum, but the curve turned
    # (it exploded), so it is not "still falling at the end".
    b = analyze_lr_curve(LORA_LR[:10] + LORA_LR[11:], LORA_LOSS[:10] + LORA_LOSS[11:], ramp="exp")
    check_descent_then_explosion(b)
    assert "upper_censored" not in b.flags and not any("Raise lr_max" in a for a in b.advice)


def test_descent_then_explosion_with_noise():
    # Measurement noise of 5e-5 per point (0.2% of the drop, 50x the flat part's spread): read on every seed.
    for seed in range(10):
        y = noisy(np.asarray(LORA_LOSS), 5e-5, seed)
        check_descent_then_explosion(analyze_lr_curve(LORA_LR, y, ramp="exp", seed=seed, bootstrap=50))


# A linear sweep whose bounds land at ~1.9e-7 and ~1.13e-6 (issue 23): the loss falls from the first LRs, slowing
# (a power 0.75 of the LR), to its minimum at 1.6e-6, and rises after.
LINEAR_LR = np.concatenate([[0.0], np.linspace(1e-7, 2.4e-6, 24)])
LINEAR_LOSS = noisy(0.2 - 0.04 * np.minimum(LINEAR_LR / 1.6e-6, 1) ** 0.75
                    + 0.05 * np.maximum(LINEAR_LR - 1.6e-6, 0) / 5e-7, 0.0005, 0)


def test_midpoint_rules():
    at = {m: analyze_lr_curve(LINEAR_LR, LINEAR_LOSS, midpoint=m) for m in ("tuned", "geometric", "arithmetic")}
    b = at["arithmetic"]
    assert b.ramp == "linear" and b.status == "ok"
    assert b.lr_low == pytest.approx(1.9e-7, rel=0.1) and b.lr_high == pytest.approx(1.13e-6, rel=0.1)
    # EveryDream2's rule: halfway in LR.
    assert b.lr_mid == pytest.approx((b.lr_low + b.lr_high) / 2, rel=1e-12)
    assert b.lr_mid == pytest.approx(6.6e-7, rel=0.05)
    assert at["geometric"].lr_mid == pytest.approx(math.sqrt(b.lr_low * b.lr_high), rel=1e-12)
    # The default is the tuned rule, mid_position of the way (on a linear sweep: in LR).
    default = analyze_lr_curve(LINEAR_LR, LINEAR_LOSS)
    assert default.midpoint == "tuned" and default.lr_mid == at["tuned"].lr_mid
    assert default.lr_mid == pytest.approx((1 - MID_POSITION) * b.lr_low + MID_POSITION * b.lr_high, rel=1e-12)
    # Only lr_mid (and its interval) follows the rule; every reading lists all three.
    for m, r in at.items():
        assert (r.lr_low, r.lr_high) == (b.lr_low, b.lr_high) and r.midpoints == b.midpoints
        assert r.lr_mid == r.midpoints[m] and r.lr_mid_ci80[0] < r.lr_mid < r.lr_mid_ci80[1]
        assert r.to_dict()["midpoint"] == m
    assert at["geometric"].lr_mid < at["arithmetic"].lr_mid < at["tuned"].lr_mid
    with pytest.raises(RangefinderError, match="midpoint must be one of"):
        analyze_lr_curve(LINEAR_LR, LINEAR_LOSS, midpoint="harmonic")


def test_a_non_finite_row_between_finite_ones_is_left_out_and_counted_not_the_end_of_the_curve():
    # Issue 36, class 2: an inf at row 5 and a NaN at row 24 of a 60-point sweep. The rows after them were measured:
    # the reading is that of the curve without those two rows, and the report counts them.
    lr = lr_sweep(60)
    y = noisy(U.loss(lr), 0.002, 3)
    clean = analyze_lr_curve(np.delete(lr, [5, 24]), np.delete(y, [5, 24]), seed=3)
    y[5], y[24] = np.inf, np.nan
    b = analyze_lr_curve(lr, y, seed=3)
    check_bounds(b, U)
    assert (b.lr_low, b.lr_high, b.lr_mid, b.quality) == (clean.lr_low, clean.lr_high, clean.lr_mid, clean.quality)
    assert b.points_non_finite == 2 and b.points_dropped == clean.points_dropped + 2
    assert "diverged" not in b.flags
    assert any(a.startswith("2 of 61 rows had a NaN or inf") for a in b.advice)


def test_rows_out_of_order_are_read_in_lr_order():
    # Two halves of one sweep joined in the wrong order (a file assembled by hand): the same bounds as in order.
    lr = lr_sweep(40)
    y = noisy(U.loss(lr), 0.002, 4)
    in_order = analyze_lr_curve(lr, y, seed=4)
    swapped = np.r_[20:lr.size, 0:20]
    b = analyze_lr_curve(lr[swapped], y[swapped], seed=4)
    assert b.status == "ok" and b.reordered and not in_order.reordered
    assert (b.lr_low, b.lr_high, b.lr_mid, b.flags) == (in_order.lr_low, in_order.lr_high, in_order.lr_mid,
                                                         in_order.flags)
    assert any("read sorted by lr" in a for a in b.advice)


def test_shuffled_rows_are_read_as_the_sweep_in_order():
    # The ramp was inferred from the LRs in file order: a shuffled exponential sweep was read as linear, and its
    # lr_mid moved from 1.8e-5 to 3.0e-5. Sorted (and with its LRs each once) it is the sweep it was.
    lr = lr_sweep(40)
    y = noisy(U.loss(lr), 0.002, 5)
    in_order = analyze_lr_curve(lr, y, seed=5)
    shuffled = np.random.default_rng(0).permutation(lr.size)
    b = analyze_lr_curve(lr[shuffled], y[shuffled], seed=5)
    assert b.reordered and b.ramp == in_order.ramp == "exp"
    assert (b.lr_low, b.lr_high, b.lr_mid, b.flags) == (in_order.lr_low, in_order.lr_high, in_order.lr_mid,
                                                         in_order.flags)


def test_rows_at_one_lr_are_read_as_one_point_their_mean():
    """A sweep that holds each LR over 3 validations (a step-wise ramp), or a file whose rows were written twice: rows
    at one lr made the smoother's and the permutation test's differences 0 / 0, which crashed (ZeroDivisionError) or
    read flat noise as rising_from_start at p = 1/300. The rows at each lr are one point, their mean."""
    lr = lr_sweep(40)
    y = noisy(U.loss(lr), 0.002, 0)
    clean = analyze_lr_curve(lr, y)
    twice = analyze_lr_curve(np.repeat(lr, 2), np.repeat(y, 2))
    assert (twice.status, twice.lr_low, twice.lr_mid, twice.lr_high, twice.flags) == (
        clean.status, clean.lr_low, clean.lr_mid, clean.lr_high, clean.flags)
    assert twice.rows_merged == lr.size and clean.rows_merged == 0 and not twice.reordered
    assert any(a.startswith(f"{lr.size} of {2 * lr.size} rows had the lr of another row") for a in twice.advice)
    steps = np.repeat(np.geomspace(1e-7, 1e-2, 15), 3)
    for seed in range(4):
        check_bounds(analyze_lr_curve(steps, noisy(U.loss(steps), 0.002, seed), seed=seed), U, tol=0.3)
        flat = analyze_lr_curve(steps, noisy(np.full(steps.size, 0.2), 0.002, seed), seed=seed)
        assert flat.status == "no_descent" and flat.p_descent > 0.05 and math.isfinite(flat.noise_sigma)
