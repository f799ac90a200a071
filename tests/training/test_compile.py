"""training.compile: the compiled engine trains the same model as eager, every repeated block stays compiled, and the
resolved choice is recorded.

Inductor on CPU (gcc): the tiny 32 px model with its UNet cut to one level (`one_width_model_dir`), 2 updates. Only
the UNet's repeated transformer blocks are compiled (diffusers' regional compilation), which is also what keeps this
test short.
"""

from __future__ import annotations

import csv
import json

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.models.loading import SDComponents
from rangefinder.training.loop import TrainSpec, train
from rangefinder.training.methods.full import FullFineTune
from rangefinder.training.setup import COMPILE_AUTO_MIN_UPDATES, compile_forward_modules, resolve_compile

VALIDATE_EVERY_UPDATE = ValidationConfig(every_updates=1, timesteps=2)
UNET_FILE = "unet/diffusion_pytorch_model.safetensors"


def column(path, col: str) -> list[float]:
    with open(path, newline="") as f:
        return [float(r[col]) for r in csv.DictReader(f) if r.get(col)]


@pytest.fixture
def one_width_model_dir(tmp_path, tiny_model_dir):
    """The tiny model with its UNet one level deep (32 channels, cross-attention at 8x8, freshly initialised, seeded):
    every transformer block one shape, so inductor compiles one graph per grad mode (training, no-grad validation)
    where the shipped UNet's two widths at two sequence lengths make two each. Compiling is most of this test's cost,
    and ~75-95 s of it with inductor's cache cold (CI); each repeated block's width keeping a graph of its own is
    `test_blocks_of_every_width_stay_compiled`'s to prove."""
    import shutil

    from diffusers import UNet2DConditionModel

    model = tmp_path / "one-width"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("unet"))
    config = {k: v for k, v in UNet2DConditionModel.load_config(tiny_model_dir / "unet").items()
              if not k.startswith("_")}
    torch.manual_seed(0)
    unet = UNet2DConditionModel.from_config({**config, "block_out_channels": (32,),
                                             "down_block_types": ("CrossAttnDownBlock2D",),
                                             "up_block_types": ("CrossAttnUpBlock2D",)})
    unet.save_pretrained(model / "unet")
    return model


@pytest.mark.slow
def test_compiled_training_matches_eager(tmp_path, split_dir, one_width_model_dir):
    cache = str(tmp_path / "cache")
    out = {}
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        for setting in ("off", "on"):
            cfg = TrainingConfig(batch_size=4, steps=2, lr=1e-3, seed=7, cache_dir=cache, compile=setting)
            result = train(TrainSpec(cfg, VALIDATE_EVERY_UPDATE, split_dir=split_dir, model=one_width_model_dir),
                           out_dir=tmp_path / setting)
            out[setting] = result
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            assert (graphs > 0) == (setting == "on")  # compiled graphs exist only once compiling is on
    finally:
        torch._dynamo.reset()
    summaries = {k: json.loads(r.summary_path.read_text()) for k, r in out.items()}
    assert (summaries["off"]["compile"], summaries["on"]["compile"]) == ("off", "on")
    assert out["on"].updates == 2

    # Train losses, and the validation losses that the same (compiled) module measures after each update.
    train_off, train_on = (column(tmp_path / k / "updates.csv", "train_loss") for k in ("off", "on"))
    val_off, val_on = (column(tmp_path / k / "metrics.csv", "val_loss") for k in ("off", "on"))
    assert len(train_on) == 2 and len(val_on) == 3  # baseline + after each update
    assert train_on == pytest.approx(train_off, rel=1e-4)
    assert val_on == pytest.approx(val_off, rel=1e-4)

    base = load_file(str(one_width_model_dir / UNET_FILE))
    eager, compiled = (load_file(str(out[k].final_dir / UNET_FILE)) for k in ("off", "on"))
    assert eager.keys() == compiled.keys()
    # Compared as the updates (trained - base), over the whole UNet: Adam divides by sqrt(v), so an element whose
    # gradient is ~0 turns kernel rounding into a visible part of a step (measured up to 1.8e-5 on 2 elements of
    # 9216 at lr 1e-3 on the shipped UNet; 6e-6 on 11 of 252,420 on the one-level one), while the update as a whole
    # must agree to 1e-3 of its norm.
    eager_step = torch.cat([(eager[k] - base[k]).flatten() for k in eager])
    compiled_step = torch.cat([(compiled[k] - base[k]).flatten() for k in eager])
    assert eager_step.norm() > 0  # training moved the weights: the comparison is not of two untouched copies
    assert (compiled_step - eager_step).norm() <= 1e-3 * eager_step.norm()
    close = torch.isclose(compiled_step, eager_step, rtol=1e-4, atol=1e-6).float().mean()
    assert close > 0.999


