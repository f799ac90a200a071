"""The step window on constant-run curves built from formulas (clear U, still improving, flat)."""

import numpy as np
import pytest

from rangefinder.analysis import delivered_checkpoint, earliest_tied, select_step_window
from rangefinder.analysis.synthetic import ConstantRunShape, noisy, true_step_window
from rangefinder.errors import RangefinderError

EPOCHS = np.arange(61) / 2  # 30 epochs, validated twice per epoch
UPDATES = EPOCHS * 10  # 10 updates per epoch


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clear_u(seed):
    shape = ConstantRunShape()  # falls with tau 3 epochs, overfits from epoch 12
    best, start, end = true_step_window(shape, 30, 0.02)
    w = select_step_window(UPDATES, EPOCHS, noisy(shape.loss(EPOCHS), 0.001, seed),
                           stabilize_loss=shape.loss(EPOCHS) - 0.01)
    assert w.status == "ok"
    assert abs(w.window_start_epoch - start) <= 1.5 and abs(w.window_end_epoch - end) <= 1.5
    assert start - 1 <= w.recommended_epochs <= end + 1
    assert abs(w.best_epoch - best) <= 3
    assert "rose_after_min" in w.flags
    assert w.val_minus_stabilize == pytest.approx(0.01, abs=0.003)
    assert w.recommended_updates == 10 * w.recommended_epochs


@pytest.mark.parametrize(("images", "batch_size", "grad_accum"), [(16, 4, 1), (10, 4, 1), (10, 4, 2)])
def test_the_recommended_updates_are_what_the_recommended_epochs_train(images, batch_size, grad_accum):
    """The report said "73 epochs (about 293 updates)": the window's unrounded centre in updates, where 73 epochs at 4
    updates per epoch are 292. The updates are the engine's count for the recommended whole epochs (planning.plan:
    a partial last update rounded up), read off the run's own update-epoch line; also past its last row, where a
    still-improving run that ended mid-epoch recommends the epoch it was in."""
    from rangefinder.planning import plan

    per_epoch = images / (batch_size * grad_accum)  # updates per epoch: 4, 2.5, 1.25

    def trains(n_epochs):
        return plan(images, batch_size=batch_size, grad_accum=grad_accum, epochs=n_epochs).total_updates

    for seed in range(3):
        w = select_step_window(EPOCHS * per_epoch, EPOCHS, noisy(ConstantRunShape().loss(EPOCHS), 0.001, seed))
        assert w.status == "ok"
        assert w.recommended_updates == trains(w.recommended_epochs), (seed, w.recommended_epochs)
    inside = EPOCHS[:-1]  # the last validation at epoch 29.5
    still = select_step_window(inside * per_epoch, inside,
                               noisy(ConstantRunShape(tau=30, rise=0.0).loss(inside), 0.001, 0))
    assert still.status == "still_improving" and still.recommended_epochs == 30
    assert still.recommended_updates == trains(30) > 29.5 * per_epoch


def test_still_improving():
    shape = ConstantRunShape(tau=30, rise=0.0)
    w = select_step_window(UPDATES, EPOCHS, noisy(shape.loss(EPOCHS), 0.001, 0))
    assert w.status == "still_improving"
    assert w.recommended_epochs >= 30 and w.window_end_epoch == pytest.approx(30)
    # Longer, or higher: in the discovery bench such runs mostly trained below the grid's best LR.
    (advice,) = [a for a in w.advice if a.startswith("Still improving")]
    assert "more epochs" in advice and "try lr_high" in advice


