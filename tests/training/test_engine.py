"""Real training runs of the engine on the tiny base model (CPU, 32 px, a handful of updates each)."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path
from typing import Optional

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.data.split import read_split
from rangefinder.errors import ConfigError
from rangefinder.planning import plan_for
from rangefinder.training.loop import TrainSpec, train

NO_VALIDATION = ValidationConfig(every_epochs=0)


@pytest.fixture(scope="module")
def encoded_cache(tmp_path_factory):
    """One latent/text cache for this module's runs (the first run encodes, the rest reuse)."""
    return str(tmp_path_factory.mktemp("encoded"))


def settings(cache: str, **kw) -> TrainingConfig:
    base = dict(batch_size=4, lr=1e-4, seed=7, cache_dir=cache)
    return TrainingConfig(**{**base, **kw})


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def unet_weights(final_dir: Path) -> dict[str, torch.Tensor]:
    return load_file(str(final_dir / "unet" / "diffusion_pytorch_model.safetensors"))


def train_images(split_dir) -> int:
    return len(read_split(split_dir).train)


# ---------------------------------------------------------------------------------------------------------------
# The planner's counts are the engine's counts


@pytest.mark.parametrize(
    "combo",
    [
        dict(batch_size=3, epochs=1),  # partial last micro-batch
        dict(batch_size=2, grad_accum=3, epochs=2),  # accumulation carries across the epoch boundary
        dict(batch_size=3, grad_accum=2, steps=5, steps_unit="micro-batch"),  # A1111-style steps
        dict(batch_size=5, grad_accum=2, drop_last=True, epochs=2),  # each epoch cut on its own
    ],
    ids=["partial-micro-batch", "grad-accum", "micro-batch-steps", "drop-last"],
)
def test_updates_taken_equal_the_planners_total_updates(combo, split_dir, tiny_model_dir, encoded_cache, tmp_path):
    cfg = settings(encoded_cache, checkpoint_every_updates=1000, **combo)  # one checkpoint, at the end
    expected = plan_for(cfg, train_images(split_dir))

    result = train(TrainSpec(cfg, NO_VALIDATION, split_dir=split_dir, model=tiny_model_dir),
                   out_dir=tmp_path, save_final=False)

    assert result.updates == expected.total_updates
    assert len(rows(tmp_path / "updates.csv")) == expected.total_updates
    # Independent of the loop's own counting: AdamW's per-parameter step counter in the saved optimizer state.
    optimizer = torch.load(result.checkpoints[-1] / "optimizer.pt", weights_only=True)
    steps = {float(s["step"]) for s in optimizer["state"].values()}
    assert steps == {float(expected.total_updates)}
    epochs = expected.images_seen / expected.train_images if not cfg.drop_last else cfg.epochs
    assert math.isclose(result.epochs, epochs)


# ---------------------------------------------------------------------------------------------------------------
# Validation: deterministic, and it never changes training


@pytest.fixture(scope="module")
def triangular_runs(split_dir, tiny_model_dir, encoded_cache, tmp_path_factory):
    """The same triangular-LR run twice: validated every epoch, and not validated at all; and the process's global
    RNG states before and after the second ("global_rngs")."""
    cfg = settings(encoded_cache, epochs=2, schedule="triangular", lr_min=1e-5, lr_max=3e-4, cycle_epochs=0.5,
                   random_flip=True, cond_dropout=0.25, min_snr_gamma=5.0, noise_offset=0.05)
    out = {}
    for name, val_cfg in (("validated", ValidationConfig(every_epochs=1)), ("plain", NO_VALIDATION)):
        d = tmp_path_factory.mktemp(name)
        before = global_rng_states(seed=len(name))  # the caller's own states, not those the earlier run left
        out[name] = (d, train(TrainSpec(cfg, val_cfg, split_dir=split_dir, model=tiny_model_dir), out_dir=d))
        out["global_rngs"] = (before, global_rng_states())
    return cfg, out


def global_rng_states(seed: Optional[int] = None) -> tuple:
    """Python's, NumPy's and torch's global RNG states, after seeding each with `seed` where given."""
    import random

    import numpy as np

    if seed is not None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)
    return random.getstate(), np.random.get_state()[1].tolist(), torch.get_rng_state().tolist()


