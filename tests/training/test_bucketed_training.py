"""Aspect-ratio buckets in real runs of the engine: the tiny model on 15 real PNGs of mixed shapes (conftest's
`mixed_aspect_dataset_dir`) at 32 px, where the buckets are 24x40, 32x32 and 40x24. (Two processes sharing each
bucket's micro-batches: tests/cli/test_train.py's processes_per_node run, on the tiny SD3.)"""

from __future__ import annotations

import csv
import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.cli.main import main as cli
from rangefinder.config import DataConfig, TrainingConfig, ValidationConfig
from rangefinder.data.buckets import BucketSettings, place
from rangefinder.data.split import read_split
from rangefinder.planning import plan_for
from rangefinder.training.data import BucketedStream
from rangefinder.training.loop import TrainSpec, train

DATA = DataConfig(resolution=32)  # bucketing on (the default), step 8, max aspect 2
# Batch 2 and grad_accum 2 over buckets of 4, 5 and 3 training images: each epoch has 7 micro-batches, two of them
# partial, and the 4th update accumulates across the epoch boundary.
TRAINING = dict(batch_size=2, grad_accum=2, epochs=2, lr=2e-4, seed=5, random_flip=True, cond_dropout=0.2,
                checkpoint_every_updates=3, keep_checkpoints=10)
