"""Reading curve CSVs, the smoother and the noise estimate, on real files and formula curves."""

import numpy as np
import pytest

from rangefinder.analysis.curves import divergence_cut, infer_ramp, lowess, noise_sigma, read_curve_csv, rise_cut
from rangefinder.errors import RangefinderError


def test_read_curve_csv_empty_cells_and_skips(tmp_path):
    p = tmp_path / "metrics.csv"
    p.write_text("update,epoch,lr,train_loss,val_loss,stabilize_loss\n0,0,0,,0.2,\n5,0.5,1e-6,0.3,nan,0.1\n"
                 "10,1,2e-6,0.3,,0.1\n")
    c = read_curve_csv(p, skip_empty=("val_loss",))
    assert c["update"].tolist() == [0, 5]  # the row without val_loss was not measured there
    assert np.isnan(c["train_loss"][0]) and np.isnan(c["val_loss"][1])  # empty vs a written nan: both NaN


@pytest.mark.parametrize(
    "text, needle",
    [(None, "does not exist"), ("", "is empty"), ("update,lr\n0,0\n", "no val_loss column"),
     ("update,val_loss\n0,0.2,7\n", "line 2 has 3 cells"), ("update,val_loss\n0,abc\n", "'abc' is not a number")],
)
def test_read_curve_csv_bad_input(tmp_path, text, needle):
    p = tmp_path / "m.csv"
    if text is not None:
        p.write_text(text)
    with pytest.raises(RangefinderError, match=needle):
        read_curve_csv(p)


def test_infer_ramp():
    assert infer_ramp(np.concatenate([[0], np.geomspace(1e-7, 1e-2, 12)])) == "exp"
    assert infer_ramp(np.concatenate([[0], np.linspace(1e-4, 1e-3, 10)])) == "linear"


def test_lowess_is_centred_and_exact_on_polynomials():
    x = np.linspace(-3, 3, 25)
    line, parabola = 2 * x + 1, 0.3 * x**2 + x
    assert np.allclose(lowess(x, line, 7).fitted, line)
    assert np.allclose(lowess(x, parabola, 7, degree=2).fitted, parabola)
    assert np.allclose(lowess(x, parabola, 7, degree=2).slope, 0.6 * x + 1)
    # No lag: a step smoothed by a centred smoother crosses its midpoint at the step, not after it.
    step = np.where(x < 0, 1.0, 0.0)
    f = lowess(x, step, 7).fitted
    assert abs(np.interp(0.5, f[::-1], x[::-1])) < 0.15
    # Batched fits equal one-by-one fits, and the kernel reproduces the fit.
    y = np.random.default_rng(0).standard_normal((3, 25))
    b = lowess(x, y, 9, degree=2, kernels=False)
    for i in range(3):
        one = lowess(x, y[i], 9, degree=2)
        assert np.allclose(b.fitted[i], one.fitted) and np.allclose(one.kernel @ y[i], one.fitted)


def test_lowess_ignores_a_spike():
    x = np.arange(30.0)
    y = 0.01 * x
    y[15] += 5.0
    assert abs(lowess(x, y, 9).fitted[15] - 0.15) < 0.02


def test_noise_sigma_ignores_trend():
    x = np.linspace(0, 1, 400)
    rng = np.random.default_rng(1)
    y = np.sin(6 * x) + 0.05 * rng.standard_normal(400)
    assert 0.04 < float(noise_sigma(x, y)) < 0.06


# Flat to within 1e-6, then a fall over the last three points: a near noiseless range test sampled coarser than its
# knee (the LoRA curve in test_lr_bounds.py, log-LR steps of 1.2).
KNEE_X = np.arange(10) * 1.2
KNEE_Y = np.array([0, -1e-6, -3e-6, -1.2e-5, -4.1e-5, -1.4e-4, -4.9e-4, -1.8e-3, -7.1e-3, -2.66e-2]) + 0.184


def test_lowess_does_not_set_a_sharp_knee_aside():
    # The flat part fits to ~1e-6, so the whole fall lies beyond 6 MADs; a robust fit that drops it reads flat.
    for span, degree in ((4, 1), (5, 1), (5, 2)):
        f = lowess(KNEE_X, KNEE_Y, span, degree=degree).fitted
        assert abs(f[-1] - KNEE_Y[-1]) < 0.005 and np.all(np.abs(f - KNEE_Y) < 0.006), (span, degree, f - KNEE_Y)


def test_noise_sigma_trims_a_sharp_knee():
    # The bend's 2-3 pseudo-residuals are hundreds of times the others; they are not noise.
    assert float(noise_sigma(KNEE_X, KNEE_Y)) < 2e-4
    assert float(noise_sigma(KNEE_X, KNEE_Y, trim_gross=False)) > 5e-4
    # On plain noise both agree.
    x, y = np.arange(40.0), np.random.default_rng(3).standard_normal(40)
    assert float(noise_sigma(x, y)) == pytest.approx(float(noise_sigma(x, y, trim_gross=False)))


def test_rise_cut_looks_for_the_climb_after_the_minimum():
    # A noise blip above the start on the flat part (index 3) is no climb; the climb after the minimum is.
    y = np.array([0.2, 0.2001, 0.1999, 0.2002, 0.19, 0.18, 0.17, 0.21, 0.5])
    assert rise_cut(y, 6) == 7
    assert rise_cut(y, 8) == y.size  # too short a prefix: read whole
    assert rise_cut(np.array([0.2, 0.21, 0.3, 0.5]), 2) == 4  # never below the start


def test_divergence_cut_cuts_an_exploded_tail_not_a_lone_spike():
    # Above 4x the best before it from index 4 to the end: the explosion. A spike followed by a normal point is a
    # failed measurement among good ones, and the points after it are kept.
    assert divergence_cut(np.array([0.2, 0.19, 0.18, 0.17, 0.9, 3.0, 40.0]), 4.0) == 4
    assert divergence_cut(np.array([0.2, 0.19, 0.18, 0.9, 0.17, 0.16]), 4.0) == 6
    assert divergence_cut(np.array([0.2, 0.19, 0.18, 0.9, 0.17, 0.8, 0.9]), 4.0) == 5
