"""The HTML reports of a whole local run, opened in headless Chromium as a reader opens them (tests/browser.py).

Every page must load without a console error, decode every image, fit a 1280 px wide screen without sideways
scrolling, and show the numbers the run decided. The run is the one tests/pipelines/conftest.py shares.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.browser import check_page, chromium

pytestmark = pytest.mark.slow


def _fmt(v: float) -> str:
    return f"{v:.4g}"  # as the reports print a float


def test_every_report_reads_in_a_browser(default_local_run, tmp_path):
    s = default_local_run.summary()
    pages = sorted(p for p in map(Path, s["reports"]) if p.suffix == ".html")
    names = {p.name for p in pages}
    assert {"lr-range-test-first.html", "finetune.html", "sample-images-grid.html"} <= names, names
    with chromium() as browser:
        checks = {p.name: check_page(browser, p, screenshot=tmp_path / f"{p.stem}.png") for p in pages}
    for name, check in checks.items():
        assert check.problems() == [], name
        assert check.images, f"{name} shows no image"
        assert (tmp_path / name.replace(".html", ".png")).stat().st_size > 10_000  # a rendered page, not blank

    lr = checks["lr-range-test-first.html"].text
    for key in ("lr_low", "lr_mid", "lr_high"):
        assert key in lr and _fmt(s[key]) in lr, key
    ft = checks["finetune.html"].text
    assert "recommended epochs" in ft
    # The run's recommendation, or (this tiny run's 3 points may show no window) the status that says why not.
    assert f"Train for {s['recommended_epochs']} epochs" in ft or "no_improvement" in ft, ft[:300]
    # Samples over training: the plot, then one image per sampled validation (2 epochs: updates 0, 4 and 8).
    assert "Samples over training" in ft and len(checks["finetune.html"].images) == 1 + 3, ft[-600:]
    grid = checks["sample-images-grid.html"]
    assert "a red circle" in grid.text and "base" in grid.text and "fine-tuned (final)" in grid.text
    assert len(grid.images) >= 2  # one prompt x seed: the base column and at least the final weights
    # The prompt-following scores (data.prompt_score), one row per column.
    assert "Does it follow the prompts?" in grid.text and "colour\tshape" in grid.text, grid.text[-600:]


def test_the_checks_see_what_a_reader_would(tmp_path):
    """The checker itself: a page with a console error, an undecodable image and a too-wide table is caught, and an
    LR report whose curve path is one long unbroken word (a deep pipeline root) still fits the screen."""
    import numpy as np

    from rangefinder.analysis import analyze_lr_curve, write_lr_report
    from rangefinder.analysis.synthetic import RangeTestShape, lr_sweep, noisy

    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><html><body><script>console.error('boom')</script>"
                   "<img alt='x' src='data:image/png;base64,AAAA'><div style='width:2000px'>wide</div></body></html>")
    lr = lr_sweep(30)
    bounds = analyze_lr_curve(lr, noisy(RangeTestShape(rise=0.05).loss(lr), 0.003, 0))
    deep = "/".join(["pipeline_root", "rangefinder_finetune_2026_11_23_22_15_52_687395"] * 6) + "/metrics.csv"
    report = write_lr_report(bounds, None, tmp_path / "lr", source=deep)
    with chromium() as browser:
        problems = check_page(browser, bad).problems()
        good = check_page(browser, report["html"])
    assert any("console error: boom" in p for p in problems), problems
    assert any("image not decoded: alt='x'" in p for p in problems), problems
    assert any("scrolls sideways" in p for p in problems), problems
    assert good.problems() == [] and len(good.images) == 1
    assert np.isfinite(bounds.lr_mid) and _fmt(bounds.lr_mid) in good.text


def test_a_grid_of_many_columns_scrolls_in_its_box_not_the_page(tmp_path):
    """Ten kept checkpoints make a grid wider than the screen: the page itself must still fit 1280 px."""
    from PIL import Image

    from rangefinder.sampling import _grid_html

    images = [[Image.new("RGB", (32, 32), (200, 40, 40)) for _ in range(12)]]
    page = tmp_path / "grid.html"
    page.write_text(_grid_html(images, ["a red circle | seed 0"], [f"update {10 * i}" for i in range(12)], 128,
                               {"steps": 2}))
    with chromium() as browser:
        check = check_page(browser, page)
    assert check.problems() == [] and len(check.images) == 12
