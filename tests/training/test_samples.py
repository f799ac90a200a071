"""Samples during training (training/samples.py): grids at the chosen validations, from the weights in memory, that
change nothing about the training, and an index that survives a SIGKILL and a resume whole."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rangefinder.config import SamplingConfig, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.training.loop import TrainSpec, train
from rangefinder.training.samples import AUTO_GRIDS, planned_validations, read_index, resolve_every
from tests.training.test_resume import run_child

pytestmark = pytest.mark.slow

# Two prompts x one seed, few steps: the cheap default shape of an in-training grid.
SAMPLING = SamplingConfig(prompts=["a red circle on a blue background", "a yellow square on a green background"],
                          seeds=[3, 4], num_inference_steps=3, guidance_scale=3.0, every_validations=2)
# 16 train images at batch 4: 4 updates per epoch; validation every epoch: updates 0, 4, 8, 12.
EVERY_EPOCH = ValidationConfig(every_epochs=1)


def training(tmp_path: Path, **kw) -> TrainingConfig:
    # Everything that draws from an RNG during training is on, so sampling touching any of them would show.
    base = dict(batch_size=4, epochs=3, lr=2e-4, seed=11, random_flip=True, cond_dropout=0.2, noise_offset=0.05,
                use_ema=True, ema_decay=0.9, cache_dir=str(tmp_path.parent / "cache"))
    return TrainingConfig(**{**base, **kw})


def trained_tensors(run_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the run's newest checkpoint (the method's trained weights) and of its final folder."""
    from rangefinder.formats import checkpoints

    newest = checkpoints.list_checkpoints(run_dir / "checkpoints")[-1]
    out = {f"ckpt/{k}": v for k, v in checkpoints.read_weights(newest).items()}
    for f in sorted((run_dir / "final").rglob("*.safetensors")):
        out.update({f"{f.relative_to(run_dir)}/{k}": v for k, v in load_file(str(f)).items()})
    return out


# ---------------------------------------------------------------------------------------------------------------
# When


def test_grids_at_the_baseline_every_nth_validation_and_the_last(split_dir, tiny_model_dir, tmp_path):
    """every_validations=2 over validations 0..3 (updates 0, 4, 8, 12): the baseline, the 2nd and the last."""
    result = train(TrainSpec(training(tmp_path), EVERY_EPOCH, split_dir=split_dir, model=tiny_model_dir,
                             sampling=SAMPLING), out_dir=tmp_path / "run")
    index = read_index(tmp_path / "run")
    assert index is not None
    entries = index["samples"]
    assert [(e["update"], e["epoch"], e["validation"]) for e in entries] == [(0, 0.0, 0), (8, 2.0, 2), (12, 3.0, 3)]
    assert index["settings"]["seeds"] == [3] and index["settings"]["every_validations"] == 2
    assert index["settings"]["guidance_scale"] == 3.0  # as set, not the pipeline's own
    folder = tmp_path / "run" / "samples"
    for e in entries:
        assert e["grid"] == f"update-{e['update']:06d}.png" and e["logged_to"] is None  # no image sink here
        with Image.open(folder / e["grid"]) as grid:
            assert grid.width >= 160 + 2 * 128  # labels, then one 128 px cell per prompt
        assert [Path(c).name for c in e["cells"]] == ["p00-s3.png", "p01-s3.png"]
        for c in e["cells"]:
            with Image.open(folder / c) as cell:
                assert cell.size == (32, 32)  # data.resolution of the tiny model
    # Training moved the weights, so the pictures moved too; the baseline is the base model's.
    first, last = (Image.open(folder / entries[i]["cells"][0]).tobytes() for i in (0, -1))
    assert first != last
    # Each cell is its seed's: the baseline is what the base model renders from seed 3 with the same settings.
    from rangefinder.sampling import render_grid

    base = render_grid([tiny_model_dir], SAMPLING.prompts, [3], out_dir=tmp_path / "base", steps=3, guidance_scale=3.0,
                       resolution=32)
    assert [Image.open(row[0]).tobytes() for row in base["images"]] == \
        [Image.open(folder / c).tobytes() for c in entries[0]["cells"]]
    # The last is what the run delivers renders: its final weights, the EMA's (use_ema), not the raw ones.
    final = render_grid([tmp_path / "run" / "final"], SAMPLING.prompts, [3], out_dir=tmp_path / "final",
                        base_model=tiny_model_dir, steps=3, guidance_scale=3.0, resolution=32)
    assert [Image.open(row[0]).tobytes() for row in final["images"]] == \
        [Image.open(folder / c).tobytes() for c in entries[-1]["cells"]]
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [INDEX_JSON] + [e["grid"] for e in entries] + [Path(e["grid"]).stem for e in entries])
    assert result.status == "ok"


INDEX_JSON = "index.json"


