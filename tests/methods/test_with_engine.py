"""Each method through the engine: a short run with validation and checkpoints, an exact resume, the outputs loaded
back by diffusers, and the sampling grid over the kept checkpoints."""

from __future__ import annotations

import csv
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.formats.export import LORA_WEIGHTS_NAME, SINGLE_FILE_NAME, TI_WEIGHTS_NAME, read_metadata
from rangefinder.sampling import render_grid
from rangefinder.training.loop import TrainSpec, train

TOKEN = "<rf-concept>"
SETTINGS = {
    "full": dict(lr=1e-4),
    "lora": dict(lr=1e-2, lora={"rank": 4, "alpha": 8.0}),
    "textual_inversion": dict(lr=5e-2, textual_inversion={"placeholder_token": TOKEN}),
}
FINAL_FILE = {"full": SINGLE_FILE_NAME, "lora": LORA_WEIGHTS_NAME, "textual_inversion": TI_WEIGHTS_NAME}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def encoded_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("encoded"))


@pytest.mark.slow
@pytest.mark.parametrize("method", ["lora", "textual_inversion", "full"])
def test_run_resume_outputs_and_grid(method, split_dir, tiny_model_dir, encoded_cache, tmp_path):
    torch.set_num_threads(1)  # the same reduction order in the straight and the resumed run
    cfg = TrainingConfig(method=method, batch_size=8, steps=4, seed=3, checkpoint_every_updates=2,
                         keep_checkpoints=2, cache_dir=encoded_cache, **SETTINGS[method])
    val = ValidationConfig(every_updates=2, timesteps=2)
    straight = train(TrainSpec(cfg, val, split_dir=split_dir, model=tiny_model_dir), out_dir=tmp_path / "straight")
    assert straight.status == "ok" and straight.updates == 4
    assert [int(p.name.split("-")[-1]) for p in straight.checkpoints] == [2, 4]
    curve = _rows(straight.metrics_csv)
    assert [int(r["update"]) for r in curve] == [0, 2, 4] and all(float(r["val_loss"]) > 0 for r in curve)

    # Exact resume: a fresh folder holding only the update-2 checkpoint ends where the straight run ended.
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(straight.checkpoints[0], resumed_dir / "checkpoints" / straight.checkpoints[0].name)
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val, split_dir=split_dir, model=tiny_model_dir),
                    out_dir=resumed_dir)
    assert resumed.resumed_from == 2
    assert _rows(resumed.metrics_csv) == curve
    a = load_file(str(straight.checkpoints[-1] / "weights.safetensors"))
    b = load_file(str(resumed.checkpoints[-1] / "weights.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    name = FINAL_FILE[method]
    assert (straight.final_dir / name).is_file(), f"{method}: final/ lacks {name}"
    # The deliverable says how many updates made it, the resumed run's included (the count rides in checkpoints).
    for run in (straight, resumed):
        assert read_metadata(run.final_dir / name)["rangefinder.updates"] == "4"
    if method == "full":  # the single file holds the final folder's weights
        from diffusers import StableDiffusionPipeline, UNet2DConditionModel

        single = StableDiffusionPipeline.from_single_file(str(straight.final_dir / name), config=str(tiny_model_dir),
                                                          local_files_only=True, safety_checker=None)
        folder = UNet2DConditionModel.from_pretrained(str(straight.final_dir / "unet")).state_dict()
        assert all(torch.equal(v, folder[k]) for k, v in single.unet.state_dict().items())

    # The grid: base, both kept checkpoints, final. The last checkpoint and final hold the same weights (no EMA),
    # so their cells must be identical; the base column differs.
    prompts = [f"a photo of a {TOKEN}" if method == "textual_inversion" else "a red circle"]
    grid = render_grid([tiny_model_dir, *straight.checkpoints, straight.final_dir], prompts, [0],
                       out_dir=tmp_path / "grid", base_model=tiny_model_dir, steps=2, guidance_scale=3.0, device="cpu")
    base_cell, _, last_ckpt, final = (np.asarray(Image.open(p)) for p in grid["images"][0])
    assert np.array_equal(last_ckpt, final)
    assert not np.array_equal(base_cell, final)
