"""Each method through the engine, for each model family: a short run with validation and checkpoints, a crash
(SIGKILL) and an exact resume, the outputs loaded back by their consumers, and the sampling grid over the kept
checkpoints."""

from __future__ import annotations

import csv
import signal

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig
from rangefinder.formats.embeddings import TI_WEIGHTS_NAME
from rangefinder.formats.lora import LORA_KOHYA_NAME, LORA_WEIGHTS_NAME
from rangefinder.formats.single_file import SINGLE_FILE_NAME
from rangefinder.formats.weights_file import read_metadata
from rangefinder.sampling import render_grid
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import run_child

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
@pytest.mark.parametrize("family", ["sd1", "sdxl"])
@pytest.mark.parametrize("method", ["lora", "textual_inversion", "full"])
def test_run_resume_outputs_and_grid(method, family, split_dir, base_model_dir, encoded_cache, tmp_path):
    torch.set_num_threads(1)  # the same reduction order in the straight, the killed and the resumed run
    settings = dict(SETTINGS[method])
    if family == "sdxl" and method == "lora":
        settings["lora"] = {**settings["lora"], "train_text_encoder": True}  # adapters on both encoders too
    cfg = TrainingConfig(method=method, batch_size=8, steps=4, seed=3, checkpoint_every_updates=2,
                         keep_checkpoints=2, cache_dir=encoded_cache, cond_dropout=0.2, **settings)
    val = ValidationConfig(every_updates=2, timesteps=2)
    straight = train(TrainSpec(cfg, val, split_dir=split_dir, model=base_model_dir), out_dir=tmp_path / "straight")
    assert straight.status == "ok" and straight.updates == 4
    assert [int(p.name.split("-")[-1]) for p in straight.checkpoints] == [2, 4]
    curve = _rows(straight.metrics_csv)
    assert [int(r["update"]) for r in curve] == [0, 2, 4] and all(float(r["val_loss"]) > 0 for r in curve)
    import json

    summary = json.loads(straight.summary_path.read_text())
    assert summary["family"] == family  # detected, never configured
    # training.use_ema auto: an EMA for LoRA on SD 1.x/2.x only (config.EMA_AUTO_FAMILIES), by the family the engine
    # loaded; the kill and the resume below go through it on SD's LoRA.
    assert summary["use_ema_used"] is (method == "lora" and family == "sd1")

    # A crash: the same run SIGKILLed inside update 3 (after the update-2 checkpoint), then resumed, ends exactly
    # where the straight run ended.
    cut = tmp_path / "cut"
    child = dict(split_dir=str(split_dir), model=str(base_model_dir), out_dir=str(cut), kill_at_update=3,
                 training=cfg.model_dump(mode="json"), validation=val.model_dump(mode="json"))
    assert run_child(child, tmp_path, "killed").returncode == -signal.SIGKILL
    resumed = train(TrainSpec(cfg.model_copy(update={"resume": True}), val, split_dir=split_dir, model=base_model_dir),
                    out_dir=cut)
    assert resumed.resumed_from == 2
    assert _rows(resumed.metrics_csv) == curve
    assert (cut / "updates.csv").read_text() == (tmp_path / "straight" / "updates.csv").read_text()
    a = load_file(str(straight.checkpoints[-1] / "weights.safetensors"))
    b = load_file(str(resumed.checkpoints[-1] / "weights.safetensors"))
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    if family == "sdxl":  # both encoders' parts are in the checkpoint when they train
        prefixes = {k.split(".")[0] for k in a if k != "method.updates"}
        assert prefixes == {"full": {"unet"}, "lora": {"unet", "text_encoder", "text_encoder_2"},
                            "textual_inversion": {"text_encoder", "text_encoder_2"}}[method]
    name = FINAL_FILE[method]
    assert (straight.final_dir / name).is_file(), f"{method}: final/ lacks {name}"
    # The deliverable says how many updates made it, the resumed run's included (the count rides in checkpoints).
    for run in (straight, resumed):
        assert read_metadata(run.final_dir / name)["rangefinder.updates"] == "4"
    check_outputs(method, family, straight.final_dir, base_model_dir)

    # The grid, through the family's pipeline: base, both kept checkpoints, final. The last checkpoint and final
    # hold the same weights (no EMA), so their cells must be identical; the base column differs.
    prompts = [f"a photo of a {TOKEN}" if method == "textual_inversion" else "a red circle"]
    grid = render_grid([base_model_dir, *straight.checkpoints, straight.final_dir], prompts, [0],
                       out_dir=tmp_path / "grid", base_model=base_model_dir, steps=2, guidance_scale=3.0, device="cpu")
    base_cell, _, last_ckpt, final = (np.asarray(Image.open(p)) for p in grid["images"][0])
    assert np.array_equal(last_ckpt, final)
    assert not np.array_equal(base_cell, final)


