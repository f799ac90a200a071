"""Successive halving in the fine-tune step (issue 23): lr_mid and lr_high train half-way, the better goes on.

The step runs for real on the tiny model with a real MLflow store: the kept LR's run is exactly the fine-tune that
LR would have been on its own, MLflow holds both candidates' curves apart and the kept one's whole curve under the
plain keys, the report shows the decision, and a step killed in the race and again after it ends as one never
killed. Each training step, the halving fine-tune included, reads its split once, plans once and hashes each image
once (issue 32), and the retrain records the LR it was given, the kept lr_high, as `lr`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.analysis.halving import (
    CANDIDATES,
    HalvingCandidate,
    HalvingDecision,
    below_lr,
    best_until,
    compared_at,
    fires_below,
    pause_update,
    pick,
)
from rangefinder.config import demo_config
from rangefinder.errors import RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.steps.halving import DECISION, HALVING_DIR, halving_applies
from tests.tracking.fixtures import without_mlflow_run_env
from tests.training.test_resume import ForkedChild

LR_LOW, LR_MID, LR_HIGH = 3e-5, 1e-4, 1e-3
UNET = Path("final") / "unet" / "diffusion_pytorch_model.safetensors"

pytestmark = pytest.mark.slow


def _cfg(tiny_model_dir: Path, root: Path, **finetune):
    # 16 training images at batch 4: 4 updates an epoch; 4 epochs = 16 updates, both candidates pause at 8.
    return demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 4, **finetune},
                       training={"cache_dir": str(root / "cache")},
                       tracking={"tracking_uri": f"sqlite:///{root / 'mlflow.db'}", "experiment_name": "halving",
                                 "registered_model_name": None},
                       sampling={"num_inference_steps": 2, "every_validations": 2})


@pytest.fixture(scope="module")
def one_thread():
    """Every run here computes on one torch thread, as the killed step's own processes do: the comparisons are of
    bits, and another thread count sums in another order."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@contextlib.contextmanager
def counted_reads():
    """Counts of the real `read_split`, `plan` (the planner under every plan_for) and sha256 of each image file (the
    check of the split's images), each wrapped so that it still does its work."""
    import rangefinder.data.split as split_module
    import rangefinder.planning as planning

    counts: dict = {"read_split": 0, "plan": 0, "hashed": collections.Counter()}
    real_read, real_plan, real_hash = split_module.read_split, planning.plan, split_module.file_sha256

    def read_split(*args, **kwargs):
        counts["read_split"] += 1
        return real_read(*args, **kwargs)

    def plan(*args, **kwargs):
        counts["plan"] += 1
        return real_plan(*args, **kwargs)

    def file_sha256(path):
        counts["hashed"][str(path)] += 1
        return real_hash(path)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(split_module, "read_split", read_split)
        mp.setattr(planning, "plan", plan)
        mp.setattr(split_module, "file_sha256", file_sha256)
        yield counts


COUNTED: dict[str, dict] = {}  # the counts of each step run under counted_reads, by step


@pytest.fixture(scope="module")
def halved(split_dir, tiny_model_dir, tmp_path_factory, one_thread):
    """The step with halving, uninterrupted, under a pipeline run's parent run, and the kept LR's plain fine-tune
    (halving off) beside it."""
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.tracking import ensure_parent_run

    root = tmp_path_factory.mktemp("halving")
    with without_mlflow_run_env():
        cfg = _cfg(tiny_model_dir, root)
        parent = ensure_parent_run(cfg, name="halving-pipeline-run")
        with counted_reads() as counts:
            result = run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=LR_HIGH, lr_mid=LR_MID,
                                  model_dir=root / "ft", report_html=root / "finetune.html",
                                  report_md=root / "finetune.md", mlflow_parent_run_id=parent)
        COUNTED["finetune"] = counts
        plain = run_finetune(_cfg(tiny_model_dir, root / "plain", successive_halving=False), split_dir=split_dir,
                             lr_low=LR_LOW, lr_high=LR_HIGH, lr_mid=result.lr, model_dir=root / "plain" / "ft")
    return cfg, root, result, plain