@pytest.mark.parametrize("damage", ['{"settings": ', "[]"])
def test_a_resume_on_a_damaged_sample_index_is_one_error_naming_it(split_dir, tiny_model_dir, tmp_path, damage):
    """samples/index.json damaged since the run wrote it whole (a torn copy, an edit), then the run resumed: one
    error naming the file and what removing it does, before a grid is removed or rendered. It was json's traceback."""
    spec = TrainSpec(training(tmp_path, epochs=None, steps=4, checkpoint_every_updates=2),
                     ValidationConfig(every_updates=2), split_dir=split_dir, model=tiny_model_dir,
                     sampling=SAMPLING.model_copy(update={"every_validations": 1}))
    run = tmp_path / "run"
    assert train(spec, out_dir=run, save_final=False).status == "ok"
    (run / "run_summary.json").unlink()
    index = run / "samples" / INDEX_JSON
    index.write_text(damage)
    grids = sorted(p.name for p in (run / "samples").iterdir())
    resumed = TrainSpec(spec.training.model_copy(update={"resume": True}), spec.validation, split_dir=split_dir,
                        model=tiny_model_dir, sampling=spec.sampling)
    said = rf"^{re.escape(str(index))} cannot be read: .*; it is written whole after each grid, so it was damaged or "
    with pytest.raises(RangefinderError, match=said + "changed since: remove it to go on"):
        train(resumed, out_dir=run)
    assert index.read_text() == damage and sorted(p.name for p in (run / "samples").iterdir()) == grids


def test_auto_spreads_about_ten_grids_over_any_run_length():
    from rangefinder.planning import plan_for

    plan = plan_for(TrainingConfig(batch_size=4, epochs=40), 16)  # a 40-epoch fine-tune of 16 images: 160 updates
    planned = planned_validations(plan, ValidationConfig(every_epochs=1))
    assert planned == 41  # the baseline and one per epoch
    assert resolve_every("auto", planned) == 4  # 11 grids: updates 0, 16, ..., 160
    assert resolve_every("auto", planned_validations(plan, ValidationConfig(every_updates=1))) == 16
    assert resolve_every("auto", 3) == 1
    for n in (2, 11, 41, 161, 1001):
        grids = len(range(0, n, resolve_every("auto", n))) + 1  # the baseline, every Nth, and the last
        assert grids <= AUTO_GRIDS + 2, n
    assert resolve_every(None, 41) is None and resolve_every(3, 41) == 3


def test_a_resolution_the_vae_cannot_decode_is_refused_before_training(split_dir, tiny_model_dir, tmp_path):
    bad = SAMPLING.model_copy(update={"resolution": 36})
    with pytest.raises(ConfigError, match=r"sampling.resolution: the pipeline renders sides in multiples of 8 px, "
                                          r"not 36; set it to a multiple of 8"):
        train(TrainSpec(training(tmp_path, epochs=1), EVERY_EPOCH, split_dir=split_dir, model=tiny_model_dir,
                        sampling=bad), out_dir=tmp_path / "run")
    assert (tmp_path / "run" / "updates.csv").read_text().count("\n") == 1  # the header: not one update trained


# ---------------------------------------------------------------------------------------------------------------
# Sampling changes nothing about training


@pytest.mark.parametrize(("family", "method"), [("sd1", "full"), ("sd1", "lora"), ("sd1", "textual_inversion"),
                                                ("sdxl", "lora")])
def test_a_run_with_samples_trains_what_a_run_without_does(split_dir, base_model_dir, tmp_path, family, method):
    """Same losses (metrics.csv, updates.csv, byte for byte) and bit-identical weights with samples on or off, for
    each method and family: the samples render from the weights in memory and leave every RNG and mode as they were.
    """
    sampling = SAMPLING.model_copy(update={"every_validations": 1})  # at every validation: the most interference
    tc = training(tmp_path, method=method, epochs=2, checkpoint_every_updates=8,
                  lr=5e-3 if method != "full" else 2e-4)
    runs = {}
    for name, s in (("off", None), ("on", sampling)):
        runs[name] = train(TrainSpec(tc, EVERY_EPOCH, split_dir=split_dir, model=base_model_dir, sampling=s),
                           out_dir=tmp_path / name)
    assert not (tmp_path / "off" / "samples").exists()
    assert [e["update"] for e in read_index(tmp_path / "on")["samples"]] == [0, 4, 8]
    for csv_name in ("metrics.csv", "updates.csv"):
        assert (tmp_path / "on" / csv_name).read_text() == (tmp_path / "off" / csv_name).read_text(), csv_name
    on, off = trained_tensors(tmp_path / "on"), trained_tensors(tmp_path / "off")
    assert on.keys() == off.keys() and len(on) > 0
    assert all(torch.equal(on[k], off[k]) for k in on), [k for k in on if not torch.equal(on[k], off[k])][:3]


# ---------------------------------------------------------------------------------------------------------------
# SIGKILL and resume


