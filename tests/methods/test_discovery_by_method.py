"""Discovery end to end with each method: the LR range test, the constant fine-tune at its midpoint, registration.

The reason discovery matters: adapters (LoRA) and new embeddings (textual inversion) learn at learning rates orders of
magnitude above full fine-tuning on the same data, so no single default LR serves all three.
"""

from __future__ import annotations

import math
from pathlib import Path

import mlflow
import pandas as pd
import pytest

from rangefinder.config import demo_config
from rangefinder.steps.finetune import run_finetune
from rangefinder.steps.lr_range_test import run_lr_range_test
from rangefinder.steps.register_model import run_register_model
from rangefinder.tracking import decode_image

pytestmark = pytest.mark.slow

METHODS = ("full", "lora", "textual_inversion")
# What each method's fine-tune delivers under final/ (diffusers' names).
DELIVERABLE = {"full": "model_index.json", "lora": "pytorch_lora_weights.safetensors",
               "textual_inversion": "learned_embeds.safetensors"}


@pytest.fixture(scope="module")
def discovered(split_dir, tiny_model_dir, tmp_path_factory):
    """method -> (config, range-test result, fine-tune result), each with its method's default LR sweep."""
    work = tmp_path_factory.mktemp("discovery-by-method")
    out = {}
    for method in METHODS:
        cfg = demo_config(
            model={"base_model": str(tiny_model_dir)},
            training={"method": method},
            tracking={"tracking_uri": f"sqlite:///{work / 'mlflow.db'}", "experiment_name": f"by-method-{method}",
                      "registered_model_name": f"rf-{method}"},
            # Unset ends: the method's default sweep (config.DEFAULT_LR_RANGE).
            lr_range_test={"lr_min": None, "lr_max": None, "epochs": 6, "zoom": False},
            # The constant fine-tune at the midpoint: no halving's race (tests/steps/test_halving.py) and no samples
            # during training (each method's: tests/training/test_samples.py), which no test here reads.
            finetune={"epochs": 3, "successive_halving": False},
            sampling={"num_inference_steps": 2, "every_validations": None},
        )
        rt = run_lr_range_test(cfg, split_dir=split_dir, out_dir=work / method / "range-test")
        ft = run_finetune(cfg, split_dir=split_dir, lr_low=rt.lr_low, lr_high=rt.lr_high, lr_mid=rt.lr_mid,
                          model_dir=work / method / "finetune")
        out[method] = (cfg, rt, ft)
    return out


@pytest.mark.parametrize("method", METHODS)
def test_range_test_and_finetune_run_end_to_end(discovered, method):
    cfg, rt, ft = discovered[method]
    assert rt.status == "ok", (method, rt)
    assert 0 < rt.lr_low <= rt.lr_mid <= rt.lr_high
    assert (rt.lr_min, rt.lr_max) == cfg.lr_range_test.range_for(method)
    assert Path(rt.curve_csv).is_file() and Path(ft.curve_csv).is_file()
    assert ft.recommended_epochs >= 1 and math.isfinite(ft.best_val_loss)
    assert (Path(ft.model_dir) / "final" / DELIVERABLE[method]).is_file()


def test_adapters_and_embeddings_learn_orders_of_magnitude_higher(discovered):
    full = discovered["full"][1].lr_mid
    for method in ("lora", "textual_inversion"):
        mid = discovered[method][1].lr_mid
        assert mid >= 10 * full, f"{method} midpoint {mid:.3g} is not a decade above full's {full:.3g}"


@pytest.mark.parametrize("method", ("lora", "textual_inversion"))
def test_small_deliverables_register_as_whole_pipelines(discovered, method, tiny_model_dir, tmp_path):
    """The registry gets a pipeline that generates on its own: LoRA fused into the base, the embedding added."""
    from diffusers import UNet2DConditionModel
    from safetensors.torch import load_file
    from transformers import CLIPTextModel, CLIPTokenizer

    from rangefinder.sampling import export_pipeline

    cfg, rt, ft = discovered[method]
    whole = export_pipeline(Path(ft.model_dir) / "final", tiny_model_dir, tmp_path / "whole")
    if method == "lora":  # the adapters are in the weights now
        base = UNet2DConditionModel.from_pretrained(tiny_model_dir / "unet").state_dict()
        fused = UNet2DConditionModel.from_pretrained(whole / "unet").state_dict()
        assert set(fused) == set(base)  # no adapter layers left
        assert any(not fused[k].equal(base[k]) for k in base if "attn" in k)
    else:  # the token is in the tokenizer and its learned vector in the text encoder
        token = cfg.training.textual_inversion.placeholder_token
        tok = CLIPTokenizer.from_pretrained(whole / "tokenizer")
        token_id = tok.convert_tokens_to_ids(token)
        assert token_id != tok.unk_token_id
        learned = next(iter(load_file(Path(ft.model_dir) / "final" / "learned_embeds.safetensors").values()))
        row = CLIPTextModel.from_pretrained(whole / "text_encoder").get_input_embeddings().weight[token_id]
        assert row.detach().equal(learned.reshape(-1).to(row.dtype))
    reg = run_register_model(cfg, model_dir=ft.model_dir, lr=ft.lr, epochs=ft.recommended_epochs)
    assert reg.model_uri == f"models:/rf-{method}/1"
    mlflow.set_tracking_uri(cfg.tracking.tracking_uri)
    model = mlflow.pyfunc.load_model(f"models:/rf-{method}@candidate")
    prompt = f"a photo of a {cfg.training.textual_inversion.placeholder_token}" if method == "textual_inversion" \
        else "a red circle"
    image = decode_image(model.predict(pd.DataFrame({"prompt": [prompt], "seed": [0]}))["image"][0])
    assert image.size == (32, 32)