def test_the_kept_lr_is_the_better_by_the_pause_and_its_run_is_that_lr_s_own_fine_tune(halved):
    cfg, root, result, plain = halved
    decision = json.loads((root / "ft" / HALVING_DIR / DECISION).read_text())
    assert decision["pause_update"] == 8 and decision["moved"] is True
    cands = decision["candidates"]
    assert {n: c["lr"] for n, c in cands.items()} == {"lr_mid": LR_MID, "lr_high": LR_HIGH}
    assert all(c["status"] == "paused" and c["updates"] == 8 for c in cands.values())
    # The kept one had the lower best validation loss by the pause; on this data that is lr_high (1e-4 learns
    # slowly), so the move of a run that is not the midpoint's is what is tested.
    assert decision["kept"] == "lr_high" and cands["lr_high"]["best_val_loss"] < cands["lr_mid"]["best_val_loss"]
    assert result.lr == LR_HIGH and result.halving is not None and result.halving.to_json() == decision
    assert result.updates_trained == 16 + 8  # the kept run whole, the dropped one to the pause
    # A constant-LR run paused and continued is the same run: the curve and the delivered weights are those of the
    # fine-tune at lr_high alone.
    for name in ("metrics.csv", "updates.csv"):
        assert (root / "ft" / name).read_text() == (root / "plain" / "ft" / name).read_text(), name
    a, b = load_file(str(root / "ft" / UNET)), load_file(str(root / "plain" / "ft" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert result.recommended_epochs == plain.recommended_epochs and result.chosen == plain.chosen
    # The dropped candidate keeps its curve and samples, not its checkpoints; the kept one's folder moved up.
    dropped = root / "ft" / HALVING_DIR / "lr_mid"
    assert (dropped / "metrics.csv").is_file() and not (dropped / "checkpoints").exists()
    assert not (root / "ft" / HALVING_DIR / "lr_high").exists()
    names = [[c.name for c in checkpoints.list_checkpoints(r / "ft" / "checkpoints")] for r in (root, root / "plain")]
    assert names[0] == names[1]  # the kept ones, as without halving


def test_mlflow_holds_each_candidate_in_a_child_run_and_the_kept_curve_whole_in_the_fine_tune_s(halved):
    from mlflow import MlflowClient

    from rangefinder.analysis import read_curve_csv
    from rangefinder.tracking.metrics import curve_metric_name, lr_text
    from rangefinder.training.samples import SAMPLES_KEY

    VAL_LOSS = curve_metric_name("val_loss")  # validation/val_loss: its chart section leads the run's page

    cfg, root, result, _ = halved
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("halving").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'finetune'")

    def history(key, run_id=run.info.run_id):
        return [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]

    def same(logged, expected):
        return [u for u, _ in logged] == [u for u, _ in expected] and \
            [v for _, v in logged] == pytest.approx([v for _, v in expected])

    curve = read_curve_csv(root / "ft" / "metrics.csv")
    kept = [(int(u), float(v)) for u, v in zip(curve["update"], curve["val_loss"], strict=True)]
    assert [u for u, _ in kept] == list(range(0, 17, 4))
    assert same(history(VAL_LOSS), kept)  # the delivered run, from update 0 to the end
    # Each candidate is a child run of the fine-tune's, with the same plain keys (MLflow overlays them), named and
    # tagged with whether it was kept; the fine-tune's own run has no candidate's keys.
    children = {r.data.tags["halving.candidate"]: r for r in client.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`mlflow.parentRunId` = '{run.info.run_id}'")}
    assert set(children) == {"lr_mid", "lr_high"}
    mid, high = children["lr_mid"], children["lr_high"]
    assert same(history(VAL_LOSS, high.info.run_id), kept[:3])  # its first half, as it trained
    assert [u for u, _ in history(VAL_LOSS, mid.info.run_id)] == [0, 4, 8]
    assert history(VAL_LOSS, mid.info.run_id)[1:] != history(VAL_LOSS, high.info.run_id)[1:]
    assert (mid.data.tags["halving.outcome"], high.data.tags["halving.outcome"]) == ("dropped", "kept")
    assert high.info.run_name == "lr_high lr 0.001 (kept)" and mid.info.run_name == "lr_mid lr 0.0001 (dropped)"
    # Their LR tags are written as every LR tag is (the range test's, the parent's, the version's: 1.000e-04), so a
    # filter a user copies from one of those finds the candidate too.
    (found,) = client.search_runs([run.info.experiment_id], filter_string=f"tags.lr = '{lr_text(LR_MID)}'")
    assert found.info.run_id == mid.info.run_id and high.data.tags["lr"] == "1.000e-03"
    # They measured val_loss on the fine-tune's validation set: a search by it finds their curves beside the
    # fine-tune's (two val_loss values compare only on one validation set).
    same_images = client.search_runs([run.info.experiment_id], filter_string="tags.`rangefinder.validation_digest` = "
                                     f"'{run.data.tags['rangefinder.validation_digest']}'")
    assert {r.info.run_id for r in same_images} >= {run.info.run_id, mid.info.run_id, high.info.run_id}
    assert all(c.data.tags[k] == run.data.tags[k] for c in (mid, high)
               for k in ("rangefinder.dataset_digest", "rangefinder.train_on"))
    # Selected together in MLflow's compare view, their params row is the LR each trained at, under the fine-tune
    # run's own name for it.
    assert {n: float(c.data.params["lr"]) for n, c in children.items()} == {"lr_mid": LR_MID, "lr_high": LR_HIGH}
    assert "kept: the fine-tune goes on with it" in high.data.tags["mlflow.note.content"]
    assert all(r.info.status == "FINISHED" for r in (mid, high))
    assert not any(k.startswith(("lr_mid/", "lr_high/")) for k in run.data.metrics), run.data.metrics
    assert [u for u, _ in history("train_loss")] == list(range(1, 17))
    assert {v for _, v in history("lr")} == {LR_HIGH}
    assert run.data.tags["halving.kept"] == "lr_high" and run.data.metrics["updates_trained"] == 24
    # One "lr" param, the LR the run trained the delivered model at; not the config's training.lr, which the
    # pipeline does not read.
    assert float(run.data.params["lr"]) == LR_HIGH and "training.lr" not in run.data.params
    # Samples: the kept run's grids under the plain key at every sampled validation (those from before the pause
    # logged again there), each candidate's in its own run.

    def steps(run_id, key=SAMPLES_KEY):
        names = [f.path.split("/")[-1] for f in client.list_artifacts(run_id, "images")]
        return sorted(int(n.split("+step+")[1].split("+")[0]) for n in names
                      if n.startswith(f"{key}+step+") and n.endswith(".png"))

    assert steps(run.info.run_id) == [0, 8, 16]
    assert steps(mid.info.run_id) == steps(high.info.run_id) == [0, 8]


def test_each_lr_has_one_home_on_the_fine_tune_s_run_and_the_pipeline_run_s_row_shows_them(halved):
    """The fine-tune's run logged its LRs several times: lr_low/lr_mid/lr_high as params and tags, `lr` and the tag
    lr_used, plan.lr and plan.lr_base, halving.<candidate>.lr. Each is now a param once (the bounds as given, where
    they came from, and `lr`, the LR halving kept, never plan.lr planned before the race); the parent run's row in
    MLflow's run list has them as tags (`lr_used` the kept one)."""
    from mlflow import MlflowClient

    cfg, _, result, _ = halved
    assert result.lr == LR_HIGH != LR_MID
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("halving").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'finetune'")
    params, tags = run.data.params, run.data.tags
    assert float(params["lr"]) == LR_HIGH and params["lr_source"] == "range-test"
    assert [float(params[k]) for k in ("lr_low", "lr_mid", "lr_high")] == [LR_LOW, LR_MID, LR_HIGH]  # as given
    assert not {"plan.lr", "plan.lr_base"} & set(params)
    assert not [k for k in tags if k == "lr_source" or k.rsplit(".", 1)[-1] == "lr" or k.startswith("lr_")], tags
    assert params["plan.effective_batch"] == "4" and float(params["plan.updates_per_epoch"]) == 4
    parent = client.get_run(tags["mlflow.parentRunId"]).data.tags
    assert [parent[k] for k in ("lr_low", "lr_mid", "lr_high", "lr_used", "lr_source")] == [
        "3.000e-05", "1.000e-04", "1.000e-03", "1.000e-03", "range-test"]


def test_the_report_and_decision_say_which_lr_was_kept_and_why(halved):
    _, root, result, _ = halved
    decision = json.loads((root / "ft" / "report" / "decision.json").read_text())
    assert decision["lr_used"] == LR_HIGH and decision["lr_mid"] == LR_MID and decision["halving"]["kept"] == "lr_high"
    page = (root / "finetune.html").read_text()
    assert "kept by successive halving" in page and "lr_mid (dropped)" in page and "lr_high (kept)" in page
    md = (root / "finetune.md").read_text()
    assert "| lr_high (kept) | 0.001 |" in md and "successive halving" in md


def test_a_step_killed_in_the_race_and_after_it_ends_as_one_never_killed(halved, split_dir, tiny_model_dir,
                                                                        tmp_path):
    """SIGKILL (a preempted pod) while lr_high races, then again while the kept run goes on: each retry goes on from
    where the last one was, and the step ends with the uninterrupted step's decision, curve and weights."""
    from rangefinder.steps.finetune import run_finetune

    _, root, reference, _ = halved
    cfg = _cfg(tiny_model_dir, tmp_path)
    work = tmp_path / "ft"

    def step() -> None:
        """The step in a process of its own, forked from this one (torch, diffusers and mlflow already imported:
        a fresh interpreter would spend ~9 CPU-s importing them before it trains; what is tested is the step's
        state on disk when its process is SIGKILLed). Logs to no MLflow server, on one torch thread, as before."""
        for v in [k for k in os.environ if k.startswith("MLFLOW_")]:
            os.environ.pop(v)
        torch.set_num_threads(1)
        run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=LR_HIGH, lr_mid=LR_MID, model_dir=work)

    def kill_when(ready) -> None:
        _kill_when(step, ready, tmp_path)

    race = work / HALVING_DIR / "lr_high" / "checkpoints"
    kill_when(lambda: race.is_dir() and bool(checkpoints.list_checkpoints(race)))
    assert not (work / HALVING_DIR / DECISION).exists(), "killed after the race: the race's resume is not tested"
    assert (work / HALVING_DIR / "lr_mid" / "run_summary.json").is_file()  # lr_mid had paused

    def past_the_pause() -> bool:
        done = checkpoints.list_checkpoints(work / "checkpoints") if (work / "checkpoints").is_dir() else []
        return any((checkpoints.checkpoint_update(c) or 0) > 8 for c in done)

    kill_when(past_the_pause)
    assert json.loads((work / HALVING_DIR / DECISION).read_text())["moved"] is True
    assert not (work / "final").exists(), "the step ended before the second kill: its resume is not tested"

    for v in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        os.environ.pop(v, None)
    result = run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=LR_HIGH, lr_mid=LR_MID, model_dir=work)
    assert result.halving == reference.halving and result.lr == LR_HIGH
    for name in ("metrics.csv", "updates.csv"):
        assert (work / name).read_text() == (root / "ft" / name).read_text(), name
    a, b = load_file(str(work / UNET)), load_file(str(root / "ft" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _kill_when(step, ready, tmp_path: Path) -> None:
    """`step` in the forked child the engine's kill tests use (tests/training/test_resume.py: its own stdout and
    stderr, default signal handlers, one OpenMP thread), SIGKILLed once `ready()` (or left to end)."""
    proc = ForkedChild(tmp_path / "step", tmp_path / "step.out", tmp_path / "step.err", target=step, args=())
    deadline = time.monotonic() + 300
    while not ready() and proc.poll() is None:
        assert time.monotonic() < deadline, "the step did not get there within 5 minutes"
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(signal.SIGKILL)
    proc.communicate()


def test_a_step_killed_while_lr_below_races_ends_as_one_never_killed(halved, split_dir, tiny_model_dir, tmp_path):
    """SIGKILL while the third candidate trains: the retry's lr_mid and lr_high return at their pause, lr_below goes
    on from its checkpoint, and the step delivers the fine-tune at lr_below's LR, bit for bit."""
    from rangefinder.steps.finetune import run_finetune

    _, root, _, _ = halved
    cfg = _cfg(tiny_model_dir, tmp_path, halving_below_margin=0.10)
    work = tmp_path / "ft"

    def step() -> None:
        for v in [k for k in os.environ if k.startswith("MLFLOW_")]:
            os.environ.pop(v)
        torch.set_num_threads(1)
        run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=1e-1, lr_mid=1e-2, model_dir=work)

    race = work / HALVING_DIR / "lr_below" / "checkpoints"
    _kill_when(step, lambda: race.is_dir() and bool(checkpoints.list_checkpoints(race)), tmp_path)
    assert not (work / HALVING_DIR / DECISION).exists(), "killed after the race: lr_below's resume is not tested"
    for v in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        os.environ.pop(v, None)
    result = run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=1e-1, lr_mid=1e-2, model_dir=work)
    assert result.halving is not None and result.halving.kept == "lr_below" and result.lr == pytest.approx(1e-3)
    for name in ("metrics.csv", "updates.csv"):
        assert (work / name).read_text() == (root / "ft" / name).read_text(), name
    a, b = load_file(str(work / UNET)), load_file(str(root / "ft" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_pause_before_the_first_validation_compares_the_candidates_where_they_paused(halved, split_dir,
                                                                                      tiny_model_dir, tmp_path):
    """validation.every_epochs 2 of a 3-epoch fine-tune (12 updates): the pause, update 6, comes before the first
    validation, update 8, where the engine pauses the candidates. Compared by update 6 none had a loss, and the
    step failed with "both fine-tune candidates diverged or measured nothing ... the range test's bounds are too
    high". They are compared where they paused, which the decision names as its pause: lr_below too, which races
    after the two where lr_high loses widely (here it diverges at once: its decision says so)."""
    from rangefinder.data.split import read_split
    from rangefinder.steps.halving import run_halving
    from rangefinder.training.spec import TrainSpec

    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 3, "halving_below_margin": 0.10},
                      validation={"every_epochs": 2.0}, training={"cache_dir": str(halved[1] / "cache")},
                      sampling={"every_validations": None})
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR_LOW, 1e6), lr=LR_HIGH, world_size=1)
    race = run_halving(cfg, spec, tmp_path / "work", lr_mid=LR_HIGH, lr_high=1e6, split=split)
    assert race.pause_update == 8 and set(race.candidates) == {"lr_mid", "lr_high", "lr_below"}
    high = race.candidates["lr_high"]
    assert (high.status, high.best_val_loss) == ("diverged", None) and high.updates < 8
    for name in ("lr_mid", "lr_below"):
        c = race.candidates[name]
        assert (c.status, c.updates, c.best_update, c.best_val_loss) == ("paused", 8, 8, dict(c.curve)[8]), name
    assert race.kept == min(("lr_mid", "lr_below"), key=lambda n: race.candidates[n].best_val_loss)
    assert json.loads((tmp_path / "work" / HALVING_DIR / DECISION).read_text())["pause_update"] == 8