VALIDATION = ValidationConfig(every_epochs=1)


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def split_report(mixed_aspect_dataset_dir, tmp_path_factory) -> tuple[Path, dict, str]:
    """`rangefinder split` of the mixed set: (split folder, its --json report, its table)."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("mixed-split")
    args = ["split", str(mixed_aspect_dataset_dir), "--out", str(out), "--resolution", "32"]
    table, as_json = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(table):
        assert cli(args) == 0
    with contextlib.redirect_stdout(as_json):
        assert cli([*args, "--json"]) == 0
    return out, json.loads(as_json.getvalue()), table.getvalue()


class UNetInputs:
    """Records the latent shape of every UNet forward (training ones have grad enabled; validation's do not)."""

    def __init__(self) -> None:
        self.train: list[tuple[int, ...]] = []
        self.validation: list[tuple[int, ...]] = []

    def __call__(self, module, args):
        from diffusers import UNet2DConditionModel

        if isinstance(module, UNet2DConditionModel):
            (self.train if torch.is_grad_enabled() else self.validation).append(tuple(args[0].shape))


@pytest.fixture(scope="module")
def bucketed_runs(split_report, tiny_model_dir, tmp_path_factory):
    """The same bucketed run twice (the first watched forward by forward), sharing one latent cache."""
    split_dir = split_report[0]
    cache = tmp_path_factory.mktemp("bucket-cache")
    cfg = TrainingConfig(**TRAINING, cache_dir=str(cache))
    runs = {}
    for name in ("first", "second"):
        out = tmp_path_factory.mktemp(name)
        watch = UNetInputs()
        handle = torch.nn.modules.module.register_module_forward_pre_hook(watch)
        try:
            result = train(TrainSpec(cfg, VALIDATION, split_dir=split_dir, model=tiny_model_dir, data=DATA),
                           out_dir=out, save_final=False)
        finally:
            handle.remove()
        runs[name] = (out, result, watch)
    return cfg, cache, runs


# ---------------------------------------------------------------------------------------------------------------
# The split report


def test_split_report_lists_each_bucket_with_its_image_counts(split_report):
    split_dir, report, table = split_report
    assert report["bucket_settings"] == {"resolution": 32, "step": 8, "max_aspect": 2.0}
    buckets = {b["bucket"]: b for b in report["buckets"]}
    assert list(buckets) == ["24x40", "32x32", "40x24"]  # portraits, squares, landscapes: five images each
    assert {name: b["train"] + b["val"] for name, b in buckets.items()} == {"24x40": 5, "32x32": 5, "40x24": 5}
    assert sum(b["train"] for b in buckets.values()) == report["train_images"] == 12
    assert sum(b["val"] for b in buckets.values()) == report["val_images"] == 3
    assert sum(b["stabilize"] for b in buckets.values()) == report["stabilize_images"]
    assert all((b["width"], b["height"]) == tuple(map(int, name.split("x"))) for name, b in buckets.items())
    for name, b in buckets.items():
        assert f"{name}: train {b['train']}, val {b['val']}, stabilize {b['stabilize']}" in table

    # Each manifest line carries the image's size, and the bucket and crop offsets the engine will use.
    split = read_split(split_dir)
    settings = BucketSettings(32, 8, 2.0)
    for subset in ("train", "val", "stabilize"):
        for line in (split_dir / f"{subset}.jsonl").read_text().splitlines():
            entry = json.loads(line)
            w, h = entry["size"]
            assert entry["file_name"].endswith(f"_{w}x{h}.png")  # the real size, read from the file
            placed = place((w, h), settings)
            assert (entry["bucket"], entry["crop"]) == (list(placed.bucket), list(placed.crop))
    assert split.buckets == settings


# ---------------------------------------------------------------------------------------------------------------
# Training: one bucket per batch, plan == updates, deterministic validation


def test_every_batch_comes_from_one_bucket_with_that_buckets_latent_shape(bucketed_runs, split_report):
    cfg, _, runs = bucketed_runs
    _, result, watch = runs["first"]
    split = read_split(split_report[0])
    buckets = [place(it.size, BucketSettings(32, 8, 2.0)).bucket for it in split.train]
    names = sorted(set(buckets))
    stream = BucketedStream.from_plan(plan_for(cfg, len(buckets), [buckets.count(b) for b in names]), cfg.seed,
                                      [names.index(b) for b in buckets])
    expected = []
    for j in range(stream.total_micro_batches):
        batch = stream.micro_batch(j)
        assert len({buckets[i] for i in batch}) == 1  # one bucket per micro-batch
        w, h = buckets[batch[0]]
        expected.append((len(batch), 4, h // 4, w // 4))  # the tiny VAE downsamples by 4
    # What the UNet really got, forward by forward: each micro-batch's latents have its bucket's shape.
    assert watch.train == expected
    assert {s[2:] for s in watch.train} == {(10, 6), (8, 8), (6, 10)}  # all three buckets were trained
    assert {s[0] for s in watch.train} == {1, 2}  # and the partial micro-batches ran as they are
    # Validation measured every bucket at its own shape: 3 rows x (val + stabilize) sets, per bucket.
    assert {s[2:] for s in watch.validation} <= {(10, 6), (8, 8), (6, 10)}
    assert result.status == "ok"


def test_the_latent_cache_is_keyed_by_bucket(bucketed_runs):
    _, cache, runs = bucketed_runs
    folders = sorted((cache / "encoded" / "latents").iterdir())
    shapes = set()
    for folder in folders:
        entries = [load_file(str(p)) for p in folder.glob("*.safetensors")]
        assert len({tuple(e["latent"].shape) for e in entries}) == 1  # one shape per folder
        assert all("flipped" in e for e in entries)  # random_flip: the mirrored images' latents too
        shapes.add(tuple(entries[0]["latent"].shape))
    assert len(folders) == 3 and shapes == {(4, 10, 6), (4, 8, 8), (4, 6, 10)}
    first, second = runs["first"][1], runs["second"][1]
    assert first.cache["latents"]["encoded"] == 15 and second.cache["latents"] == {"encoded": 0, "reused": 15}


def test_plan_agrees_with_the_updates_actually_run(bucketed_runs, split_report, capsys):
    cfg, _, runs = bucketed_runs
    out, result, _ = runs["first"]
    report = split_report[1]
    counts = ",".join(str(b["train"]) for b in report["buckets"])
    assert cli(["plan", "--json", "--bucket-counts", counts, "--batch-size", "2", "--grad-accum", "2",
                "--epochs", "2"]) == 0
    planned = json.loads(capsys.readouterr().out)
    # 2 epochs x (2 + 3 + 2 micro-batches of the 4, 5 and 3 images) = 14 micro-batches, 7 updates.
    assert (planned["total_micro_batches"], planned["total_updates"]) == (14, 7)
    assert any("2 of the 7 micro-batches of each epoch are partial" in w for w in planned["warnings"])
    assert result.updates == result.planned_updates == planned["total_updates"]
    assert len(rows(out / "updates.csv")) == planned["total_updates"]
    optimizer = torch.load(result.checkpoints[-1] / "optimizer.pt", weights_only=True)
    assert {float(s["step"]) for s in optimizer["state"].values()} == {float(planned["total_updates"])}
    assert result.epochs == 2.0
    # Validated after the update that crosses each epoch boundary: update 4 ends one micro-batch (1 or 2 of the
    # 12 images) into epoch 2.
    epochs = [float(r["epoch"]) for r in rows(out / "metrics.csv")]
    assert epochs[0] == 0.0 and epochs[1] in (1 + 1 / 12, 1 + 2 / 12) and epochs[2] == 2.0


def test_a_steps_spec_plans_the_buckets_the_engine_trains(split_report, tmp_path):
    """The fine-tune step's spec is planned once from the split it read, with each training image in its aspect-ratio
    bucket as the engine places it: the engine takes that plan (it refuses one of other counts), and the step's
    checkpoint spacing follows the bucketed epoch."""
    from rangefinder.config import RangefinderConfig
    from rangefinder.errors import ConfigError
    from rangefinder.training.setup import check_settings
    from rangefinder.training.spec import TrainSpec as Spec

    split_dir = split_report[0]
    split = read_split(split_dir)
    cfg = RangefinderConfig(data=DATA.model_dump(), training={**TRAINING, "cache_dir": str(tmp_path / "cache")})
    spec = Spec.finetune(cfg, split, bounds=(1e-4, 1e-3), lr=2e-4, world_size=1)
    assert spec.plan is not None and spec.plan.bucket_counts is not None and len(spec.plan.bucket_counts) == 3
    assert spec.plan.micro_batches_per_epoch == 7  # buckets of 4, 5 and 3 at batch 2, as the engine streams them
    settings = check_settings(spec, tmp_path / "probe", split)
    assert settings.plan == spec.plan
    assert spec.training.checkpoint_every_updates == 4  # ceil(1 epoch x 3.5 updates)
    unbucketed = dataclasses.replace(spec, plan=plan_for(spec.training, spec.plan.train_images))
    with pytest.raises(ConfigError, match="build the spec from the split it trains on"):
        check_settings(unbucketed, tmp_path / "probe2", split)


def test_per_bucket_validation_losses_are_reported(bucketed_runs, split_report):
    _, _, runs = bucketed_runs
    out, _, _ = runs["first"]
    report = {b["bucket"]: b for b in split_report[1]["buckets"]}
    table = rows(out / "metrics.csv")
    val_buckets = [name for name, b in report.items() if b["val"]]
    assert [c for c in table[0] if c.startswith("val_loss_") and "x" in c] == [f"val_loss_{b}" for b in val_buckets]
    for row in table:
        # The set's loss is the mean over its items: the buckets' losses weighted by their images.
        weighted = sum(float(row[f"val_loss_{b}"]) * report[b]["val"] for b in val_buckets) / 3
        assert float(row["val_loss"]) == pytest.approx(weighted, rel=1e-12)
    summary = json.loads((out / "run_summary.json").read_text())["buckets"]
    assert [b["bucket"] for b in summary["table"]] == list(report)
    for b in summary["table"]:
        assert (b["train"], b["val"], b["stabilize"]) == tuple(report[b["bucket"]][k]
                                                               for k in ("train", "val", "stabilize"))
        if b["val"]:
            assert b["val_loss"] == float(table[-1][f"val_loss_{b['bucket']}"])


@pytest.fixture(scope="module")
def loaded_run(split_report, tiny_model_dir, tmp_path_factory):
    """A bucketed run's settings, accelerator, model and family, set up as the engine sets them up, nothing encoded."""
    from tests.conftest import set_up_engine

    tmp = tmp_path_factory.mktemp("loaded-run")
    cfg = TrainingConfig(batch_size=2, steps=1, seed=5, cache_dir=str(tmp / "cache"))
    return set_up_engine(TrainSpec(cfg, VALIDATION, split_dir=split_report[0], model=tiny_model_dir, data=DATA),
                         tmp / "run")


def test_each_buckets_validation_set_is_conditioned_on_its_own_items_captions(loaded_run):
    """A subset spread over buckets is measured as one set per bucket: each set's rows of text conditioning are its
    own items' captions, in its items' order (not the subset's first rows)."""
    from rangefinder.training.encoding import encode_data

    settings, accelerator, sd, family = loaded_run
    encoded = encode_data(settings, sd, family, accelerator, DATA)
    captions = {it.id: it.text for items in settings.val_items.values() for it in items}
    assert max(sum(vs.name == name for vs in encoded.val_sets) for name in ("val", "stabilize")) >= 2
    encoders = [getattr(sd, n) for n in family.text_encoder_names()]
    for vs in encoded.val_sets:
        with torch.no_grad():
            own = family.encode_prompt(encoders, family.tokenize([captions[i] for i in vs.ids])).float().cpu()
        assert torch.allclose(vs.conditioning, own, atol=1e-5), (vs.name, vs.bucket)


@pytest.mark.parametrize("bucketing", [True, False])
def test_center_crop_off_encodes_each_image_squashed_not_cropped(loaded_run, bucketing):
    """data.center_crop false: the latents are of the whole image squashed into its bucket (or the square), not of
    its centre: those of every image that overflows its bucket (or the square) differ, the others' are the same."""
    from rangefinder.training.encoding import encode_data

    settings, accelerator, sd, family = loaded_run
    if not bucketing:
        settings = dataclasses.replace(settings, placements=None)
    size = {it.id: it.size for items in settings.val_items.values() for it in items}
    latents: dict[bool, dict[int, torch.Tensor]] = {}
    for crop in (True, False):
        data = DataConfig(resolution=32, bucketing=bucketing, center_crop=crop)
        val_sets = encode_data(settings, sd, family, accelerator, data).val_sets
        latents[crop] = {i: z for vs in val_sets for i, z in zip(vs.ids, vs.latents, strict=True)}
    assert latents[True].keys() == latents[False].keys() == size.keys()
    buckets = BucketSettings.from_data_config(DATA)
    assert buckets is not None
    fits = {i for i, (w, h) in size.items()
            if ((p := place((w, h), buckets)).resized == p.bucket if bucketing else w == h)}
    assert fits and fits != size.keys()
    for i, cropped in latents[True].items():
        assert torch.equal(cropped, latents[False][i]) == (i in fits), size[i]


def test_validation_is_bit_identical_across_two_runs_and_a_resume(bucketed_runs, split_report, tiny_model_dir):
    cfg, _, runs = bucketed_runs
    first, second = runs["first"][0], runs["second"][0]
    whole = (first / "metrics.csv").read_text()
    assert (second / "metrics.csv").read_text() == whole
    assert (second / "updates.csv").read_text() == (first / "updates.csv").read_text()

    # As if the first run had stopped after its checkpoint at update 3 (mid-epoch 1: the next update straddles
    # the epoch boundary): resumed through the checkpoint machinery, it writes the same curve, bit for bit.
    resumed_dir = first.parent / "resumed"
    shutil.copytree(first, resumed_dir)
    for ckpt in (resumed_dir / "checkpoints").iterdir():
        if int(ckpt.name.rsplit("-", 1)[1]) > 3:
            shutil.rmtree(ckpt)
    (resumed_dir / "run_summary.json").unlink()
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), VALIDATION, split_dir=split_report[0],
                              model=tiny_model_dir, data=DATA),
                    out_dir=resumed_dir, save_final=False)
    assert resumed.resumed_from == 3 and resumed.updates == 7
    assert (resumed_dir / "metrics.csv").read_text() == whole
    assert (resumed_dir / "updates.csv").read_text() == (first / "updates.csv").read_text()