def test_the_window_s_edges_are_interpolated_and_the_recommendation_is_its_centre_in_whole_epochs():
    """On a noiseless curve validated every half epoch the window's edges are where the smoothed curve crosses the
    level, between validations (within a tenth of an epoch of the formula's), and the recommended length is the
    window's centre rounded to whole epochs (10.9 -> 11), not the minimum's epoch (12.5) nor the centre rounded down."""
    shape = ConstantRunShape(overfit_from=13.0)
    _, start, end = true_step_window(shape, 30, 0.02)
    w = select_step_window(UPDATES, EPOCHS, shape.loss(EPOCHS))
    assert w.status == "ok"
    assert abs(w.window_start_epoch - start) <= 0.1 and abs(w.window_end_epoch - end) <= 0.1
    centre = 0.5 * (w.window_start_epoch + w.window_end_epoch)
    assert centre % 1 > 0.5 and abs(w.best_epoch - centre) > 1
    assert w.recommended_epochs == round(centre) and w.recommended_updates == 10 * w.recommended_epochs


def test_a_noisy_curve_s_window_is_at_least_two_standard_errors_tall():
    """With a tolerance far below the noise, the band is two standard errors of the smoothed minimum, not the
    tolerance: a window a noise-wide minimum wanders in, not a point."""
    y = noisy(ConstantRunShape().loss(EPOCHS), 0.003, 0)
    w = select_step_window(UPDATES, EPOCHS, y, tolerance=0.001)
    assert w.status == "ok" and w.band > 5 * 0.001 * w.best_val_loss
    assert w.window_end_epoch - w.window_start_epoch > 2


def test_a_curve_that_flattens_is_rarely_called_rising_after_its_minimum():
    """The smoothed curve wanders with the noise after its minimum; a rise must pass the band and two standard errors
    of the end's difference from the minimum. A curve that never rises was flagged at any wiggle above the band
    (6 of 10 here)."""
    shape = ConstantRunShape(rise=0.0)
    flagged = sum("rose_after_min" in select_step_window(UPDATES, EPOCHS, noisy(shape.loss(EPOCHS), 0.004, s),
                                                         seed=s).flags for s in range(10))
    assert flagged <= 2


def test_flat():
    w = select_step_window(UPDATES, EPOCHS, noisy(np.full(EPOCHS.shape, 0.2), 0.001, 0))
    assert w.status == "no_improvement" and w.recommended_epochs is None and w.window_start_epoch is None


def test_flat_rarely_improves():
    e = EPOCHS[::2]  # once per epoch keeps this quick
    ok = sum(select_step_window(10 * e, e, noisy(np.full(e.shape, 0.2), 0.001, s), seed=s).status != "no_improvement"
             for s in range(60))
    assert ok <= 2


def test_epochs_missing_are_interpolated_and_nan_cut():
    shape = ConstantRunShape()
    y = noisy(shape.loss(EPOCHS), 0.001, 0)
    y[-3:] = np.nan
    e = EPOCHS.copy()
    e[5:10] = np.nan
    w = select_step_window(UPDATES, e, y)
    assert w.status == "ok" and "diverged" in w.flags and w.points_dropped == 3
    assert w.best_epoch == pytest.approx(w.best_update / 10)


def test_bad_input():
    with pytest.raises(RangefinderError, match="tolerance"):
        select_step_window([0, 1, 2], [0, 1, 2], [1, 1, 1], tolerance=2)
    with pytest.raises(RangefinderError, match="at least 3"):
        select_step_window([0, 1, 2], [0, 1, 2], [1, np.nan, np.nan])
    with pytest.raises(RangefinderError, match=r"^seed must be a whole number of 0 or more \(got -1\)"):
        select_step_window([0, 1, 2], [0, 1, 2], [1, 0.9, 0.8], seed=-1)
    with pytest.raises(RangefinderError, match=r"^epoch must be numbers, one per row"):
        select_step_window([0, 1, 2], ["0", "1", "two"], [1, 0.9, 0.8])
    with pytest.raises(RangefinderError, match=r"^divergence_factor must be above 1, .* \(got -1\)$"):
        select_step_window([0, 1, 2], [0, 1, 2], [1, 0.9, 0.8], divergence_factor=-1)