def test_a_step_retried_after_the_decision_goes_on_from_it_without_racing_again(halved, split_dir, tmp_path):
    """halving.json is what a retried step goes on from: once the decision is made and its move done, run_halving
    returns it without training a candidate again, and the step's run in the work folder stays as it is (raced
    again, the kept candidate's run to the pause would be moved over it)."""
    import shutil

    from rangefinder.data.split import read_split
    from rangefinder.steps.halving import run_halving
    from rangefinder.training.spec import TrainSpec

    cfg, root, result, _ = halved
    work = Path(shutil.copytree(root / "ft", tmp_path / "ft"))

    def files() -> dict:
        return {p.relative_to(work): p.read_bytes() for p in work.rglob("*") if p.is_file()}

    before = files()
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR_LOW, LR_HIGH), lr=LR_MID, world_size=1)
    assert run_halving(cfg, spec, work, lr_mid=LR_MID, lr_high=LR_HIGH, split=split) == result.halving
    assert files() == before
    # A second fine-tune into the folder (a notebook's second call, with new bounds) is refused, not answered with
    # this decision's LR; the folder stays as it is.
    with pytest.raises(RangefinderError, match=rf"is the race of another fine-tune \(lr_mid {LR_MID:g}, lr_high "
                                               rf"{LR_HIGH:g}\), not of lr_mid {LR_MID * 2:g} and lr_high"):
        run_halving(cfg, spec, work, lr_mid=LR_MID * 2, lr_high=LR_HIGH, split=split)
    assert files() == before