def test_resume_refuses_a_checkpoint_of_other_buckets(bucketed_runs, split_report, tiny_model_dir):
    from rangefinder.errors import ConfigError

    cfg, _, runs = bucketed_runs
    out = runs["second"][0]
    wider = DataConfig(resolution=32, max_aspect=4.0)  # other buckets, other batches
    with pytest.raises(ConfigError, match="cannot resume"):
        train(TrainSpec(cfg.model_copy(update={"resume": True}), VALIDATION, split_dir=split_report[0],
                        model=tiny_model_dir, data=wider),
              out_dir=out, save_final=False)


def test_without_the_latent_cache_each_micro_batch_is_encoded_at_its_buckets_shape(split_report, tiny_model_dir,
                                                                                      tmp_path):
    cfg = TrainingConfig(batch_size=3, steps=4, lr=1e-4, seed=1, cache_latents=False, random_flip=True,
                         cache_dir=str(tmp_path / "cache"))
    watch = UNetInputs()
    handle = torch.nn.modules.module.register_module_forward_pre_hook(watch)
    try:
        result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_report[0],
                                 model=tiny_model_dir, data=DATA), out_dir=tmp_path / "run", save_final=False)
    finally:
        handle.remove()
    # Only the 3 validation and 3 stabilize images are encoded up front; the training images per micro-batch.
    assert result.updates == 4 and result.cache["latents"]["encoded"] == 6
    assert len(watch.train) == 4 and {s[2:] for s in watch.train} <= {(10, 6), (8, 8), (6, 10)}