def test_shuffled_rows_and_a_nan_inside_read_like_the_clean_curve():
    # Issue 36, class 2: rows in a random order, with a NaN at update 100 (epoch 10): the window of the clean curve
    # without that row, the row counted, no "diverged".
    shape = ConstantRunShape()
    y = noisy(shape.loss(EPOCHS), 0.001, 5)
    clean = select_step_window(np.delete(UPDATES, 20), np.delete(EPOCHS, 20), np.delete(y, 20), seed=5)
    y[20] = np.nan
    order = np.random.default_rng(5).permutation(EPOCHS.size)
    w = select_step_window(UPDATES[order], EPOCHS[order], y[order], seed=5)
    assert w.status == "ok" and w.reordered and w.points_non_finite == 1 and w.flags == clean.flags
    assert (w.window_start_update, w.window_end_update, w.recommended_epochs) == (
        clean.window_start_update, clean.window_end_update, clean.recommended_epochs)
    assert "diverged" not in w.flags


def test_a_long_curve_is_read_as_means_of_consecutive_rows():
    from rangefinder.analysis.curves import MAX_CURVE_POINTS

    epochs = np.linspace(0, 30, 4 * MAX_CURVE_POINTS + 7)
    w = select_step_window(epochs * 10, epochs, noisy(ConstantRunShape().loss(epochs), 0.001, 0))
    assert w.status == "ok" and w.rows_per_point == 5 and w.points_used == epochs.size
    best, start, end = true_step_window(ConstantRunShape(), 30, 0.02)
    assert start - 1.5 <= w.recommended_epochs <= end + 1.5


def _window(start, end, rec):
    from types import SimpleNamespace

    return SimpleNamespace(window_start_update=start, window_end_update=end, recommended_updates=rec)


def delivered_update_of(window, checkpoint_updates, update, val_loss):
    picked = delivered_checkpoint(window, checkpoint_updates, update, val_loss)
    return None if picked is None else picked.update


def test_the_delivered_checkpoint_is_the_lowest_validation_loss_inside_the_window():
    """A LoRA-like scatter: the checkpoint nearest the centre (update 12) is not the best one inside the window
    (8, or 16 once 8 is outside); a still lower point outside the window (update 4) is not a length it allows."""
    update = [4, 8, 12, 16, 20, 24]
    val = [0.050, 0.080, 0.090, 0.082, 0.085, 0.120]
    assert delivered_update_of(_window(7.0, 21.0, 12), [4, 8, 12, 16, 20, 24], update, val) == 8
    assert delivered_update_of(_window(9.0, 21.0, 14), [4, 8, 12, 16, 20, 24], update, val) == 16
    # Equal losses: the one nearest the recommended update, then the earlier.
    flat = [0.05, 0.08, 0.08, 0.08, 0.08, 0.1]
    assert delivered_update_of(_window(7.0, 21.0, 15), [8, 12, 16, 20], update, flat) == 16


def test_past_the_last_row_the_updates_follow_the_whole_line_not_its_last_step():
    """Two aspect-ratio buckets of 5 images at batch 4: an epoch is micro-batches of 4, 1, 4 and 1 images, so a run that
    stopped after its second (epoch 0.5) took its last step on one image. One epoch is the 4 updates the whole line
    gives, not the 7 of that last step's pace."""
    from rangefinder.analysis.step_window import updates_for_epochs

    assert updates_for_epochs([0, 1, 2], [0.0, 0.4, 0.5], 1) == 4


def test_without_a_validated_checkpoint_inside_the_window_the_nearest_one_is_delivered():
    # Checkpoints every 6 updates, validation every 4: none of them was validated inside the window [7, 11].
    assert delivered_update_of(_window(7.0, 11.0, 9), [6, 12, 18], [4, 8, 12], [0.1, 0.2, 0.3]) == 6
    assert delivered_update_of(_window(7.0, 11.0, 10), [6, 12, 18], [4, 8, 12], [0.1, 0.2, 0.3]) == 12
    # A NaN loss is no measurement.
    assert delivered_update_of(_window(7.0, 13.0, 7), [8, 12], [8, 12], [0.2, float("nan")]) == 8
    # Nor is the nearest checkpoint one whose own validation came out NaN: it failed its measurement (it was delivered
    # with no loss, as if never validated).
    assert delivered_update_of(_window(9.0, 13.0, 11), [8, 12], [8, 12], [0.2, float("nan")]) == 8
    assert delivered_update_of(_window(9.0, 13.0, 11), [8, 12, 16], [8, 12], [0.2, float("inf")]) == 8
    assert delivered_update_of(_window(7.0, 13.0, 10), [], [8, 12], [0.2, 0.1]) is None


