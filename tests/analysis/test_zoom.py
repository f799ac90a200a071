"""The zoom decision: the range of a second LR range test, from the first curve's reading."""

from __future__ import annotations

import pytest

from rangefinder.analysis.zoom import ZOOM_EXTEND, ZOOM_MARGIN, ended_above_start, points_between, zoom_range


def test_points_between_counts_inclusive():
    assert points_between([0.0, 1e-5, 1e-4, 1e-3, 1e-2], [0.2, 0.2, 0.19, 0.17, 0.18], 1e-4, 1e-3) == 2
    assert points_between([1e-5], [0.2], None, 1e-3) == 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_nan_or_inf_row_between_the_bounds_is_no_point_for_the_zoom(bad):
    """points_between counted every row whose LR lay between the bounds, a NaN or inf validation among them: a curve
    with 4 measurements inside, one short of lr_range_test.zoom_min_points (5), read as having enough and was not
    zoomed. The reading itself leaves such a row out (points_non_finite)."""
    from rangefinder.analysis import analyze_lr_curve
    from rangefinder.analysis.synthetic import RangeTestShape, lr_sweep, noisy

    shape = RangeTestShape(base=0.2, drop=0.04, lr_fall=1e-4, fall_width=0.5, rise=0.05, lr_rise=3e-3)
    lr = lr_sweep(20, 1e-6, 1e-2)
    clean = noisy(shape.loss(lr), 0.001, seed=1)
    b = analyze_lr_curve(lr, clean, ramp="exp", bootstrap=20)
    inside = [i for i, x in enumerate(lr) if b.lr_low <= x <= b.lr_high]
    # The clean curve: 5 measurements between its bounds, enough; no zoom (as before).
    assert b.status == "ok" and points_between(lr, clean, b.lr_low, b.lr_high) == len(inside) == 5
    assert zoom_range(b.status, b.flags, b.lr_low, b.lr_high, 1e-6, 1e-2, 5, min_points=5) is None

    y = clean.copy()
    y[inside[2]] = bad
    b = analyze_lr_curve(lr, y, ramp="exp", bootstrap=20)
    assert b.status == "ok" and b.points_non_finite == 1
    assert [i for i, x in enumerate(lr) if b.lr_low <= x <= b.lr_high] == inside  # the same rows between the bounds
    n = points_between(lr, y, b.lr_low, b.lr_high)
    assert n == 4
    zoom = zoom_range(b.status, b.flags, b.lr_low, b.lr_high, 1e-6, 1e-2, n, min_points=5)
    assert zoom == pytest.approx((b.lr_low / ZOOM_MARGIN, b.lr_high * ZOOM_MARGIN))


@pytest.mark.parametrize("status, flags, low, high, n, expect", [
    ("ok", [], 1e-4, 1e-2, 6, None),                                    # readable: no zoom
    ("ok", [], 1e-4, 1e-3, 2, (1e-4 / 3, 1e-3 * 3)),                  # too few points: widen the bounds a little
    ("ok", ["upper_censored"], 1e-4, 1.0, 9, (1e-4 / 3, 1.0 * ZOOM_EXTEND)),  # still falling at the top
    ("ok", ["lower_censored"], 1e-5, 1e-3, 9, (1e-5 / ZOOM_EXTEND, 1e-3 * 3)),
    ("rising_from_start", [], None, None, 0, (1e-5 / 100, 1e-5)),
    ("no_descent", [], None, None, 0, (1e-5, 10.0)),
])
def test_zoom_range(status, flags, low, high, n, expect):
    got = zoom_range(status, flags, low, high, 1e-5, 1.0, n, min_points=5)
    if expect is None:
        assert got is None
    else:
        assert got == pytest.approx(expect)
        assert got[0] < got[1]


def test_zoom_on_divergence_stays_below_the_blow_up():
    lo, hi = zoom_range("diverged", ["diverged"], None, None, 1e-6, 1.0, 0, 5)
    assert lo < hi <= 1.0 / 100
    # A sweep of one decade (a zoomed one): two decades below its top lie below its bottom, so the second sweep runs
    # from a decade below the bottom to a decade above it, never to a top under its bottom.
    assert zoom_range("diverged", ["diverged"], None, None, 1e-4, 1e-3, 0, 5) == pytest.approx((1e-5, 1e-3))