# ---------------------------------------------------------------------------------------------------------------
# Square images: bucketing changes nothing


def test_square_images_train_the_same_with_bucketing_on_and_off(split_dir, tiny_model_dir, tmp_path):
    """The embedded shapes are square: with bucketing on they all land in the one 32x32 bucket, and the run is the
    run of `data.bucketing: false` (the old square crop) bit for bit, so the default changed no demo number."""
    cfg = TrainingConfig(batch_size=3, epochs=1, lr=1e-4, seed=2, cache_dir=str(tmp_path / "cache"))
    val = ValidationConfig(every_updates=3)
    curves = {}
    for on in (True, False):
        out = tmp_path / f"bucketing-{on}"
        train(TrainSpec(cfg, val, split_dir=split_dir, model=tiny_model_dir,
                        data=DataConfig(resolution=32, bucketing=on)), out_dir=out, save_final=False)
        curves[on] = (out / "metrics.csv").read_text()
    assert curves[True] == curves[False]
    assert "32x32" not in curves[True].splitlines()[0]  # one bucket: no per-bucket columns


def test_a_bucket_the_model_cannot_take_is_one_clear_error(tiny_model_dir):
    """Every latent side must pass the UNet's downsampling evenly. The tiny model needs sides in multiples of 8 px
    (VAE x4, UNet x2), which every valid bucket_step (a multiple of 8) gives; SD needs 64, which a 32 px step does
    not. The check reads the model's own configs, so it is shown here on buckets the tiny model cannot take."""
    from rangefinder.config import ModelConfig, TrainingConfig
    from rangefinder.errors import ConfigError
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.encoding import check_bucket_sides
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    family = family_for(sd, TrainingConfig())
    check_bucket_sides(sd, family, {(24, 40), (32, 32)}, DATA)  # multiples of 8: fine
    with pytest.raises(ConfigError, match=r"must be multiples of 8 px \(VAE x4, UNet x2\), but buckets 20x44 are not"):
        check_bucket_sides(sd, family, {(20, 44), (32, 32)}, DATA)