def test_an_odd_fine_tune_races_to_half_its_updates_rounded_up_and_lr_below_only_past_the_margin(
        halved, split_dir, tiny_model_dir, tmp_path):
    """A fine-tune of 3 updates (16 images at batch 6, 1 epoch): the candidates train to update 2, half the updates
    rounded up, not 1; and with finetune.halving_below_margin set wider than lr_high can lose by without diverging,
    no third candidate races (the margin decides, not that it is set)."""
    from rangefinder.data.split import read_split
    from rangefinder.steps.halving import run_halving
    from rangefinder.training.spec import TrainSpec

    cfg = demo_config(model={"base_model": str(tiny_model_dir)}, finetune={"epochs": 1, "halving_below_margin": 5.0},
                      validation={"every_updates": 2}, sampling={"every_validations": None},
                      training={"cache_dir": str(halved[1] / "cache"), "batch_size": 6})
    split = read_split(split_dir)
    spec = TrainSpec.finetune(cfg, split, bounds=(LR_LOW, LR_HIGH), lr=LR_MID, world_size=1)
    assert spec.plan is not None and spec.plan.total_updates == 3
    race = run_halving(cfg, spec, tmp_path / "work", lr_mid=LR_MID, lr_high=LR_HIGH, split=split)
    assert set(race.candidates) == {"lr_mid", "lr_high"} and race.pause_update == 2
    assert all((c.status, c.updates, c.best_update) == ("paused", 2, 2) for c in race.candidates.values())