def _render(pipe, prompt):
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt, num_inference_steps=2, height=32, width=32, generator=torch.Generator().manual_seed(0),
                output_type="np").images


def check_outputs(method, family, final_dir, base_model_dir):
    """Each deliverable loaded by its consumer's own loader."""
    if method == "full":
        # The single file holds the final folder's weights, read back by diffusers' from_single_file.
        from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

        cls = StableDiffusionXLPipeline if family == "sdxl" else StableDiffusionPipeline
        folder = cls.from_pretrained(str(final_dir), local_files_only=True)
        kwargs = {} if family == "sdxl" else {"safety_checker": None}
        single = cls.from_single_file(str(final_dir / SINGLE_FILE_NAME), config=str(base_model_dir),
                                      local_files_only=True, **kwargs)
        parts = ("unet", "vae", "text_encoder") + (("text_encoder_2",) if family == "sdxl" else ())
        for part in parts:
            a, b = getattr(single, part).state_dict(), getattr(folder, part).state_dict()
            assert all(torch.equal(v, a[k]) for k, v in b.items() if "position_ids" not in k), part
        img = _render(folder, "a red circle")
        assert img.shape == (1, 32, 32, 3) and np.isfinite(img).all() and img.std() > 0.01
    elif method == "lora" and family == "sdxl":
        from diffusers import StableDiffusionXLPipeline

        from tests.methods.kohya_sdxl import expected_kohya_sdxl_names

        keys = set(load_file(str(final_dir / LORA_KOHYA_NAME)))
        modules = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in keys}
        pipe = StableDiffusionXLPipeline.from_pretrained(str(base_model_dir), local_files_only=True)
        assert modules == expected_kohya_sdxl_names(pipe.unet, pipe.text_encoder, pipe.text_encoder_2)
        assert {m.split("_")[1] for m in modules} == {"unet", "te1", "te2"}
        base = _render(pipe, "a red circle")
        images = []
        for weight_name in (LORA_WEIGHTS_NAME, LORA_KOHYA_NAME):  # diffusers reads both layouts; same model
            pipe = StableDiffusionXLPipeline.from_pretrained(str(base_model_dir), local_files_only=True)
            pipe.load_lora_weights(str(final_dir), weight_name=weight_name)
            images.append(_render(pipe, "a red circle"))
        assert np.allclose(images[0], images[1], atol=1e-4) and not np.allclose(images[0], base, atol=1e-4)
    elif method == "textual_inversion" and family == "sdxl":
        from diffusers import StableDiffusionXLPipeline

        from rangefinder.sampling import load_embedding

        state = load_file(str(final_dir / TI_WEIGHTS_NAME))
        assert set(state) == {"clip_l", "clip_g"}
        pipe = StableDiffusionXLPipeline.from_pretrained(str(base_model_dir), local_files_only=True)
        assert state["clip_l"].shape == (1, pipe.text_encoder.config.hidden_size)
        assert state["clip_g"].shape == (1, pipe.text_encoder_2.config.hidden_size)
        load_embedding(pipe, final_dir / TI_WEIGHTS_NAME, TOKEN)
        for tok, te in ((pipe.tokenizer, pipe.text_encoder), (pipe.tokenizer_2, pipe.text_encoder_2)):
            row = te.get_input_embeddings().weight[tok.convert_tokens_to_ids(TOKEN)]
            assert torch.equal(row, state["clip_l" if te is pipe.text_encoder else "clip_g"][0])
        assert np.isfinite(_render(pipe, f"a photo of a {TOKEN}")).all()