def test_validation_does_not_change_the_trained_weights(triangular_runs):
    _, runs = triangular_runs
    (val_dir, validated), (plain_dir, plain) = runs["validated"], runs["plain"]
    assert len(rows(val_dir / "metrics.csv")) == 3  # baseline + 2 epochs
    assert rows(plain_dir / "metrics.csv") == []
    a, b = unet_weights(validated.final_dir), unet_weights(plain.final_dir)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert rows(val_dir / "updates.csv") == rows(plain_dir / "updates.csv")


def test_a_run_leaves_the_caller_s_global_rngs_as_it_found_them(triangular_runs):
    """train() seeds Python's, NumPy's and torch's global RNGs for the model's setup (accelerate's set_seed): run from
    a notebook, it left them seeded with training.seed, so every later draw of the user's repeated the same numbers."""
    _, runs = triangular_runs
    before, after = runs["global_rngs"]
    assert after == before


def test_metrics_csv_has_the_curve_columns(triangular_runs, split_dir):
    _, runs = triangular_runs
    d, result = runs["validated"]
    table = rows(d / "metrics.csv")
    k = ValidationConfig().timesteps
    assert list(table[0]) == (
        ["update", "epoch", "lr", "train_loss", "val_loss", "stabilize_loss"]
        + [f"val_loss_b{i}" for i in range(k)]
        + [f"stabilize_loss_b{i}" for i in range(k)]
    )
    baseline, last = table[0], table[-1]
    assert baseline["update"] == "0" and baseline["train_loss"] == "" and float(baseline["lr"]) == 0.0
    assert float(last["epoch"]) == 2.0 and int(last["update"]) == result.updates
    for row in table:
        buckets = [float(row[f"val_loss_b{i}"]) for i in range(k)]
        assert float(row["val_loss"]) == pytest.approx(sum(buckets) / k)
    summary = json.loads((d / "run_summary.json").read_text())
    assert summary["status"] == "ok" and summary["updates"] == result.updates
    assert summary["best_val_loss"] == min(float(r["val_loss"]) for r in table)


def test_a_metrics_row_s_train_loss_is_the_mean_of_the_updates_since_the_row_before(triangular_runs):
    """metrics.csv's train_loss sits beside a validation: the mean of updates.csv's train_loss over the updates since
    the row before (each epoch's here), not a sum, nor a mean over every update so far."""
    _, runs = triangular_runs
    d, _ = runs["validated"]
    per_update = {int(r["update"]): float(r["train_loss"]) for r in rows(d / "updates.csv")}
    table = rows(d / "metrics.csv")
    for before, row in zip(table[:-1], table[1:], strict=True):
        since = [per_update[u] for u in range(int(before["update"]) + 1, int(row["update"]) + 1)]
        assert len(since) > 1 and float(row["train_loss"]) == pytest.approx(sum(since) / len(since), rel=1e-12)


def test_logged_lr_follows_the_triangular_formula(triangular_runs, split_dir):
    cfg, runs = triangular_runs
    d, result = runs["plain"]
    p = plan_for(cfg, train_images(split_dir))
    step_size = cfg.cycle_epochs * p.updates_per_epoch  # Smith 2017: half a cycle, in updates
    for r in rows(d / "updates.csv"):
        u = int(r["update"]) - 1
        cycle = math.floor(1 + u / (2 * step_size))
        x = abs(u / step_size - 2 * cycle + 1)
        assert float(r["lr"]) == pytest.approx(1e-5 + (3e-4 - 1e-5) * max(0.0, 1 - x), rel=1e-12)
    lrs = [float(r["lr"]) for r in rows(d / "updates.csv")]
    assert max(lrs) == pytest.approx(3e-4) and min(lrs) < 1e-4  # it really cycles


