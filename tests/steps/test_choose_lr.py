"""The decision step: bounds checked and written down; a fixed LR collapses the bounds."""

from __future__ import annotations

import pytest

from rangefinder.config import demo_config
from rangefinder.errors import RangefinderError
from rangefinder.steps.choose_lr import run_choose_lr


def test_fixed_lr_and_decision_file(tmp_path):
    out = tmp_path / "decision.md"
    c = run_choose_lr(demo_config(), source="fixed", lr_low=3e-4, lr_high=3e-4, lr_mid=3e-4, decision_path=out)
    assert (c.lr_low, c.lr_mid, c.lr_high, c.source) == (3e-4, 3e-4, 3e-4, "fixed")
    text = out.read_text()
    assert "0.0003" in text and "fixed by hand" in text


@pytest.mark.parametrize("low, mid, high, match", [
    (1e-3, 1e-4, 1e-2, "out of order"),
    (0.0, 1e-4, 1e-2, "lr_low = 0.0"),
    (1e-4, float("nan"), 1e-2, "lr_mid = nan"),
])
def test_bad_bounds_are_refused(low, mid, high, match):
    with pytest.raises(RangefinderError, match=match):
        run_choose_lr(demo_config(), source="range-test", lr_low=low, lr_high=high, lr_mid=mid)


def test_unknown_source():
    with pytest.raises(RangefinderError, match="source must be one of"):
        run_choose_lr(demo_config(), source="guess", lr_low=1e-4, lr_high=1e-3, lr_mid=3e-4)


def test_prodigy_step_collapses_the_bounds_onto_the_step_size_and_says_where_it_came_from(tmp_path):
    from rangefinder.steps.halving import halving_applies

    cfg = demo_config(lr_finder="prodigy_step", lr_range_test={"lr_min": None, "lr_max": None})
    out = tmp_path / "decision.md"
    c = run_choose_lr(cfg, source="prodigy-step", lr_low=2.5e-4, lr_high=2.5e-4, lr_mid=2.5e-4, decision_path=out,
                      updates=120)
    assert (c.lr_low, c.lr_mid, c.lr_high, c.source) == (2.5e-4, 2.5e-4, 2.5e-4, "prodigy-step")
    text = out.read_text()
    assert "read off a Prodigy run's final step size d x lr = 0.00025, 120 updates (lr_finder: prodigy_step)" in text
    assert "one constant LR, no successive halving" in text
    # The fine-tune's halving has nothing to race at one LR.
    assert not halving_applies(True, True, "constant", c.lr_mid, c.lr_high)
    with pytest.raises(RangefinderError, match="prodigy-step source gives one LR"):
        run_choose_lr(cfg, source="prodigy-step", lr_low=1e-4, lr_high=1e-3, lr_mid=2e-4)


def test_prodigy_step_under_auto_says_what_auto_resolved_to_for_the_model(tmp_path, tiny_sd3_dir):
    cfg = demo_config(lr_finder="auto", lr_range_test={"lr_min": None, "lr_max": None},
                      model={"base_model": str(tiny_sd3_dir)}, training={"method": "lora"})
    out = tmp_path / "decision.md"
    run_choose_lr(cfg, source="prodigy-step", lr_low=3e-3, lr_high=3e-3, lr_mid=3e-3, decision_path=out)
    assert ("d x lr = 0.003 (lr_finder: auto, which measures lora on Stable Diffusion 3/3.5 with "
            "prodigy_step)") in out.read_text()


def test_prodigy_step_on_sdxl_full_says_the_step_size_and_the_factor_it_was_trained_at(tmp_path, tiny_sdxl_dir):
    """SDXL's full fine-tune trains at 4x the step size (config.PRODIGY_STEP_FACTOR): the decision names both."""
    cfg = demo_config(lr_finder="auto", lr_range_test={"lr_min": None, "lr_max": None},
                      model={"base_model": str(tiny_sdxl_dir)})
    out = tmp_path / "decision.md"
    run_choose_lr(cfg, source="prodigy-step", lr_low=1e-3, lr_high=1e-3, lr_mid=1e-3, decision_path=out, updates=12,
                  factor=4.0)
    assert ("final step size d x lr = 0.00025, 12 updates, times 4 = 0.001 (full on this family trains at 4 times "
            "the step size: config.PRODIGY_STEP_FACTOR) (lr_finder: auto, which measures full on Stable Diffusion "
            "XL with prodigy_step)") in out.read_text()


def test_the_decision_names_the_factor_the_step_applied_not_one_it_derives_again(tmp_path):
    """The factor comes from the prodigy-step-size step's output (ProdigyStep.factor): the text says what was applied,
    whatever the family; a factor that is not a positive number is one error."""
    cfg = demo_config(lr_finder="prodigy_step", lr_range_test={"lr_min": None, "lr_max": None},
                      prodigy_step_factor=2.0)
    out = tmp_path / "decision.md"
    run_choose_lr(cfg, source="prodigy-step", lr_low=6e-4, lr_high=6e-4, lr_mid=6e-4, decision_path=out, updates=12,
                  factor=2.0)
    assert "d x lr = 0.0003, 12 updates, times 2 = 0.0006 (prodigy_step_factor: 2, as set)" in out.read_text()
    for bad in (0.0, -1.0, float("nan")):
        with pytest.raises(RangefinderError, match="prodigy-step factor"):
            run_choose_lr(cfg, source="prodigy-step", lr_low=6e-4, lr_high=6e-4, lr_mid=6e-4, factor=bad)


def test_a_fixed_lr_says_the_lr_finder_had_nothing_to_measure(tmp_path):
    out = tmp_path / "decision.md"
    run_choose_lr(demo_config(lr=3e-4, lr_finder="auto"), source="fixed", lr_low=3e-4, lr_high=3e-4, lr_mid=3e-4,
                  decision_path=out)
    assert "lr_finder auto has nothing to measure" in out.read_text()


@pytest.mark.parametrize("settings, says", [
    ({}, "races lr_mid against lr_high (successive halving, constant schedule)"),
    ({"finetune": {"halving_below_margin": 0.1}}, "lr_below = lr_mid^2 / lr_high joins the race where lr_high is "
                                                  "more than 10% behind"),
    # As set: a whole percent said 12% for 0.125.
    ({"finetune": {"halving_below_margin": 0.125}}, "more than 12.5% behind"),
    ({"finetune": {"successive_halving": False}}, "trains at lr_mid (constant schedule; successive halving is off)"),
    ({"validation": {"every_epochs": 0.0}}, "trains at lr_mid (constant schedule; successive halving needs "
                                            "validation)"),
    ({"finetune": {"schedule": "triangular"}}, "cycles between lr_low and lr_high (triangular schedule)"),
])
def test_the_decision_says_what_the_fine_tune_will_train(tmp_path, settings, says):
    # The demo's decision once said "trains at lr_mid" while its fine-tune raced lr_mid and lr_high and kept lr_high.
    out = tmp_path / "decision.md"
    run_choose_lr(demo_config(**settings), source="zoom", lr_low=4.5e-5, lr_high=2.1e-4, lr_mid=1.4e-4,
                  decision_path=out)
    assert says in out.read_text()
