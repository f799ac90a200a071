"""The HTML reports of a whole local run, opened in headless Chromium as a reader opens them (tests/browser.py).

Every page must load without a console error, decode every image, fit a 1280 px wide screen without sideways
scrolling, and show the numbers the run decided. The run is the unchanged demo's, which tests/pipelines/conftest.py
shares (`demo_run`).
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.browser import check_page, chromium

pytestmark = pytest.mark.slow


def _fmt(v: float) -> str:
    return f"{v:.3g}"  # as the reports print an LR


@pytest.fixture(scope="module")
def browser():
    """One headless Chromium for this file's pages (each test opens its own pages in it), not one launch per test."""
    with chromium() as b:
        yield b


def _experiment(summary: dict) -> str:
    """The experiment the printed MLflow link opens."""
    return summary["mlflow_link"].split("/experiments/")[1].split("/")[0]


def test_every_report_reads_in_a_browser(demo_run, browser, tmp_path):
    from mlflow import MlflowClient

    from rangefinder.config import demo_config

    s = demo_run.summary
    pages = sorted(p for p in map(Path, s["reports"]) if p.suffix == ".html")
    names = {p.name for p in pages}
    assert {"lr-range-test-first.html", "lr-range-test-zoom.html", "finetune.html",
            "sample-images-grid.html"} <= names, names
    checks = {p.name: check_page(browser, p, screenshot=tmp_path / f"{p.stem}.png") for p in pages}
    for name, check in checks.items():
        assert check.problems() == [], name
        assert check.images, f"{name} shows no image"
        assert (tmp_path / name.replace(".html", ".png")).stat().st_size > 10_000  # a rendered page, not blank

    # Each range test's page shows its own bounds: the first's, then the zoom's, which the run used.
    (first,) = [o for t, o in demo_run.run.outputs.items() if t.startswith("lr-range-test") and o["needs_zoom"]]
    for page, bounds in (("lr-range-test-first.html", first), ("lr-range-test-zoom.html", s)):
        lr = checks[page].text
        for key in ("lr_low", "lr_mid", "lr_high"):
            assert key in lr and _fmt(bounds[key]) in lr, (page, key)
    ft = checks["finetune.html"].text
    assert "recommended epochs" in ft
    # The run's recommendation, or (a run whose curve shows no window) the status that says why not.
    assert f"Train for {s['recommended_epochs']} epochs" in ft or "no_improvement" in ft, ft[:300]
    # Samples over training: the plot, then one image per row per sampled validation, the validations
    # being the updates of the image series the fine-tune logged to MLflow (from the update-0 baseline on).
    client = MlflowClient(tracking_uri=f"sqlite:///{demo_run.out_dir / 'mlflow.db'}")
    (ft_run,) = client.search_runs([_experiment(s)], "attributes.run_name = 'finetune'")
    images = [a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(ft_run.info.run_id, "images")]
    sampled = {int(n.split("+step+")[1].split("+")[0]) for n in images
               if n.startswith("samples_during_training+step+") and n.endswith(".png")}
    sampling = demo_config().sampling
    rows = len(sampling.prompts) * len(sampling.seeds_for_training())  # a strip's rows: prompt x training seed
    assert len(sampled) >= 2 and 0 in sampled, sampled
    assert "Samples over training" in ft and len(checks["finetune.html"].images) == 1 + rows * len(sampled), \
        (sampled, ft[-600:])
    grid = checks["sample-images-grid.html"]
    assert "a red circle" in grid.text and "base" in grid.text and "fine-tuned (final)" in grid.text
    # Every prompt x seed: the base column and at least the final weights.
    assert len(grid.images) >= 2 * len(sampling.prompts) * len(sampling.seeds)
    # The prompt-following scores (data.prompt_score), one row per column.
    assert "Does it follow the prompts?" in grid.text and "colour\tshape" in grid.text, grid.text[-600:]


def test_the_checks_see_what_a_reader_would(browser, tmp_path):
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
    problems = check_page(browser, bad).problems()
    good = check_page(browser, report["html"])
    assert any("console error: boom" in p for p in problems), problems
    assert any("image not decoded: alt='x'" in p for p in problems), problems
    assert any("scrolls sideways" in p for p in problems), problems
    assert good.problems() == [] and len(good.images) == 1
    assert np.isfinite(bounds.lr_mid) and _fmt(bounds.lr_mid) in good.text