def test_with_a_window_the_rule_is_named_and_the_base_model_is_the_curve_s_update_0():
    update, val = [0, 4, 8, 12], [0.09, 0.05, 0.04, 0.06]
    picked = delivered_checkpoint(_window(3.0, 13.0, 8), [4, 8, 12], update, val)
    assert (picked.update, picked.rule, picked.val_loss, picked.base_val_loss) == (8, "window_lowest", 0.04, 0.09)
    assert picked.improved_on_base is True
    nearest = delivered_checkpoint(_window(7.0, 11.0, 10), [6, 12], update, val)
    assert (nearest.update, nearest.rule) == (12, "window_nearest")
    # A loss equal to the base model's is no improvement on it.
    same = delivered_checkpoint(_window(3.0, 13.0, 8), [4, 8, 12], update, [0.04, 0.05, 0.04, 0.06])
    assert same.update == 8 and same.improved_on_base is False and "did not improve" in same.sentence()
    # No update 0 on the curve: the comparison with the base is unknown, not made up.
    assert delivered_checkpoint(_window(3.0, 13.0, 8), [4, 8], update[1:], val[1:]).improved_on_base is None


def test_earliest_tied_is_the_first_checkpoint_within_one_percent_of_the_lowest_measured():
    """finetune.deliver: earliest_tied (bench/RESULTS.md, "Textual inversion's earliest tied checkpoint"): of the
    checkpoints validated at their own update, the earliest within 1 % of the band's target; never the base model
    (update 0), never a checkpoint without its own measurement, and none when the band holds no checkpoint."""
    update = [0, 2, 4, 6, 8, 10, 12]
    val = [0.0990, 0.1050, 0.1009, 0.1012, 0.1000, 0.1003, 0.1020]
    pick = delivered_checkpoint(_window(5.0, 11.0, 8), [2, 4, 6, 8, 10, 12], update, val)
    assert (pick.update, pick.rule) == (8, "window_lowest")
    tied = earliest_tied([2, 4, 6, 8, 10, 12], update, val, pick.val_loss)
    assert (tied.update, tied.rule, tied.val_loss, tied.base_val_loss) == (4, "earliest_tied", 0.1009, 0.0990)
    assert "within 1% of the lowest" in tied.sentence() and "not below the base model's" in tied.sentence()
    # Exactly on the band's edge ties; just above it does not.
    edge = [0.25, 0.2526, 0.2525, 0.25, 0.25, 0.25, 0.25]
    assert earliest_tied([2, 4, 8], update, edge, 0.25).update == 4
    # Update 0 (the base model, lower than every checkpoint here) is not delivered; a checkpoint between validations
    # (update 5) has no loss of its own.
    assert earliest_tied([0, 5, 10], update, val, pick.val_loss).update == 10
    # A target far below every checkpoint (a window average 5 % lower): no checkpoint is tied, the usual rule stands.
    assert earliest_tied([2, 4, 6, 8, 10, 12], update, val, 0.095) is None