def test_two_validation_passes_of_one_model_are_bit_identical(tiny_model_dir, split_dir):
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.caching import tokenize
    from rangefinder.training.family import Denoiser, Sd1Family
    from rangefinder.training.validation import ValidationSet, measure

    sd = load_sd_components(ModelConfig(base_model=str(tiny_model_dir)))
    items = read_split(split_dir).val
    with torch.no_grad():
        hidden = sd.text_encoder(tokenize(sd.tokenizer, [it.text for it in items]))[0]
    g = torch.Generator().manual_seed(0)
    latents = torch.randn((len(items), 4, 8, 8), generator=g)
    vset = ValidationSet("val", [it.id for it in items], latents, hidden)
    denoiser = Denoiser(Sd1Family(sd.tokenizer, sd.noise_scheduler, prediction_type="epsilon"), sd.unet.eval())
    kw = dict(denoiser=denoiser, num_buckets=4, seed=0, batch_size=3, device=torch.device("cpu"))
    torch.manual_seed(1)
    first = measure(vset, **kw)
    torch.manual_seed(2)  # the global RNG plays no part
    second = measure(vset, **kw)
    assert first == second
    assert measure(vset, **{**kw, "seed": 1}) != first  # the noise does come from the seed


def empty_caption_conditioning(model_dir) -> torch.Tensor:
    """The empty caption's text conditioning (classifier-free guidance's unconditional branch), as the SD 1.x family
    encodes it for training: what a caption dropped by training.cond_dropout conditions on."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(model_dir)))
    family = family_for(sd, TrainingConfig())
    with torch.no_grad():
        return family.encode_prompt([sd.text_encoder], family.tokenize([""]))[0]


def test_an_update_steps_the_clipped_gradient_of_its_images_mean_weighted_loss_at_the_schedule_s_lr(
        split_dir, tiny_model_dir, encoded_cache, tmp_path, monkeypatch):
    """What the UNet is trained on, read off a real run by hooks: each micro-batch's gradient at the UNet's output
    (dL/dpred) gives (pred - target) = dL/dpred x n / (2 x w x min-SNR weight) with w = 1 / (images in the update),
    the same for every micro-batch of an accumulated update; from it, the train loss logged is the update's plain
    per-image MSE mean, the UNet's input is the latents (flipped for about half of the images) noised to t with that
    target, and the target carries the offset noise (a whole channel's mean moved). Caption dropout conditions its
    share of the images on the empty caption. The optimizer steps the gradient clipped to max_grad_norm (the norm
    logged is the one before; the next update starts from no gradient) at the schedule's LR for that update (linear
    ramp: (u + 1) / U of lr_max)."""
    from diffusers import DDPMScheduler
    from torch.nn.modules.module import register_module_forward_hook
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    from rangefinder.training.caching import CachedLatentFiles

    gamma, clip, lr_max = 2.0, 1e-3, 1e-4
    cfg = settings(encoded_cache, batch_size=2, grad_accum=2, steps=2, schedule="linear-ramp", lr_max=lr_max,
                   min_snr_gamma=gamma, noise_offset=1.0, cond_dropout=0.25, max_grad_norm=clip, random_flip=True)
    micro: list[dict] = []
    stepped: list[tuple[float, float]] = []
    latents: list[tuple[list[bool], torch.Tensor]] = []
    get = CachedLatentFiles.get

    def latents_got(self, indices, flips, device):  # the cache's own read, recorded
        out = get(self, indices, flips, device)
        latents.append((list(flips), out.detach().clone()))
        return out

    monkeypatch.setattr(CachedLatentFiles, "get", latents_got)

    def forward(module, args, output):
        if type(module).__name__ == "UNet2DConditionModel" and output[0].requires_grad:
            seen = {"x": args[0].detach().clone(), "t": args[1].detach().clone(), "cond": args[2].detach().clone(),
                    "pred": output[0].detach().clone(),
                    "grads_before": any(p.grad is not None for p in module.parameters())}
            micro.append(seen)
            output[0].register_hook(lambda g: seen.__setitem__("grad", g.detach().clone()))

    def step(optimizer, a, kw):
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        stepped.append((float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))),
                        optimizer.param_groups[0]["lr"]))

    hooks = [register_module_forward_hook(forward), register_optimizer_step_pre_hook(step)]
    try:
        train(TrainSpec(cfg, NO_VALIDATION, split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path,
              save_final=False)
    finally:
        for hook in hooks:
            hook.remove()
    logged = rows(tmp_path / "updates.csv")
    assert len(logged) == len(stepped) == 2 and len(micro) == 4
    # each update starts from no gradient and accumulates over its two micro-batches
    assert [m["grads_before"] for m in micro] == [False, True, False, True]

    abar = DDPMScheduler.from_pretrained(str(tiny_model_dir), subfolder="scheduler").alphas_cumprod.double()
    images, targets, mse = 4, [], []
    assert len(latents) == 4
    flips = [f for fs, _ in latents for f in fs]
    assert 0 < sum(flips) < len(flips)
    for m, (_, x0) in zip(micro, latents, strict=True):
        snr = abar[m["t"]] / (1 - abar[m["t"]])
        weight = (snr.clamp(max=gamma) / snr / images).view(-1, 1, 1, 1)
        n = m["pred"][0].numel()
        diff = m["grad"].double() * n / (2 * weight)
        mse.append(diff.pow(2).mean(dim=(1, 2, 3)))
        targets.append(m["pred"].double() - diff)
        a = abar[m["t"]].view(-1, 1, 1, 1)
        torch.testing.assert_close(m["x"].double(), a.sqrt() * x0.double() + (1 - a).sqrt() * targets[-1],
                                   rtol=0, atol=1e-4)
    mse_by_update = torch.cat(mse).view(2, images)
    for r, per_image in zip(logged, mse_by_update, strict=True):
        assert float(r["train_loss"]) == pytest.approx(float(per_image.mean()), rel=1e-4)
    channel_means = torch.cat(targets).mean(dim=(2, 3)).abs()  # N(0, 1) offsets; ~N(0, 1 / (h w)) without
    assert float(channel_means.mean()) > 0.3

    empty = empty_caption_conditioning(tiny_model_dir)
    dropped = sum(torch.allclose(c, empty, atol=1e-5) for m in micro for c in m["cond"])
    assert 0 < dropped < images  # a quarter of 8, not three quarters

    for r, (norm, lr), u in zip(logged, stepped, range(2), strict=True):
        assert float(r["grad_norm"]) > clip and norm == pytest.approx(clip, rel=1e-4)
        assert float(r["lr"]) == lr == pytest.approx(lr_max * (u + 1) / 2, rel=1e-12)


def test_final_is_a_loadable_pipeline_with_the_trained_weights(triangular_runs, tiny_model_dir):
    from diffusers import StableDiffusionPipeline, UNet2DConditionModel

    _, runs = triangular_runs
    _, result = runs["plain"]
    pipe = StableDiffusionPipeline.from_pretrained(str(result.final_dir))
    base = UNet2DConditionModel.from_pretrained(str(tiny_model_dir), subfolder="unet")
    trained = dict(pipe.unet.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in base.named_parameters())


# ---------------------------------------------------------------------------------------------------------------
# Caching, v-prediction, bad settings


def test_latents_are_encoded_once_and_keyed_by_content(split_dir, tiny_model_dir, tmp_path):
    split = read_split(split_dir)
    data = tmp_path / "data"
    shutil.copytree(split.root, data)
    own_split = tmp_path / "split"
    shutil.copytree(split_dir, own_split)
    meta = json.loads((own_split / "split.json").read_text())
    meta["root"] = str(data)
    (own_split / "split.json").write_text(json.dumps(meta))
    n_items = len({it.id for it in split.train + split.val + split.stabilize})

    cfg = settings(str(tmp_path / "cache"), steps=1)
    first = train(TrainSpec(cfg, NO_VALIDATION, split_dir=own_split, model=tiny_model_dir),
                  out_dir=tmp_path / "a", save_final=False)
    second = train(TrainSpec(cfg, NO_VALIDATION, split_dir=own_split, model=tiny_model_dir),
                   out_dir=tmp_path / "b", save_final=False)
    assert first.cache["latents"]["encoded"] == n_items
    assert second.cache["latents"] == {"encoded": 0, "reused": n_items}
    assert second.cache["text"]["encoded"] == 0

    changed = split.path_of(split.train[0]).relative_to(split.root)
    from PIL import Image

    with Image.open(data / changed) as im:
        im.transpose(Image.Transpose.ROTATE_90).save(data / changed)
    # An image edited after the split needs a new split (the run checks each file's hash); same seed, same subsets.
    from rangefinder.data.split import split_dataset

    resplit = split_dataset(data, tmp_path / "resplit", seed=555)
    assert [it.file_name for it in resplit.val] == [it.file_name for it in split.val]
    third = train(TrainSpec(cfg, NO_VALIDATION, split_dir=tmp_path / "resplit", model=tiny_model_dir),
                  out_dir=tmp_path / "c", save_final=False)
    assert third.cache["latents"]["encoded"] == 1


def test_v_prediction_and_train_plus_val(split_dir, tiny_model_dir, encoded_cache, tmp_path):
    class Sink:  # a MetricSink, as the MLflow tracker is
        def __init__(self):
            self.calls = []

        def log_metrics(self, metrics, step):
            self.calls.append((step, dict(metrics)))

    sink = Sink()
    cfg = settings(encoded_cache, steps=2, prediction_type="v_prediction", use_ema=True, gradient_checkpointing=True)
    result = train(TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir, model=tiny_model_dir,
                             train_on="train+val"),
                   out_dir=tmp_path, metric_sink=sink)
    updates = [(step, m) for step, m in sink.calls if "train_loss" in m]
    assert [step for step, _ in updates] == [1, 2] and all({"lr", "grad_norm", "epoch"} <= set(m) for _, m in updates)
    measured = [(step, m) for step, m in sink.calls if "stabilize_loss" in m]
    assert [step for step, _ in measured] == [0, 1, 2] and all("train_loss" not in m for _, m in measured)
    table = rows(tmp_path / "metrics.csv")
    assert [r["update"] for r in table] == ["0", "1", "2"]
    assert all(r["val_loss"] == "" and r["stabilize_loss"] != "" for r in table)  # val is trained on: not measured
    scheduler = json.loads((result.final_dir / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["prediction_type"] == "v_prediction"
    split = read_split(split_dir)
    assert json.loads(result.summary_path.read_text())["plan"]["train_images"] == len(split.train) + len(split.val)


def test_caption_dropout_trains_that_share_of_images_on_the_empty_caption(split_dir, tiny_model_dir, encoded_cache,
                                                                          tmp_path):
    """training.cond_dropout is the share of training images the UNet sees with the empty caption's conditioning
    (classifier-free guidance's unconditional branch): at 0.9 nearly all of them. The suite's runs at 0.2 could not
    tell that share from its complement, nor the dropped images from the kept."""
    from diffusers import UNet2DConditionModel

    seen: list[torch.Tensor] = []

    def watch(module, args):
        if isinstance(module, UNet2DConditionModel) and torch.is_grad_enabled():  # training forwards only
            seen.append(args[2].detach().float().cpu())

    handle = torch.nn.modules.module.register_module_forward_pre_hook(watch)
    try:
        train(TrainSpec(settings(encoded_cache, steps=2, cond_dropout=0.9), ValidationConfig(every_epochs=0),
                        split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path, save_final=False)
    finally:
        handle.remove()
    empty = empty_caption_conditioning(tiny_model_dir)
    conds = torch.cat(seen)
    assert len(conds) == 8  # 2 updates of 4 images
    dropped = sum(bool(torch.allclose(c, empty, atol=1e-5)) for c in conds)
    assert dropped >= 6, dropped


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(schedule="linear-ramp", lr_min=1e-3, lr_max=1e-5, epochs=1), "lr_max"),
        (dict(batch_size=1000, drop_last=True, epochs=1), "drop_last"),
        (dict(schedule="zigzag", epochs=1), "schedule"),
        (dict(optimizer="adamw8bit", epochs=1), "adamw8bit"),
    ],
    ids=["ramp-upside-down", "batch-larger-than-set", "unknown-schedule", "8bit-adam-on-cpu"],
)
def test_bad_settings_fail_before_training(bad, message, split_dir, tiny_model_dir, tmp_path):
    if bad.get("optimizer") == "adamw8bit" and torch.cuda.is_available():
        pytest.skip("8-bit AdamW is allowed where CUDA is")
    cfg = TrainingConfig.model_construct(**{**dict(TrainingConfig()), **bad})  # skip the constructor's checks
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=message) as err:
        train(TrainSpec(cfg, NO_VALIDATION, split_dir=split_dir, model=tiny_model_dir), out_dir=out)
    assert "\n" not in str(err.value)
    assert not out.exists()  # nothing was written


def test_an_existing_run_is_not_overwritten_without_resume(split_dir, tiny_model_dir, encoded_cache, tmp_path):
    cfg = settings(encoded_cache, steps=1)
    train(TrainSpec(cfg, NO_VALIDATION, split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path, save_final=False)
    before = (tmp_path / "updates.csv").read_text()
    with pytest.raises(ConfigError, match="resume"):
        train(TrainSpec(cfg, NO_VALIDATION, split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path)
    assert (tmp_path / "updates.csv").read_text() == before


def test_bf16_with_the_text_encoder_training(split_dir, tiny_model_dir, encoded_cache, tmp_path):
    # Also a second precision in one process: accelerate's process-wide settings must not leak between runs.
    cfg = settings(encoded_cache, steps=2, mixed_precision="bf16", train_text_encoder=True)
    result = train(TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir, model=tiny_model_dir),
                   out_dir=tmp_path)
    assert result.status == "ok" and result.cache["text"] == {"encoded": 0, "reused": 0}  # encoded every step
    assert all(math.isfinite(float(r["val_loss"])) for r in rows(tmp_path / "metrics.csv"))
    from transformers import CLIPTextModel

    base = CLIPTextModel.from_pretrained(str(tiny_model_dir), subfolder="text_encoder")
    tuned = CLIPTextModel.from_pretrained(str(result.final_dir), subfolder="text_encoder")
    assert tuned.dtype == torch.float32
    assert any(not torch.equal(a, b) for a, b in zip(base.parameters(), tuned.parameters(), strict=True))


def test_channels_last_trains_the_same_model_and_saves_it(split_dir, tiny_model_dir, encoded_cache, tmp_path):
    runs = {}
    for cl in (False, True):
        cfg = settings(encoded_cache, steps=3, channels_last=cl)
        runs[cl] = train(TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir, model=tiny_model_dir),
                         out_dir=tmp_path / str(cl))
    # NHWC convolutions are other kernels: the same numbers up to rounding, but not bit for bit, which shows the
    # layout really changed. The final weights were written (safetensors takes contiguous tensors only).
    a, b = unet_weights(runs[False].final_dir), unet_weights(runs[True].final_dir)
    assert a.keys() == b.keys()
    # The absolute part of the tolerance scales with each tensor: how far rounding moves an Adam step depends on the
    # CPU's kernels (up to 2.9e-6 on weights of magnitude 0.1 on an AMD EPYC), while one update moves them ~1e-4.
    assert all(torch.allclose(a[k], b[k], rtol=1e-4, atol=1e-4 * float(a[k].abs().max())) for k in a)
    assert any(not torch.equal(a[k], b[k]) for k in a)
    va = [float(r["val_loss"]) for r in rows(tmp_path / "False" / "metrics.csv")]
    vb = [float(r["val_loss"]) for r in rows(tmp_path / "True" / "metrics.csv")]
    assert vb == pytest.approx(va, rel=1e-4)


def test_with_ema_validation_measures_the_weights_that_are_saved(split_dir, tiny_model_dir, encoded_cache, tmp_path):
    # The saved model is the EMA average; the step window must be read on it. Measure the saved model afresh (the
    # update-0 baseline of a run starting from it) and compare with the EMA run's last validation.
    cfg = settings(encoded_cache, steps=3, use_ema=True, ema_decay=0.9)
    ema_run = train(TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir, model=tiny_model_dir),
                    out_dir=tmp_path / "ema")
    table = rows(tmp_path / "ema" / "metrics.csv")
    first, last = table[0], table[-1]
    assert float(last["val_loss"]) != float(first["val_loss"])  # the average moved off the base model
    train(TrainSpec(settings(encoded_cache, steps=1), ValidationConfig(every_updates=1), split_dir=split_dir,
                    model=str(ema_run.final_dir)),
          out_dir=tmp_path / "again")
    baseline = rows(tmp_path / "again" / "metrics.csv")[0]
    assert float(baseline["update"]) == 0
    assert float(last["val_loss"]) == pytest.approx(float(baseline["val_loss"]), rel=1e-6)
    assert float(last["stabilize_loss"]) == pytest.approx(float(baseline["stabilize_loss"]), rel=1e-6)
    # ... and the run without EMA measures other (the raw) weights.
    train(TrainSpec(settings(encoded_cache, steps=3), ValidationConfig(every_updates=1), split_dir=split_dir,
                    model=tiny_model_dir),
          out_dir=tmp_path / "raw")
    assert float(rows(tmp_path / "raw" / "metrics.csv")[-1]["val_loss"]) != pytest.approx(
        float(last["val_loss"]), rel=1e-4)
    # Measuring the EMA puts the trained weights back bit for bit: validated at 0 and 3 only, the run trains and
    # saves exactly what the run validated at every update does (not on from the average it measured).
    seldom = train(TrainSpec(cfg, ValidationConfig(every_updates=3), split_dir=split_dir, model=tiny_model_dir),
                   out_dir=tmp_path / "seldom")
    saved = sorted(Path(ema_run.final_dir).rglob("*.safetensors"))
    assert saved
    for f in saved:
        mine, theirs = load_file(str(f)), load_file(str(Path(seldom.final_dir) / f.relative_to(ema_run.final_dir)))
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), f


def test_an_image_deleted_or_replaced_after_the_split_stops_the_run_before_training(shapes_dataset_dir, tmp_path):
    from PIL import Image

    from rangefinder.data.split import split_dataset
    from rangefinder.errors import DataError

    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    split = split_dataset(data, tmp_path / "split")
    gone, replaced = split.train[0], split.val[0]
    (data / gone.file_name).unlink()
    Image.new("RGB", (32, 32), (1, 2, 3)).save(data / replaced.file_name)  # a valid image, just not the one split
    out = tmp_path / "out"
    spec = TrainSpec(TrainingConfig(steps=1), NO_VALIDATION, split_dir=tmp_path / "split", model=None)
    with pytest.raises(DataError) as err:
        train(spec, out_dir=out)
    msg = str(err.value)
    assert "\n" not in msg and "2 images under" in msg
    assert f"{gone.file_name} (deleted)" in msg
    assert f"{replaced.file_name} (replaced: not the file that was split)" in msg
    assert "split the dataset again" in msg
    assert not out.exists()  # stopped before anything was written


# ---------------------------------------------------------------------------------------------------------------
# The files record the epochs their weights were trained for, not the budget


@pytest.mark.parametrize("budget", [dict(steps=6), dict(epochs=2)], ids=["steps", "epochs"])
def test_exported_files_record_the_epochs_their_weights_trained(budget, split_dir, tiny_model_dir, encoded_cache,
                                                                 tmp_path):
    """16 images, batch 4: 4 updates an epoch. The final files say the epochs the run took, and a checkpoint written
    out as the fine-tune's `chosen/` is (save_checkpoint_model) says its own, not the run's budget; with a budget
    in steps, the files said no epochs at all."""
    from rangefinder.formats.digest import file_sha256
    from rangefinder.formats.weights_file import read_metadata
    from rangefinder.training.restore import save_checkpoint_model

    cfg = settings(encoded_cache, method="lora", lr=1e-3, checkpoint_every_updates=2, keep_checkpoints=5, **budget)
    result = train(TrainSpec(cfg, NO_VALIDATION, split_dir=str(split_dir), model=str(tiny_model_dir)),
                   out_dir=tmp_path / "run")
    assert result.status == "ok" and result.epochs == result.updates / 4
    chosen = save_checkpoint_model(tmp_path / "run" / "checkpoints" / "checkpoint-000002", tiny_model_dir,
                                   tmp_path / "chosen")
    # A checkpoint an older rangefinder wrote has no `epoch` in its state.json: its update's row gives it (the files
    # said the run's budget of 2 epochs, or none).
    older = Path(shutil.copytree(tmp_path / "run" / "checkpoints" / "checkpoint-000002",
                                 tmp_path / "older" / "checkpoints" / "checkpoint-000002"))
    state = json.loads((older / "state.json").read_text())
    del state["epoch"]
    (older / "state.json").write_text(json.dumps(state))
    manifest = json.loads((older / "manifest.json").read_text())
    manifest["sha256"]["state.json"] = file_sha256(older / "state.json")
    (older / "manifest.json").write_text(json.dumps(manifest))
    from_older = save_checkpoint_model(older, tiny_model_dir, tmp_path / "chosen-older")
    for folder, updates in ((result.final_dir, result.updates), (chosen, 2), (from_older, 2)):
        for name in ("pytorch_lora_weights.safetensors", "lora_kohya.safetensors"):
            meta = read_metadata(folder / name)
            assert (meta["rangefinder.updates"], float(meta.get("rangefinder.epochs", "nan"))) == (
                str(updates), updates / 4), (folder, name, meta)