def test_a_server_gone_before_the_race_makes_the_candidates_and_the_cooldown_s_runs_when_it_answers(
        split_dir, tiny_model_dir, tmp_path, monkeypatch, one_thread):
    """A real `mlflow server` stopped as the fine-tune opens its first candidate's child run: the run could not be
    made (MLflow gives a run its id), and the step failed with MLflow's error once the fine-tune had trained to the
    race. The step goes on (README, "A server that stops answering mid-run"); each candidate's run is made from its
    spool when the server answers (here `rangefinder relog`, which sends the fine-tune's spool and, for its tags on a
    candidate, the candidate's first), holding its curve, its tags and the outcome the fine-tune gave it through its
    outbox (it asked the server for the candidates' runs there, and failed the step with MLflow's own error, a server
    gone after the race too). The cooldown (finetune.cooldown on) trains with the server still away: its child run is
    made from its spool too, with its tags, its param and its curve to the recommended length, and the fine-tune's
    run holds what it measured."""
    from mlflow import MlflowClient

    from rangefinder.cli.main import main as cli_main
    from rangefinder.steps import halving
    from rangefinder.steps.finetune import run_finetune
    from rangefinder.tracking import ensure_parent_run
    from rangefinder.tracking.metrics import curve_metric_name
    from rangefinder.tracking.spool import PENDING, SPOOL_ENV, read_spool
    from tests.tracking.fixtures import start_mlflow_server, stop_mlflow_server

    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_RUN_ID", "MLFLOW_EXPERIMENT_NAME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SPOOL_ENV, str(tmp_path / "spool"))
    # MLflow's calls, and the step's server check, fail at once once the server is gone (as in tests/tracking):
    # their retries' backoff (HTTP_LIMITS) was ~14 s of this test's waiting, and the step's handling is the same.
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "0")
    uri, server = start_mlflow_server(tmp_path / "server")
    cfg = _cfg(tiny_model_dir, tmp_path, epochs=2, cooldown="on", average="off").model_copy(deep=True)  # race to 4 of 8
    cfg.tracking.tracking_uri, cfg.tracking.server_wait_seconds = uri, 0.0
    cfg.sampling.every_validations = None
    # A validation every update, at 2 timesteps, the stabilize subset at every 4th: 9 points, so the fine-tune finds
    # a step window, whose length the cooldown trains again (at every epoch it read no window: no cooldown).
    cfg.validation.every_updates, cfg.validation.stabilize_every, cfg.validation.timesteps = 1, 4, 2
    open_candidate = halving._candidate_run

    def candidate_run_with_the_server_gone(*args, **kwargs):  # the real child run, once the server has stopped
        stop_mlflow_server(server)
        return open_candidate(*args, **kwargs)

    monkeypatch.setattr(halving, "_candidate_run", candidate_run_with_the_server_gone)
    try:
        parent = ensure_parent_run(cfg, name="gone-before-the-race")
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=LR_HIGH, lr_mid=LR_MID,
                              model_dir=tmp_path / "ft", report_html=tmp_path / "finetune.html",
                              report_md=tmp_path / "finetune.md", mlflow_parent_run_id=parent)
    finally:
        stop_mlflow_server(server)
    assert result.halving is not None and result.chosen is not None
    cooled = result.chosen["cooldown"]
    spools = [read_spool(s) for s in (tmp_path / "spool").glob("*.jsonl")]
    assert sum(spool.header["run_id"].startswith(PENDING) for spool in spools) == 3  # the candidates, the cooldown
    assert sum(r["kind"] == "tags" and "halving.outcome" in r["tags"] for spool in spools for r in spool.records) == 2
    _, server = start_mlflow_server(tmp_path / "server", port=int(uri.rsplit(":", 1)[1]))
    try:
        assert cli_main(["relog", str(tmp_path / "spool"), "--tracking-uri", uri]) == 0
        client = MlflowClient(uri)
        children = client.search_runs([client.get_run(parent).info.experiment_id],
                                      filter_string="tags.`halving.candidate` != ''")
        curves = {r.data.tags["halving.candidate"]: client.get_metric_history(r.info.run_id,
                                                                             curve_metric_name("val_loss"))
                  for r in children}
        (cooldown,) = client.search_runs([client.get_run(parent).info.experiment_id],
                                         filter_string="tags.`rangefinder.step` = 'finetune_cooldown'")
        cooldown_curve = client.get_metric_history(cooldown.info.run_id, curve_metric_name("val_loss"))
        finetune_run_metrics = client.get_run(cooldown.data.tags["mlflow.parentRunId"]).data.metrics
    finally:
        stop_mlflow_server(server)
    assert not list((tmp_path / "spool").glob("*.jsonl"))
    finetune_run = {r.data.tags.get("mlflow.parentRunId") for r in children}
    assert len(finetune_run) == 1 and None not in finetune_run
    kept = result.halving.kept
    assert {r.data.tags["halving.candidate"]: r.data.tags.get("halving.outcome") for r in children} == {
        name: "kept" if name == kept else "dropped" for name in ("lr_mid", "lr_high")}
    assert all(r.info.status == "FINISHED" and r.info.run_name.endswith(")") for r in children)
    assert all(max(m.step for m in curve) == 4 for curve in curves.values()), curves  # each to the pause
    assert cooldown.data.tags["mlflow.parentRunId"] in finetune_run and cooldown.info.status == "FINISHED"
    assert (cooldown.data.tags["cooldown"], cooldown.data.params["lr"]) == ("true", str(cooled["lr"]))
    assert cooldown.data.tags["mlflow.note.content"].startswith("The fine-tune's cooldown")
    assert [m.value for m in cooldown_curve if m.step == cooled["total_updates"]] == [cooled["val_loss"]]
    assert finetune_run_metrics["cooldown_val_loss"] == cooled["val_loss"]