def test_sdxl_trains_on_buckets_conditioned_on_each_images_size_and_crop(split_report, tiny_sdxl_dir, tmp_path):
    """SDXL's add_time_ids come from each image's placement (original size, crop, bucket), and a bucketed SDXL run
    trains and validates across the bucket shapes."""
    from rangefinder.training.encoding import image_geometry
    from rangefinder.training.family_sdxl import add_time_ids
    from rangefinder.training.setup import check_settings

    split_dir = split_report[0]
    cfg = TrainingConfig(batch_size=2, steps=2, seed=5, cache_dir=str(tmp_path / "cache"))
    spec = TrainSpec(cfg, ValidationConfig(every_updates=2, timesteps=1), split_dir=split_dir, model=tiny_sdxl_dir,
                     data=DATA)
    settings = check_settings(spec, tmp_path / "probe")
    assert settings.placements is not None
    seen = set()
    for item in settings.train_items:
        p = settings.placements[item.id]
        ids = add_time_ids(image_geometry(settings.split.path_of(item), DATA, p))
        assert ids == [p.size[1], p.size[0], p.crop[1], p.crop[0], p.bucket[1], p.bucket[0]]
        seen.add(tuple(ids[4:]))
    assert len(seen) == 3  # 24x40, 32x32 and 40x24: the target size differs per bucket
    result = train(spec, out_dir=tmp_path / "run", save_final=False)
    assert result.status == "ok" and result.updates == 2
    assert float(rows(result.metrics_csv)[-1]["val_loss"]) > 0