def test_blocks_of_every_width_stay_compiled():
    """Every variant of the repeated block keeps a compiled graph (issue 38: an SD 1.5 run on an H100 hit dynamo's
    recompile limit, 8 graphs per code object, in BasicTransformerBlock.forward and silently ran the rest eager).
    All the blocks share that one code object, and each width x grad mode x latent shape (until the sequence length
    turns dynamic) is a graph of its own: here 4 widths, training and no-grad validation, 2 latent shapes, more than
    8 graphs. The backend is "eager" (dynamo's graphs run as they are): the limit is dynamo's, counted before any
    backend sees a graph, so it is the same under inductor, and this takes seconds instead of minutes. The fallback
    is read from dynamo's counters: the "Dynamo recompile limit exceeded" graph break it records, and a frame it was
    handed but did not compile."""
    from diffusers import UNet2DConditionModel

    unet = UNet2DConditionModel(
        sample_size=8, block_out_channels=(8, 16, 24, 32), layers_per_block=1, norm_num_groups=8,
        down_block_types=("CrossAttnDownBlock2D",) * 4, up_block_types=("CrossAttnUpBlock2D",) * 4,
        cross_attention_dim=8, attention_head_dim=2,
    )
    sd = SDComponents(unet=unet, vae=None, text_encoder=None, tokenizer=None, noise_scheduler=None, source="test")
    text = torch.randn(2, 5, 8)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with torch._dynamo.config.patch(recompile_limit=8):  # dynamo's default, whatever an earlier test left
            compile_forward_modules(sd, FullFineTune(TrainingConfig()), backend="eager")
            for latent_shape in ((8, 8), (16, 8)):
                latents = torch.randn(2, 4, *latent_shape)
                unet.train()
                unet(latents, 10, text).sample.sum().backward()
                unet.eval()
                with torch.no_grad():
                    unet(latents, 10, text)
        counters = torch._dynamo.utils.counters
        graphs = counters["stats"]["unique_graphs"]
        frames = dict(counters["frames"])  # every frame dynamo was handed, and those it compiled
        limit_hit = [k for k in counters["unimplemented"] if "recompile limit" in k.lower()]
    finally:
        torch._dynamo.reset()
    assert not limit_hit, f"after {graphs} graphs dynamo ran the rest eager: {limit_hit[0].splitlines()[0]}"
    assert frames["ok"] == frames["total"]  # no frame left uncompiled for any other reason either
    assert graphs > 8, f"{graphs} graphs: within dynamo's default limit, so this no longer tests raising it"


def test_auto_compiles_only_where_compiling_was_measured_to_pay(monkeypatch):
    """An H100 measured the fully compiled UNet slower per update than eager (bench/RESULTS.md, issue 38's second
    session): `auto` then compiles nothing, however long the run; with a threshold, CUDA runs past it only."""
    import rangefinder.training.setup as setup

    assert COMPILE_AUTO_MIN_UPDATES is None
    assert resolve_compile("auto", 10**9, cuda=True) is False
    assert resolve_compile("auto", 10_000, cuda=False) is False  # CPU: never
    monkeypatch.setattr(setup, "COMPILE_AUTO_MIN_UPDATES", 3500)
    assert resolve_compile("auto", 3500, cuda=True) is False  # too short to repay compiling
    assert resolve_compile("auto", 3501, cuda=True) is True
    assert resolve_compile("auto", 3501, cuda=False) is False
    assert resolve_compile("on", 2, cuda=False) is True
    assert resolve_compile("off", 10_000, cuda=True) is False


def test_auto_resolves_to_off_on_cpu_and_is_recorded(tmp_path, split_dir, tiny_model_dir):
    """compile and mixed_precision `auto`, each recorded as what it resolved to (issue 38: the GPU run's summary must
    say bf16 and whether it compiled)."""
    if torch.cuda.is_available():
        pytest.skip("auto is off on CPU only")
    cfg = TrainingConfig(batch_size=4, steps=1, seed=7, cache_dir=str(tmp_path / "cache"))
    assert cfg.compile == "auto" and cfg.mixed_precision == "auto"
    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=tiny_model_dir),
                   out_dir=tmp_path / "run", save_final=False)
    summary = json.loads(result.summary_path.read_text())
    assert summary["compile"] == "off" and summary["training"]["compile"] == "auto"
    assert summary["mixed_precision_used"] == "no"  # no bf16 on CPU
    # The setting as given beside it, as compile's: the resolved "no" there, copied to a GPU, trained it in fp32.
    assert summary["training"]["mixed_precision"] == "auto"


def test_yaml_on_off_read_as_the_setting():
    import yaml

    assert TrainingConfig(**yaml.safe_load("compile: on")).compile == "on"
    assert TrainingConfig(**yaml.safe_load("compile: off")).compile == "off"
    with pytest.raises(ValueError, match="compile"):
        TrainingConfig(compile="sometimes")