def test_halving_runs_only_where_there_are_two_constant_lrs_to_compare():
    assert halving_applies(True, True, "constant", 1e-4, 1e-3)
    assert not halving_applies(False, True, "constant", 1e-4, 1e-3)  # finetune.successive_halving: false
    assert not halving_applies(True, False, "constant", 1e-4, 1e-3)  # no validation set: nothing to compare by
    assert not halving_applies(True, True, "triangular", 1e-4, 1e-3)  # the schedule already spans the bounds
    assert not halving_applies(True, True, "constant", 1e-3, 1e-3)  # a fixed LR


def test_the_pick_ties_to_lr_mid_and_passes_over_a_diverged_candidate():
    def cand(best, status="paused"):
        return HalvingCandidate(lr=1.0, status=status, updates=16, best_val_loss=best, best_update=8, curve=())

    assert pick({"lr_mid": cand(0.5), "lr_high": cand(0.5)}) == "lr_mid"
    assert pick({"lr_mid": cand(0.5), "lr_high": cand(0.4)}) == "lr_high"
    # lr_high reached a lower loss, then blew up: a diverged run cannot go on.
    assert pick({"lr_mid": cand(0.5), "lr_high": cand(0.3, "diverged")}) == "lr_mid"
    with pytest.raises(RangefinderError, match="both fine-tune candidates diverged"):
        pick({"lr_mid": cand(None, "diverged"), "lr_high": cand(0.3, "diverged")})
    assert CANDIDATES == ("lr_mid", "lr_high", "lr_below")
    # Three: the lowest goes on; ties in the order above.
    assert pick({"lr_mid": cand(0.5), "lr_high": cand(0.6), "lr_below": cand(0.5)}) == "lr_mid"
    assert pick({"lr_mid": cand(0.5), "lr_high": cand(0.6), "lr_below": cand(0.45)}) == "lr_below"
    # Update 0 (the base model) is not a candidate's own result.
    assert best_until([[0, 0.1], [4, 0.3], [8, 0.2], [12, 0.05]], 8) == (0.2, 8)