def test_a_grid_of_many_columns_scrolls_in_its_box_not_the_page(browser, tmp_path):
    """Ten kept checkpoints make a grid wider than the screen: the page itself must still fit 1280 px."""
    from PIL import Image

    from rangefinder.sampling import _grid_html

    images = [[Image.new("RGB", (32, 32), (200, 40, 40)) for _ in range(12)]]
    page = tmp_path / "grid.html"
    page.write_text(_grid_html(images, ["a red circle | seed 0"], [f"update {10 * i}" for i in range(12)], 128,
                               {"steps": 2}))
    check = check_page(browser, page)
    assert check.problems() == [] and len(check.images) == 12


def test_mlflow_as_its_users_browse_it(demo_run, demo_run_mlflow, browser):
    """Issue 35, item 5: the printed link opens MLflow's model-training runs table (not its GenAI dashboard), the
    halving candidates are child runs of the fine-tune's run, the fine-tune run's page opens on its own val_loss
    chart, and every run and the registered model has a description. Read in headless Chromium from a real
    `mlflow server` on the run's own store."""
    from mlflow import MlflowClient

    from rangefinder.config import demo_config
    from rangefinder.tracking.metrics import curve_metric_name

    s = demo_run.summary
    uri = demo_run_mlflow  # a real `mlflow server` on <out>/mlflow.db, the run's store
    client = MlflowClient(uri)
    runs = client.search_runs([_experiment(s)])
    by_step = {r.data.tags.get("rangefinder.step"): r for r in runs}
    parent = next(r for r in runs if "mlflow.parentRunId" not in r.data.tags)
    finetune = by_step["finetune"]
    candidates = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == finetune.info.run_id]
    assert sorted(r.data.tags["halving.outcome"] for r in candidates) == ["dropped", "kept"]
    assert {r.data.tags["halving.candidate"] for r in candidates} == {"lr_mid", "lr_high"}
    val_loss = curve_metric_name("val_loss")  # validation/val_loss, one key on every run that trains
    assert val_loss in finetune.data.metrics and all(val_loss in r.data.metrics for r in candidates)
    undescribed = [r.info.run_name for r in runs if not r.data.tags.get("mlflow.note.content")]
    assert undescribed == [], undescribed
    model = client.get_registered_model(demo_config().tracking.registered_model_name)
    assert model.description

    link = s["mlflow_link"].replace("http://127.0.0.1:5000", uri)
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    try:
        page.goto(link)
        page.get_by_text(parent.info.run_name).first.wait_for(timeout=60_000)
        table = page.inner_text("body")
        # The model-training view's runs table: its columns, the pipeline's run, the run count with children.
        assert "Model training" in table and "Run Name" in table and "Duration" in table, table[:800]
        assert f"{len(runs)} matching runs" in table, table[:800]
        page.goto(f"{uri}/#/experiments/{parent.info.experiment_id}/runs/{parent.info.run_id}")
        page.get_by_text(parent.data.tags["mlflow.note.content"][:40]).first.wait_for(timeout=60_000)
        # The fine-tune run's page opens on its own val_loss: the first chart of its Model metrics tab (MLflow
        # orders named sections, then the unprefixed keys' section, each by key; tracking/metrics.py).
        page.goto(f"{uri}/#/experiments/{parent.info.experiment_id}/runs/{finetune.info.run_id}/model-metrics")
        # The charts render as they scroll into view, and a slow machine shows the next section's heading before
        # the first section's cards: read the first line under the first section's "Add chart" until it is
        # val_loss, for up to a minute, then say what it was.
        deadline, charts = time.monotonic() + 60, []
        while time.monotonic() < deadline:
            body = page.inner_text("body")
            charts = [line.strip() for line in body.split("Add chart", 1)[-1].split("\n") if line.strip()]
            if "Add chart" in body and charts and charts[0] == "val_loss":
                break
            page.wait_for_timeout(500)
        assert charts and charts[0] == "val_loss", charts[:12]
        page.goto(f"{uri}/#/models/{model.name}")
        page.get_by_text(model.description[:40]).first.wait_for(timeout=60_000)
    finally:
        page.close()