def test_too_few_points_widen_the_bounds_no_lower_than_a_decade_below_the_sweep():
    # A linear sweep's lr_low may be its baseline, lr 0 (or just above it): a third of it would start the second
    # sweep at 0 (or far below the first); it starts a decade below lr_min at the lowest.
    assert zoom_range("ok", [], 0.0, 1e-4, 1e-5, 1e-3, 2, min_points=5) == pytest.approx((1e-6, 3e-4))
    assert zoom_range("ok", [], 1e-7, 1e-4, 1e-5, 1e-3, 2, min_points=5) == pytest.approx((1e-6, 3e-4))


def test_zoom_after_a_descent_that_blew_up_goes_below_the_blow_up():
    lo, hi = zoom_range("diverged", ["diverged"], None, None, 1e-5, 0.1, 0, 5, lr_at_min=8e-4)
    assert (lo, hi) == pytest.approx((1e-5, 8e-3))


def test_zoom_after_a_blow_up_never_repeats_the_first_sweep():
    # LoRA `stripes` seed 4 (bench.versus, 2026-11-27): 12 noisy points over 1e-6..1, lowest at 0.28, then the
    # blow-up. Widening a decade from 0.28 was 1e-6..1 again: the same deterministic sweep, the same failure.
    lo, hi = zoom_range("diverged", ["diverged"], None, None, 1e-6, 1.0, 0, 5, lr_at_min=0.2848)
    assert (lo, hi) != pytest.approx((1e-6, 1.0))
    assert (lo, hi) == pytest.approx((1e-7, 1e-2))  # the decades below, as the error tells a user to do


def test_no_descent_that_ended_worse_zooms_down_not_up():
    # The stripes case of bench/discovery_quality: a dip too shallow for the test, then the top LRs made the model
    # worse. Widening upwards found only the blow-up; the descent lies below the lowest point.
    lo, hi = zoom_range("no_descent", [], None, None, 1e-5, 1e-2, 0, 5, lr_at_min=5e-4, rose_at_top=True)
    assert (lo, hi) == pytest.approx((1e-6, 5e-4 * ZOOM_MARGIN))
    # No interior minimum: the whole sweep was too high.
    lo, hi = zoom_range("no_descent", [], None, None, 1e-5, 1e-2, 0, 5, lr_at_min=1e-5, rose_at_top=True)
    assert lo == pytest.approx(1e-6) and hi == pytest.approx(1e-5)


def test_ended_above_start():
    assert ended_above_start([0.10, 0.099, 0.098, 0.11, 0.13, 0.2])
    assert not ended_above_start([0.10, 0.099, 0.098, 0.097, 0.0975, 0.0972])
    # One spike at the end is not the end of the sweep.
    assert not ended_above_start([0.10, 0.099, 0.098, 0.097, 0.096, 0.3])
    assert not ended_above_start([0.10, float("nan")])
    # A curve that did not move at all (the same losses to the bit) did not end above its start: zoom up, not down.
    assert not ended_above_start([0.10] * 6)


# A real first range test (bench/discovery_quality on the tiny model of BUILDER_VERSION 3, `textures` seed 1, 6
# epochs 1e-5..1e-2, validating every 2 updates): the loss dips for four points, to its lowest at 8.2e-5, then climbs
# far above its start. Too few points before the climb for the rise cut, so the reading is rising_from_start.
TEXTURES1_LR = [0.0, 1.35e-05, 2.46e-05, 4.49e-05, 8.19e-05, 1.49e-04, 2.72e-04, 4.96e-04, 9.05e-04, 1.65e-03,
                3.01e-03, 5.48e-03, 1.0e-02]
TEXTURES1_LOSS = [0.07120, 0.07020, 0.06861, 0.06675, 0.06529, 0.06804, 0.07600, 0.07666, 0.07947, 0.09070, 0.10309,
                  0.20390, 0.22862]


def test_a_dip_too_narrow_to_read_zooms_onto_the_dip_not_below_the_sweep():
    from rangefinder.analysis import analyze_lr_curve

    b = analyze_lr_curve(TEXTURES1_LR, TEXTURES1_LOSS, ramp="exp", bootstrap=20)
    assert b.status == "rising_from_start" and b.lr_at_min is not None and 1e-5 < b.lr_at_min < 1e-2
    lo, hi = zoom_range(b.status, b.flags, b.lr_low, b.lr_high, 1e-5, 1e-2, 0, 5, lr_at_min=b.lr_at_min)
    # The whole dip (1.35e-5 .. 1.5e-4) lies inside the second sweep; before, it went to 1e-7 .. 1e-5, all below it.
    assert lo == pytest.approx(1e-6) and hi == pytest.approx(b.lr_at_min * ZOOM_MARGIN)
    assert lo < 1.35e-5 and hi > 1.49e-4