def test_a_third_candidate_below_lr_mid_fires_only_where_lr_high_lost_by_the_margin():
    def cand(best, status="paused"):
        return HalvingCandidate(lr=1.0, status=status, updates=8, best_val_loss=best, best_update=8, curve=())

    assert below_lr(1e-3, 4e-3) == pytest.approx(2.5e-4)  # as far below lr_mid as lr_high is above it
    race = {"lr_mid": cand(0.100), "lr_high": cand(0.111)}
    assert fires_below(race, 0.10) and not fires_below(race, 0.12) and not fires_below(race, None)
    assert not fires_below({"lr_mid": cand(0.100), "lr_high": cand(0.110)}, 0.10)  # "more than" the margin
    # Exactly the margin above (0.75 = 0.5 x 1.5 in binary too; 0.1 x 1.1 rounds above 0.110): not more than it.
    assert not fires_below({"lr_mid": cand(0.5), "lr_high": cand(0.75)}, 0.5)
    assert fires_below({"lr_mid": cand(0.5), "lr_high": cand(0.7500001)}, 0.5)
    assert not fires_below({"lr_mid": cand(0.100), "lr_high": cand(0.09)}, 0.10)  # lr_high won
    assert fires_below({"lr_mid": cand(0.1), "lr_high": cand(0.05, "diverged")}, 0.10)  # it blew up
    assert fires_below({"lr_mid": cand(0.1), "lr_high": cand(None)}, 0.10)  # it measured nothing
    # lr_mid itself failed: searching below it is not this rule's business (pick decides, or the step fails).
    assert not fires_below({"lr_mid": cand(0.1, "diverged"), "lr_high": cand(0.5)}, 0.10)


def test_the_pause_is_half_the_updates_rounded_up():
    assert (pause_update(16), pause_update(15), pause_update(1)) == (8, 8, 1)


def test_the_race_compares_by_the_pause_when_any_candidate_validated_before_it():
    """Validation at 4 and 8, the pause at 6: lr_high blew up before its first validation (no finite loss), lr_mid
    measured at 4. The race compares by 6 (the candidates paused at 8, their first validation at or after it); only
    where no candidate measured anything by the pause does it compare where they paused."""
    mid = HalvingCandidate.measured(1e-4, "paused", 8, [0, 4, 8], [0.2, 0.15, 0.12], 6)
    high = HalvingCandidate.measured(1e-3, "diverged", 3, [0], [0.2], 6)
    assert compared_at(6, {"lr_mid": mid, "lr_high": high}) == 6
    assert mid.by(6).best_val_loss == 0.15
    late = HalvingCandidate.measured(1e-4, "paused", 8, [0, 8], [0.2, 0.12], 6)
    assert compared_at(6, {"lr_mid": late, "lr_high": high}) == 8


def test_halving_json_reads_back_as_the_decision_written():
    """halving.json is what a killed step goes on from: a decision whose kept run was moved reads back moved (a step
    retried after the move does not move and replay it again), with every candidate as written."""
    mid = HalvingCandidate.measured(1e-4, "paused", 8, [0, 4, 8], [0.2, 0.15, 0.12], 8)
    high = HalvingCandidate.measured(1e-3, "paused", 8, [0, 4, 8], [0.2, 0.14, 0.13], 8)
    decision = HalvingDecision.decide(8, {"lr_mid": mid, "lr_high": high}).done_moving()
    back = HalvingDecision.from_json(json.loads(json.dumps(decision.to_json())))
    assert back == decision and back.moved and back.kept == "lr_mid"


def test_lr_below_races_when_lr_high_loses_widely_and_the_one_kept_is_its_lr_s_own_fine_tune(halved, split_dir,
                                                                                            tiny_model_dir, tmp_path):
    """lr_mid 1e-2 against lr_high 1e-1 on the data where `halved` kept 1e-3 over 1e-4: lr_high loses widely, so
    lr_below = 1e-3 races too, wins, and goes on. Its run is then `halved`'s delivered run (the fine-tune at 1e-3),
    to the bit; its race to the pause is that run's first half. The report and MLflow name the third candidate."""
    from mlflow import MlflowClient

    from rangefinder.steps.finetune import run_finetune

    _, root, reference, _ = halved
    cfg = _cfg(tiny_model_dir, tmp_path, halving_below_margin=0.10)
    with without_mlflow_run_env():
        result = run_finetune(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=1e-1, lr_mid=1e-2,
                              model_dir=tmp_path / "ft", report_html=tmp_path / "finetune.html")
    race = result.halving
    assert race is not None and set(race.candidates) == {"lr_mid", "lr_high", "lr_below"}
    mid, high, below = (race.candidates[n] for n in ("lr_mid", "lr_high", "lr_below"))
    assert below.lr == pytest.approx(1e-3) and below.status == "paused" and below.updates == 8
    assert high.status == "diverged" or high.best_val_loss > mid.best_val_loss * 1.10
    assert race.kept == "lr_below" and result.lr == pytest.approx(1e-3) and "lr_below" in race.rule
    assert result.updates_trained == 16 + 8 + high.updates
    for name in ("metrics.csv", "updates.csv"):
        assert (tmp_path / "ft" / name).read_text() == (root / "ft" / name).read_text(), name
    a, b = load_file(str(tmp_path / "ft" / UNET)), load_file(str(root / "ft" / UNET))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # The dropped two keep their curves and lose their checkpoints; the kept one moved up.
    for name in ("lr_mid", "lr_high"):
        assert not (tmp_path / "ft" / HALVING_DIR / name / "checkpoints").exists()
    assert not (tmp_path / "ft" / HALVING_DIR / "lr_below").exists()
    page = (tmp_path / "finetune.html").read_text()
    assert "lr_below (kept)" in page and "lr_mid (dropped)" in page and "lr_below (lr_mid^2 / lr_high)" in page
    client = MlflowClient(cfg.tracking.tracking_uri)
    children = client.search_runs([client.get_experiment_by_name("halving").experiment_id],
                                  filter_string="tags.`halving.candidate` = 'lr_below'")
    assert [r.data.tags["halving.outcome"] for r in children] == ["kept"]


