"""training.weights_dtype: bf16 (training/master.py): a full fine-tune's UNet held in bf16, its forward without
autocast, the optimizer stepping an fp32 master copy. It trains as the autocast run does, keeps the fp32 master in
its checkpoints and final/ (not the bf16 weights), resumes bit-exactly after kill -9, runs SDXL's extra conditioning,
and what it cannot do is one line. bf16 on this CPU: torch's CPU kernels take bf16, slowly, which a tiny model
affords."""

from __future__ import annotations

import csv
import math
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import run_child

UNET = Path("final") / "unet" / "diffusion_pytorch_model.safetensors"


def _losses(out: Path) -> list[float]:
    with open(out / "updates.csv", newline="") as f:
        return [float(r["train_loss"]) for r in csv.DictReader(f)]


def _off_the_bf16_grid(weights: dict[str, torch.Tensor]) -> int:
    """How many of the tensors hold values a bf16 tensor cannot: fp32 masters do, bf16 weights saved as fp32 not."""
    return sum(not torch.equal(w, w.to(torch.bfloat16).float()) for w in weights.values())


@pytest.mark.slow
def test_bf16_weights_train_like_autocast_keep_the_fp32_master_and_resume_exactly(split_dir, tiny_model_dir,
                                                                                 tmp_path):
    training = dict(batch_size=4, epochs=1, lr=1e-4, seed=7, mixed_precision="bf16", checkpoint_every_updates=2,
                    keep_checkpoints=5, cache_dir=str(tmp_path / "cache"))
    validation = dict(every_updates=2)

    def whole(out: str, **kw) -> Path:
        result = train(TrainSpec(TrainingConfig(**training, **kw), ValidationConfig(**validation),
                                 split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path / out)
        assert result.status == "ok" and result.updates == 4
        return tmp_path / out

    bf16 = whole("bf16", weights_dtype="bf16")
    autocast = whole("autocast")  # fp32 weights under bf16 autocast, the default
    # The same training: both start from the same weights and data, and their losses stay within bf16's rounding.
    a, b = _losses(autocast), _losses(bf16)
    assert a[0] == pytest.approx(b[0], rel=0.02)
    assert all(x == pytest.approx(y, rel=0.1) for x, y in zip(a, b, strict=True))
    # It trained, and what it saved is the fp32 master: values off bf16's grid, in every tensor the optimizer moved
    # (a save of the bf16 weights would hold none).
    base = load_file(str(tiny_model_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    final = load_file(str(bf16 / UNET))
    moved = [k for k in final if not torch.equal(base[k], final[k])]
    assert moved and all(final[k].dtype == torch.float32 for k in final)
    assert _off_the_bf16_grid({k: final[k] for k in moved}) > len(moved) // 2
    ckpt = {k: v for k, v in load_file(str(bf16 / "checkpoints" / "checkpoint-000004" / "weights.safetensors")).items()
            if k.startswith("unet.")}  # beside them, the method's update count
    assert all(v.dtype == torch.float32 for v in ckpt.values()) and _off_the_bf16_grid(ckpt) > 0
    for k, v in final.items():  # final/ holds the last checkpoint's master (no EMA in a full fine-tune by default)
        assert torch.equal(ckpt["unet." + k], v), k

    # Killed inside update 3 after the checkpoint at 2: the resume puts the master back from the checkpoint, and the
    # run ends bit for bit where the uninterrupted one did.
    cut = tmp_path / "cut"
    base_settings = dict(split_dir=str(split_dir), model=str(tiny_model_dir),
                         training={**training, "weights_dtype": "bf16"}, validation=validation)
    killed = run_child({**base_settings, "out_dir": str(cut), "kill_at_update": 3}, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    resumed = train(TrainSpec(TrainingConfig(**training, weights_dtype="bf16", resume=True),
                              ValidationConfig(**validation), split_dir=split_dir, model=tiny_model_dir), out_dir=cut)
    assert resumed.resumed_from == 2 and resumed.updates == 4
    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (bf16 / name).read_text(), name
    resumed_unet = load_file(str(cut / UNET))
    assert all(torch.equal(final[k], resumed_unet[k]) for k in final)


def test_the_masters_take_each_update_s_gradients_once_and_hand_their_weights_back():
    """gradients_in moves the update's bf16 gradients into the masters as they are (and clears the bf16 ones, so the
    next update does not add to them); the module's weights are the masters inside fp32_weights and their rounding
    after; to_bf16_module casts the latents and text states coming in, not the timesteps."""
    from rangefinder.training.master import MasterWeights, to_bf16_module

    layer = torch.nn.Linear(3, 2).to(torch.bfloat16)
    masters = MasterWeights(list(layer.parameters()))
    for update in range(2):
        layer.weight.grad = torch.full((2, 3), 0.5 + update, dtype=torch.bfloat16)
        layer.bias.grad = None
        masters.gradients_in()
        assert masters.masters[0].grad is not None and torch.equal(masters.masters[0].grad, torch.full((2, 3),
                                                                                                          0.5 + update))
        assert masters.masters[1].grad is None and layer.weight.grad is None
    with torch.no_grad():
        masters.masters[0].add_(1e-3)  # a step smaller than bf16's spacing around 1
        with masters.fp32_weights():
            assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, masters.masters[0])
            layer.weight.add_(1.0)  # what a resumed checkpoint loads inside goes into the master
    assert layer.weight.dtype == torch.bfloat16 and torch.equal(layer.weight, masters.masters[0].to(torch.bfloat16))

    seen = {}

    class Model(torch.nn.Module):
        def forward(self, latents, timesteps, hidden):
            seen.update(latents=latents.dtype, timesteps=timesteps.dtype, hidden=hidden.dtype)

    model = Model()
    to_bf16_module(model)
    model(torch.zeros(1, 4, 2, 2), torch.tensor([999.0]), hidden=torch.zeros(1, 3, 5))
    assert seen == {"latents": torch.bfloat16, "timesteps": torch.float32, "hidden": torch.bfloat16}


@pytest.mark.slow
def test_bf16_weights_run_sdxl_s_size_and_time_conditioning(split_dir, tiny_sdxl_dir, tmp_path):
    """SDXL's UNet takes its pooled text and time ids as keyword inputs: cast to bf16 with the rest."""
    cfg = TrainingConfig(batch_size=4, steps=2, lr=1e-4, seed=7, mixed_precision="bf16", weights_dtype="bf16",
                         cache_dir=str(tmp_path / "cache"))
    result = train(TrainSpec(cfg, ValidationConfig(every_updates=2), split_dir=split_dir, model=tiny_sdxl_dir),
                   out_dir=tmp_path / "run", save_final=False)
    assert result.status == "ok" and result.updates == 2
    assert all(math.isfinite(loss) and loss < 10 for loss in _losses(tmp_path / "run"))  # not blown up


@pytest.mark.parametrize("kw, words", [
    (dict(method="lora"), "method is lora"),
    (dict(train_text_encoder=True), "the text encoder trains too"),
    (dict(optimizer="adamw_schedule_free"), "adamw_schedule_free is schedule-free"),
    (dict(mixed_precision="no"), "mixed_precision is no"),
    (dict(mixed_precision="fp16"), "mixed_precision is fp16"),
])
def test_what_bf16_weights_cannot_do_is_one_line_naming_it(kw, words):
    with pytest.raises(ValueError, match="weights_dtype") as e:
        TrainingConfig(**{"weights_dtype": "bf16", "mixed_precision": "bf16", **kw})
    assert words in str(e.value) and "set weights_dtype: fp32" in str(e.value)


def test_bf16_weights_where_auto_resolves_to_no_mixed_precision_stop_the_run(split_dir, tiny_model_dir, tmp_path):
    """On this CPU `auto` is no mixed precision: the run stops before it trains, saying so."""
    cfg = TrainingConfig(batch_size=4, steps=1, weights_dtype="bf16", cache_dir=str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"needs bf16 mixed precision.*resolved mixed_precision to 'no'"):
        train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=tiny_model_dir),
              out_dir=tmp_path / "run", save_final=False)
    assert not (tmp_path / "run" / "updates.csv").exists()


@pytest.mark.slow
def test_bf16_weights_with_an_ema_and_channels_last_save_the_ema_of_the_master(split_dir, tiny_model_dir, tmp_path):
    """The EMA steps the fp32 masters: validation measures it through the bf16 weights, and final/ saves it in fp32
    (off bf16's grid), not the raw master; channels_last's conversion before the save leaves the master whole."""
    finals = {}
    for ema in (False, True):
        cfg = TrainingConfig(batch_size=4, steps=4, lr=1e-3, seed=7, mixed_precision="bf16", weights_dtype="bf16",
                             use_ema=ema, ema_decay=0.5, channels_last=True, cache_dir=str(tmp_path / "cache"))
        result = train(TrainSpec(cfg, ValidationConfig(every_updates=2), split_dir=split_dir, model=tiny_model_dir),
                       out_dir=tmp_path / f"ema-{ema}")
        assert result.status == "ok"
        finals[ema] = load_file(str(tmp_path / f"ema-{ema}" / UNET))
    base = load_file(str(tiny_model_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    moved = [k for k in finals[True] if not torch.equal(base[k], finals[True][k])]
    assert moved and _off_the_bf16_grid({k: finals[True][k] for k in moved}) > len(moved) // 2
    # The EMA (decay 0.5 over 4 updates) lags the raw weights: what was saved is not the last master.
    assert any(not torch.equal(finals[True][k], finals[False][k]) for k in moved)