def test_without_a_window_the_lowest_validation_loss_of_the_whole_run_is_delivered_not_the_final_weights():
    """bench/RESULTS.md, "Versus": LoRA stripes 0 found no window and delivered its final weights, worse than the base
    model; the run's lowest-loss checkpoint was below the base. Ties: the earlier."""
    update = [0, 4, 8, 12, 16, 20]
    val = [0.0559, 0.0547, 0.0542, 0.0545, 0.0542, 0.0580]
    picked = delivered_checkpoint(_window(None, None, None), [4, 8, 12, 16, 20], update, val)
    assert (picked.update, picked.rule, picked.val_loss) == (8, "run_lowest", 0.0542)
    assert picked.improved_on_base is True and "below the base model's 0.0559" in picked.sentence()
    # Every checkpoint worse than the base: still the lowest one, and the sentence says the fine-tune did not help.
    worse = delivered_checkpoint(_window(None, None, None), [4, 8], [0, 4, 8], [0.05, 0.07, 0.06])
    assert (worse.update, worse.improved_on_base) == (8, False)
    assert "did not improve on the base model" in worse.sentence() and "no step window" in worse.sentence()
    # The base model (update 0) is never a checkpoint to deliver, and an unvalidated checkpoint is no measurement.
    assert delivered_checkpoint(_window(None, None, None), [0, 6], [0, 4], [0.01, 0.02]) is None
    assert delivered_checkpoint(_window(None, None, None), [], [0, 4], [0.01, 0.02]) is None


def test_rows_at_one_update_are_read_as_one_point_their_mean():
    """Rows written twice (a file joined with a copy of its tail) made the smoother's and the permutation test's
    differences 0 / 0: flat noise read as a window at p = 1/300 (an "ok" recommendation of what never improved), and
    the noise as NaN. The rows at each update are one point, their mean: the clean curve's window."""
    shape = ConstantRunShape()
    y = noisy(shape.loss(EPOCHS), 0.001, 0)
    clean = select_step_window(UPDATES, EPOCHS, y)
    rows = np.r_[0:41, 20:61]  # rows 20-40 twice
    w = select_step_window(UPDATES[rows], EPOCHS[rows], y[rows])
    assert (w.status, w.window_start_update, w.window_end_update, w.recommended_epochs, w.noise_sigma) == (
        clean.status, clean.window_start_update, clean.window_end_update, clean.recommended_epochs, clean.noise_sigma)
    assert w.rows_merged == 21 and any(a.startswith("21 of 82 rows had the update of another row") for a in w.advice)
    for seed in range(4):
        for times in (2, 3):
            e = np.repeat(EPOCHS[::3], times)
            flat = select_step_window(10 * e, e, noisy(np.full(e.shape, 0.2), 0.001, seed), seed=seed)
            assert flat.status == "no_improvement" and flat.recommended_epochs is None, (seed, times)
            assert np.isfinite(flat.noise_sigma)


def test_a_curve_at_fewer_than_3_updates_is_refused():
    # The window average's metrics.csv holds its measurements all at update 0: "no_improvement: this LR does not help"
    # said of a curve with no length.
    with pytest.raises(RangefinderError, match=r"1 distinct update value \(0\); the step window needs validations"):
        select_step_window([0, 0, 0, 0], [0, 0, 0, 0], [0.2, 0.19, 0.21, 0.2])
    with pytest.raises(RangefinderError, match=r"2 distinct update values \(0, 10\)"):
        select_step_window([0, 10, 10, 0], None, [0.2, 0.19, 0.21, 0.2])


def test_the_window_s_words_give_a_tolerance_that_is_no_whole_percent_as_it_is():
    """chosen.json's reason (analysis.step_window.within_words) gave the tolerance rounded to a whole percent: a
    finetune.tolerance of 0.005 read "within 0% of its minimum", and 0.025 widened by the noise "the 2% tolerance"."""
    from rangefinder.analysis.step_window import band_widened, within_words

    shape = ConstantRunShape()
    clean = select_step_window(UPDATES, EPOCHS, noisy(shape.loss(EPOCHS), 1e-6, 0), tolerance=0.005)
    assert clean.status == "ok" and not band_widened(clean)
    assert within_words(clean) == "within 0.5% of its minimum"
    widened = select_step_window(UPDATES, EPOCHS, noisy(shape.loss(EPOCHS), 0.02, 0), tolerance=0.025)
    assert band_widened(widened)
    assert "(the 2.5% tolerance widened to 2 standard errors" in within_words(widened), within_words(widened)