def test_a_margin_without_halving_is_named_as_doing_nothing():
    from rangefinder.config import setting_conflicts

    cfg = demo_config(finetune={"successive_halving": False, "halving_below_margin": 0.1})
    (line,) = setting_conflicts(cfg)
    assert line.startswith("finetune.halving_below_margin (0.1) does nothing with finetune.successive_halving false")


@pytest.fixture(scope="module")
def retrained(halved, split_dir, tiny_model_dir):
    """The retrain at the LR the halving kept (lr_high), into the same MLflow store, as the pipeline passes it; and
    the range test, each counted as the fine-tune was."""
    from rangefinder.steps.lr_range_test import run_lr_range_test
    from rangefinder.steps.retrain_full import run_retrain_full

    cfg, root, result, _ = halved
    with without_mlflow_run_env():
        with counted_reads() as counts:
            full = run_retrain_full(cfg, split_dir=split_dir, lr_low=LR_LOW, lr_high=LR_HIGH, lr=result.lr,
                                    recommended_epochs=1, model_dir=root / "full")
        COUNTED["retrain_full"] = counts
        # What the short curve reads as is not what is counted here: a range test that found no bounds still read,
        # planned and hashed.
        with counted_reads() as counts, contextlib.suppress(RangefinderError):
            run_lr_range_test(cfg, split_dir=split_dir, out_dir=root / "range")
        COUNTED["lr_range_test"] = counts
    return full


def test_each_training_step_reads_its_split_plans_and_hashes_each_image_once(halved, retrained, split_dir):
    """Issue 32: the halving fine-tune trains three runs (two candidates, then the kept one on), the range test and
    the retrain one each; every step reads its split once, plans once and hashes each of its images once."""
    from rangefinder.data.split import read_split

    split = read_split(split_dir)
    images = {str(split.path_of(it)) for it in split.train + split.val + split.stabilize}
    for step in ("finetune", "retrain_full", "lr_range_test"):
        counts = COUNTED[step]
        assert (counts["read_split"], counts["plan"]) == (1, 1), step
        assert set(counts["hashed"]) == images and set(counts["hashed"].values()) == {1}, step


def test_the_retrain_records_the_kept_lr_as_lr_never_as_lr_mid(halved, retrained):
    """Halving kept lr_high: the retrain's MLflow params say `lr` = lr_high, and no `lr_mid` carries that value."""
    from mlflow import MlflowClient

    cfg, _, result, _ = halved
    assert result.lr == LR_HIGH
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("halving").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'retrain_full'")
    params = run.data.params
    assert float(params["lr"]) == LR_HIGH
    assert "lr_mid" not in params
    # Issue 35: it validates on nothing (it trains on the validation images), and its description says what it did.
    assert params["plan.val_images"] == "0"
    assert run.data.tags["mlflow.note.content"].startswith("Retrained on train + validation for 1 epochs (")


def test_the_range_test_s_description_is_its_report_s_headline(halved, retrained):
    """Issue 35: the range test's run says what it read, as its report's lead does, and keeps its bounds to itself:
    the parent run's bounds are the fine-tune's (choose_lr's decision)."""
    from mlflow import MlflowClient

    from rangefinder.analysis.reports import LR_STATUS_ADVICE

    cfg, root, _, _ = halved
    client = MlflowClient(cfg.tracking.tracking_uri)
    (run,) = client.search_runs([client.get_experiment_by_name("halving").experiment_id],
                                filter_string="tags.`rangefinder.step` = 'lr_range_test'")
    note = run.data.tags["mlflow.note.content"]
    assert note.startswith("LR range test over ")
    status = run.data.tags["status"]
    if json.loads((root / "range" / "bounds.json").read_text())["needs_zoom"]:
        # The zoom replaces its bounds: it says so and over which range, never "Train at" (issue 35).
        assert "Replaced by a zoomed range test over " in note and "Train at" not in note
    else:
        assert (LR_STATUS_ADVICE[status] in note) if status != "ok" else ("Train at lr_mid = " in note)
    lead = (root / "range" / "report" / "lr_report.md").read_text().splitlines()[2].split(": ", 1)[1]
    assert lead in note