def test_a_killed_run_resumes_with_its_sample_index_whole_and_mlflow_holding_each_grid_once(
        split_dir, tiny_model_dir, tmp_path):
    """Killed inside update 11 (checkpoint at 6, grids at 0, 4 and 8 rendered and logged): the resume from update 6
    keeps the grids up to it, renders 8 again (the same picture: it retraces the updates bit for bit) without
    logging it twice, then 12; the index and the pictures equal an uninterrupted run's, and MLflow (a real sqlite
    store, through the multi-process workers' sink) holds each step once."""
    from mlflow import MlflowClient

    from rangefinder.tracking.runs import step_metric_sink

    sampling = SAMPLING.model_copy(update={"every_validations": 1})
    tc = dict(batch_size=4, epochs=3, lr=2e-4, seed=11, random_flip=True, cond_dropout=0.2, use_ema=True,
              ema_decay=0.9, checkpoint_every_updates=6, keep_checkpoints=3, cache_dir=str(tmp_path / "cache"))
    train(TrainSpec(TrainingConfig(**tc), EVERY_EPOCH, split_dir=split_dir, model=tiny_model_dir,
                    sampling=sampling), out_dir=tmp_path / "whole")

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("samples-resume")).info.run_id
    cut = tmp_path / "cut"
    killed = run_child({"split_dir": str(split_dir), "model": str(tiny_model_dir), "out_dir": str(cut),
                        "training": tc, "validation": {"every_epochs": 1},
                        "sampling": sampling.model_dump(mode="json"), "kill_at_update": 11,
                        "mlflow": {"tracking_uri": uri, "run_id": run_id}}, tmp_path, "killed", fresh=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    before = read_index(cut)
    assert [e["update"] for e in before["samples"]] == [0, 4, 8]
    assert {e["logged_to"] for e in before["samples"]} == {run_id}
    (cut / "samples" / "update-000099.png").write_bytes(b"a stray file")  # e.g. from a run with other settings

    cfg = _tracking(uri)
    sink = step_metric_sink(cfg, run_id, "finetune")
    try:
        resumed = train(TrainSpec(TrainingConfig(**tc, resume=True), EVERY_EPOCH, split_dir=split_dir,
                                  model=tiny_model_dir, sampling=sampling), out_dir=cut, metric_sink=sink)
    finally:
        sink.close()
    assert resumed.resumed_from == 6

    after, whole = read_index(cut), read_index(tmp_path / "whole")
    assert [e["update"] for e in after["samples"]] == [0, 4, 8, 12] == [e["update"] for e in whole["samples"]]
    assert not (cut / "samples" / "update-000099.png").exists()
    for a, w in zip(after["samples"], whole["samples"], strict=True):
        assert a["cells"] == w["cells"]
        for c in a["cells"]:
            assert (cut / "samples" / c).read_bytes() == (tmp_path / "whole" / "samples" / c).read_bytes(), c
    images = [f.path for f in client.list_artifacts(run_id, "images") if f.path.endswith(".png")]
    steps = sorted(int(Path(p).name.split("+step+")[1].split("+")[0]) for p in images)
    assert all(Path(p).name.startswith("samples_during_training+step+") for p in images)
    assert steps == [0, 4, 8, 12]


def _tracking(uri: str):
    from rangefinder.config import parse_config

    return parse_config({"tracking": {"tracking_uri": uri}})


def test_the_samples_of_a_model_without_a_guidance_input_record_none(tiny_flux_dir, tiny_schnell_dir):
    """FLUX.1-schnell has no guidance embedding and FluxPipeline feeds it no scale: the index of the samples during
    training said they drew at 3.5 (and the delivered model's grid, drawn with the index's settings, was refused as
    a scale given to schnell). The index records what `rangefinder sample`'s grid does; Flux.1-dev keeps its 3.5."""
    from rangefinder.training.samples import samples_guidance_scale

    assert samples_guidance_scale("flux", tiny_schnell_dir, None) is None
    assert samples_guidance_scale("flux", tiny_schnell_dir, 0.0) is None  # diffusers' schnell example: none asked for
    assert samples_guidance_scale("flux", tiny_flux_dir, None) == 3.5
    assert samples_guidance_scale("flux", None, 2.0) == 2.0  # parts from no folder: the setting, as before


def test_a_guidance_scale_for_a_model_without_a_guidance_input_is_refused_before_training(split_dir, tiny_schnell_dir,
                                                                                        tmp_path):
    """A sampling.guidance_scale for FLUX.1-schnell, which changes nothing (FluxPipeline never feeds it its
    transformer): `sample` and resolve-config's preflight refuse it, but a run started without the preflight (the
    engine, `rangefinder train`) dropped it without a word. Refused alike, before any update."""
    with pytest.raises(ConfigError, match=r"^sampling.guidance_scale: base model .* has no guidance embedding .*; "
                                          r"remove sampling.guidance_scale$"):
        # Settings a flow-matching model takes (training.noise_offset is DDPM's).
        tc = training(tmp_path, method="lora", epochs=1, use_ema=False, cond_dropout=0.0, noise_offset=0.0)
        train(TrainSpec(tc, EVERY_EPOCH, split_dir=split_dir, model=tiny_schnell_dir, sampling=SAMPLING),
              out_dir=tmp_path / "run")
    assert (tmp_path / "run" / "updates.csv").read_text().count("\n") == 1  # the header: not one update trained