def test_sdxl_centre_crop_geometry_is_diffusers(tmp_path):
    """Without buckets: the centre crop's top-left in the image resized to cover the square, as diffusers'
    train_text_to_image_sdxl.py records it."""
    from PIL import Image

    from rangefinder.training.encoding import image_geometry

    path = tmp_path / "wide.png"
    Image.new("RGB", (80, 40)).save(path)
    g = image_geometry(path, DataConfig(resolution=32, bucketing=False))
    assert (g.original_hw, g.crop_top_left, g.target_hw) == ((40, 80), (0, 16), (32, 32))
    g = image_geometry(path, DataConfig(resolution=32, bucketing=False, center_crop=False))
    assert g.crop_top_left == (0, 0)


def test_sdxl_centre_crop_geometry_of_an_exif_rotated_photo_is_of_the_upright_image(tmp_path):
    """A phone photo stored 80x40 with EXIF orientation 6 trains as the 40x80 portrait it shows (pixels.load_rgb):
    its size conditioning was the stored landscape's, cropped across the wrong side."""
    from PIL import Image

    from rangefinder.training.encoding import image_geometry

    path = tmp_path / "phone.jpg"
    img = Image.new("RGB", (80, 40))
    exif = img.getexif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to view
    img.save(path, exif=exif)
    g = image_geometry(path, DataConfig(resolution=32, bucketing=False))
    assert (g.original_hw, g.crop_top_left, g.target_hw) == ((80, 40), (16, 0), (32, 32))


def test_the_epochs_a_checkpoint_and_a_resume_at_the_end_record_are_the_micro_batches_trained(
        bucketed_runs, split_report, tiny_model_dir):
    """With grad_accum 2 an update is two micro-batches: the epoch each checkpoint records (what an export of it
    names) is its updates.csv row's, and a run resumed at its last checkpoint (a step retried once it had trained
    everything) reports the epochs it trained from the stream position the checkpoint saved, not one micro-batch
    per update."""
    from rangefinder.formats import checkpoints

    cfg, _, runs = bucketed_runs
    first, result, _ = runs["first"]
    epoch_of = {int(r["update"]): float(r["epoch"]) for r in rows(first / "updates.csv")}
    saved = checkpoints.checkpoints_by_update(first / "checkpoints")
    assert sorted(saved) == [3, 6, 7]
    assert all(checkpoints.read_state(p)["epoch"] == epoch_of[u] for u, p in saved.items())

    again = Path(shutil.copytree(first, first.parent / "at-the-end"))
    (again / "run_summary.json").unlink()
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), VALIDATION, split_dir=split_report[0],
                              model=tiny_model_dir, data=DATA), out_dir=again, save_final=False)
    assert (resumed.resumed_from, resumed.updates) == (7, 7)
    assert resumed.epochs == result.epochs == 2.0
