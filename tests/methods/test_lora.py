"""LoRA: only adapters train; both files load in diffusers and in ComfyUI, every key, and reproduce the trained model
(alpha != rank, adapters on attention, linear and convolution layers); the pipeline they are exported and registered
as is the base model with them fused."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from rangefinder.config import TrainingConfig
from rangefinder.formats.lora import LORA_KOHYA_NAME, LORA_WEIGHTS_NAME, trained_lora_layers
from rangefinder.training.methods import make_method
from rangefinder.training.methods.base import UPDATES_KEY
from tests.formats.consumers import comfy_load_lora, comfy_patched_state, comfy_sd1_key_map
from tests.methods.harness import load_parts, pipeline_image, state_of, train_updates, unet_output
from tests.tracking.fixtures import clean_mlflow_env  # noqa: F401  (no MLflow run of the caller's leaks in)

RANK, ALPHA = 4, 8.0  # alpha != rank, so a file that drops the scale alpha/rank is caught
UPDATES = 3
# Attention projections (to_out.0: the one ComfyUI names without its `.0`), a 1x1 convolution (proj_in), a linear
# layer outside attention (ff.net.2) and 3x3 convolutions (conv1).
TARGETS = ["to_k", "to_q", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1"]
PROMPT_IDS_TEXT = ["a red circle"]


@pytest.fixture(scope="module")
def trained_lora(tiny_model_dir, tmp_path_factory):
    cfg = TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA, "train_text_encoder": True,
                                              "target_modules": TARGETS}, lr=1e-2, epochs=1)
    method = make_method(cfg)
    parts = load_parts(tiny_model_dir)
    before = {"unet": state_of(parts.unet), "text_encoder": state_of(parts.text_encoder)}
    method.setup(parts, torch.float32)
    train_updates(method, parts, ["a red circle", "a blue square"], updates=UPDATES, lr=1e-2)
    out = tmp_path_factory.mktemp("lora") / "final"
    out.mkdir()
    method.save_final(parts, out)
    parts.unet.eval()
    parts.text_encoder.eval()
    return method, parts, before, out, cfg


def test_only_adapters_train_and_base_weights_are_unchanged(trained_lora):
    method, parts, before, _, _ = trained_lora
    trainable = method.trainable_parameters()
    named = {id(p): n for m in method.trainable_modules().values() for n, p in m.named_parameters()}
    assert trainable and all("lora_" in named[id(p)] for p in trainable)
    assert all(k.split(".", 1)[1].count("lora_") for k in method.trainable_state_dict() if k != UPDATES_KEY)
    for name in ("unet", "text_encoder"):
        state = getattr(parts, name).state_dict()
        now = {k.replace(".base_layer", ""): v for k, v in state.items() if "lora_" not in k}
        assert set(now) == set(before[name])
        assert all(torch.equal(now[k], before[name][k]) for k in before[name]), f"{name} base weights moved"


def _te_out(text_encoder, tokenizer):
    ids = tokenizer(PROMPT_IDS_TEXT, padding="max_length", max_length=77, return_tensors="pt").input_ids
    with torch.no_grad():
        return text_encoder(ids)[0]


def _trained_modules(parts) -> set[tuple[str, str]]:
    return {(part, f"{path}.weight") for part in ("unet", "text_encoder")
            for path in trained_lora_layers(getattr(parts, part))}


@pytest.mark.parametrize("weight_name", [LORA_WEIGHTS_NAME, LORA_KOHYA_NAME])
def test_diffusers_loads_every_adapter_and_reproduces_the_trained_model(trained_lora, tiny_model_dir, weight_name):
    from diffusers import StableDiffusionPipeline

    _, parts, _, out, _ = trained_lora
    trained = unet_output(parts.unet)
    base = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    base_out, base_img = unet_output(base.unet), pipeline_image(base, "a red circle")
    assert not torch.allclose(trained, base_out)

    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    pipe.load_lora_weights(str(out), weight_name=weight_name, adapter_name="loaded")
    # Every trained adapter, and nothing else, is in place (a file key diffusers dropped would leave one out).
    loaded = {(part, f"{path}.weight") for part in ("unet", "text_encoder")
              for path in trained_lora_layers(getattr(pipe, part), adapter="loaded")}
    assert loaded == _trained_modules(parts)
    torch.testing.assert_close(unet_output(pipe.unet), trained, rtol=0, atol=1e-5, msg=weight_name)
    torch.testing.assert_close(_te_out(pipe.text_encoder, pipe.tokenizer), _te_out(parts.text_encoder, parts.tokenizer),
                               rtol=0, atol=1e-5)
    img = pipeline_image(pipe, "a red circle")
    assert np.abs(img - base_img).max() > 0, f"{weight_name} did not change the output"


@pytest.mark.parametrize("weight_name", [LORA_WEIGHTS_NAME, LORA_KOHYA_NAME])
def test_comfyui_maps_every_key_and_reproduces_the_trained_model(trained_lora, tiny_model_dir, weight_name):
    """ComfyUI's key map and LoRA reader (re-expressed in tests/formats/consumers.py) take every tensor of the file,
    patch every trained module, and the patched weights compute what the trained adapters compute."""
    from safetensors.torch import load_file

    _, parts, _, out, _ = trained_lora
    base = load_parts(tiny_model_dir)
    patches, left_over = comfy_load_lora(load_file(str(out / weight_name)), comfy_sd1_key_map(base.unet,
                                                                                              base.text_encoder))
    assert not left_over, f"ComfyUI would not load {sorted(left_over)[:5]}"
    assert set(patches) == _trained_modules(parts)
    base.unet.load_state_dict(comfy_patched_state(base.unet.state_dict(), patches, "unet"))
    base.text_encoder.load_state_dict(comfy_patched_state(base.text_encoder.state_dict(), patches, "text_encoder"))
    torch.testing.assert_close(unet_output(base.unet), unet_output(parts.unet), rtol=0, atol=1e-5)
    torch.testing.assert_close(_te_out(base.text_encoder, base.tokenizer), _te_out(parts.text_encoder, parts.tokenizer),
                               rtol=0, atol=1e-5)


def test_comfyui_check_catches_a_peft_named_file(trained_lora, tiny_model_dir, tmp_path):
    """What diffusers' own `save_lora_weights` writes (peft names, the file shipped before): ComfyUI maps none of its
    attention projections (all the UNet keys with the default target modules); it finds the other modules. The
    check above would fail on such a file."""
    from diffusers import StableDiffusionPipeline
    from diffusers.utils import convert_state_dict_to_diffusers
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    _, parts, _, _, _ = trained_lora
    StableDiffusionPipeline.save_lora_weights(
        str(tmp_path), unet_lora_layers=convert_state_dict_to_diffusers(get_peft_model_state_dict(parts.unet)),
        safe_serialization=True)
    lora = load_file(str(tmp_path / LORA_WEIGHTS_NAME))
    base = load_parts(tiny_model_dir)
    patches, left_over = comfy_load_lora(lora, comfy_sd1_key_map(base.unet, base.text_encoder))
    attention = {k for k in lora if ".to_" in k}
    assert attention and left_over == attention
    assert patches and not any(".to_" in key for _, key in patches)


def test_the_exported_pipeline_is_the_base_model_with_the_adapters_fused_at_their_scale(trained_lora, tiny_model_dir,
                                                                                       tmp_path):
    """export_pipeline (what the registry logs of a LoRA run): a plain pipeline folder whose UNet and text encoder
    compute what the trained adapters on the base model compute (fused at alpha / rank, not left out nor scaled
    otherwise), and which generates what the base model with the LoRA loaded generates, not what the base does."""
    from diffusers import StableDiffusionPipeline

    from rangefinder.sampling import export_pipeline

    _, parts, _, out, _ = trained_lora
    exported = StableDiffusionPipeline.from_pretrained(str(export_pipeline(out, tiny_model_dir, tmp_path / "whole")),
                                                       safety_checker=None)
    assert not any("lora_" in k for part in (exported.unet, exported.text_encoder) for k in part.state_dict())
    torch.testing.assert_close(unet_output(exported.unet), unet_output(parts.unet), rtol=0, atol=1e-5)
    torch.testing.assert_close(_te_out(exported.text_encoder, exported.tokenizer),
                               _te_out(parts.text_encoder, parts.tokenizer), rtol=0, atol=1e-5)
    with_lora = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    with_lora.load_lora_weights(str(out), weight_name=LORA_WEIGHTS_NAME)
    base = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    image = pipeline_image(exported, "a red circle")
    np.testing.assert_allclose(image, pipeline_image(with_lora, "a red circle"), rtol=0, atol=1e-4)
    assert np.abs(image - pipeline_image(base, "a red circle")).max() > 1e-2


@pytest.mark.usefixtures("clean_mlflow_env")
def test_a_run_without_a_chosen_checkpoint_registers_its_final_lora_fused_with_the_files_beside(trained_lora,
                                                                                              tiny_model_dir, tmp_path):
    """register-model on a LoRA run's folder with no chosen/ (no validation to choose by, or the full-data retrain):
    the version is the run's final weights, as a whole pipeline built from the base model with the adapters fused
    (the UNet computes what the trained adapters do), and the LoRA files final/ delivered are beside it, byte for
    byte, for the tools that load them."""
    import mlflow
    from diffusers import UNet2DConditionModel
    from mlflow import MlflowClient

    from rangefinder.config import demo_config
    from rangefinder.steps.register_model import run_register_model

    _, parts, _, final, _ = trained_lora
    run_dir = final.parent  # what the step is handed: the run's folder, final/ inside, no chosen/
    assert sorted(p.name for p in run_dir.iterdir()) == ["final"]
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cfg = demo_config(model={"base_model": str(tiny_model_dir)},
                      tracking={"tracking_uri": uri, "experiment_name": "lora-final", "registered_model_name": "rf"})
    registered = run_register_model(cfg, model_dir=run_dir, lr=1e-2, epochs=1)
    assert (registered.model_uri, registered.weights) == ("models:/rf/1", final)
    assert MlflowClient(uri).get_model_version("rf", "1").tags["rangefinder.weights"] == "finetune final"
    mlflow.set_tracking_uri(uri)
    local = Path(mlflow.artifacts.download_artifacts(registered.model_uri, dst_path=str(tmp_path / "registered")))
    (pipeline,) = {p.parent for p in local.rglob("model_index.json")}
    unet = UNet2DConditionModel.from_pretrained(str(pipeline / "unet"))
    torch.testing.assert_close(unet_output(unet), unet_output(parts.unet), rtol=0, atol=1e-5)
    beside = local / "artifacts" / "delivered"
    files = sorted(p.relative_to(final) for p in final.rglob("*") if p.is_file())
    assert sorted(p.relative_to(beside) for p in beside.rglob("*") if p.is_file()) == files
    assert all((beside / f).read_bytes() == (final / f).read_bytes() for f in files)
    # The version's description names both folders, as the consumer downloading it finds them.
    description = MlflowClient(uri).get_model_version("rf", "1").description
    assert (f"its `artifacts/{pipeline.name}/` is a diffusers folder" in description
            and pipeline.parent == local / "artifacts" and "`artifacts/delivered/` the files the run delivered" in
            description), description


def test_files_have_their_consumers_keys_alpha_and_metadata(trained_lora):
    _, _, _, out, cfg = trained_lora
    with safe_open(str(out / LORA_KOHYA_NAME), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
        alphas = [f.get_tensor(k) for k in keys if k.endswith(".alpha")]
    assert any(k.startswith("lora_unet_") and k.endswith(".lora_down.weight") for k in keys)
    assert any(k.startswith("lora_te_text_model_encoder_layers_") for k in keys)
    assert alphas and all(float(a) == ALPHA for a in alphas)
    assert meta["ss_network_dim"] == str(RANK) and float(meta["ss_network_alpha"]) == ALPHA
    assert meta["ss_steps"] == str(UPDATES)
    with safe_open(str(out / LORA_WEIGHTS_NAME), framework="pt") as f:
        dkeys, dmeta = list(f.keys()), f.metadata()
    # alpha/rank is folded into the weights: no `.alpha` (diffusers refuses it in these names) and no peft config
    # (which would make diffusers scale a second time).
    assert not any(k.endswith(".alpha") for k in dkeys) and "lora_adapter_metadata" not in dmeta
    assert any(".processor.to_out_lora.up.weight" in k for k in dkeys)
    for m in (meta, dmeta):
        assert m["rangefinder.method"] == "lora" and float(m["rangefinder.lr"]) == cfg.lr
        assert m["rangefinder.lora_rank"] == str(RANK) and "rangefinder.version" in m
        assert m["rangefinder.updates"] == str(UPDATES) and m["rangefinder.family"] == "sd1"


def test_checkpoint_state_round_trips_bit_for_bit(trained_lora, tiny_model_dir):
    method, parts, _, _, cfg = trained_lora
    state = {k: v.clone() for k, v in method.trainable_state_dict().items()}
    fresh = make_method(cfg)
    fresh_parts = load_parts(tiny_model_dir)
    fresh.setup(fresh_parts, torch.float32)
    fresh.load_trainable_state_dict(state)
    assert all(torch.equal(v, state[k]) for k, v in fresh.trainable_state_dict().items())
    assert fresh.updates_taken == UPDATES
    fresh_parts.unet.eval()
    assert torch.equal(unet_output(fresh_parts.unet), unet_output(parts.unet))
    with pytest.raises(ValueError, match="same training.lora settings"):
        fresh.load_trainable_state_dict({k: v for k, v in list(state.items())[1:]})


@pytest.mark.slow
def test_engine_keeps_optimizer_state_for_adapters_only(tiny_model_dir, split_dir, tmp_path):
    """Through the engine (text encoder not trained): AdamW holds state for the UNet's adapters and nothing else,
    the frozen weights take no gradients, and the adapters have no dropout (peft then skips it: nn.Identity)."""
    from rangefinder.config import ValidationConfig
    from rangefinder.training.loop import TrainSpec, train

    cfg = TrainingConfig(method="lora", batch_size=4, steps=1, seed=7, cache_dir=str(tmp_path / "cache"),
                         checkpoint_every_updates=1)
    assert cfg.lora.dropout == 0.0
    parts = load_parts(tiny_model_dir)
    method = make_method(cfg)
    method.setup(parts, torch.float32)
    adapters = [n for n, p in parts.unet.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n in adapters)
    assert not any(p.requires_grad for p in parts.text_encoder.parameters())
    dropouts = [m for n, m in parts.unet.named_modules() if n.endswith("lora_dropout.default")]
    assert dropouts and all(isinstance(m, torch.nn.Identity) for m in dropouts)

    result = train(TrainSpec(cfg, ValidationConfig(every_epochs=0), split_dir=split_dir, model=tiny_model_dir),
                   out_dir=tmp_path / "run", save_final=False)
    optimizer = torch.load(result.checkpoints[-1] / "optimizer.pt", weights_only=True)
    assert len(optimizer["state"]) == len(adapters)  # one AdamW state per adapter tensor, none for frozen weights
    shapes = sorted(tuple(s["exp_avg"].shape) for s in optimizer["state"].values())
    assert shapes == sorted(tuple(p.shape) for p in parts.unet.parameters() if p.requires_grad)


def test_setup_puts_fp32_adapters_with_the_set_scale_and_dropout_on_the_set_modules_of_half_weights(tiny_model_dir):
    """Under mixed precision the frozen weights are cast down and the adapters stay fp32 (the optimizer's masters);
    alpha / rank scales every adapter, lora.dropout is its dropout, the UNet's adapters sit on lora.target_modules
    and the text encoder's (training.train_text_encoder, the CLI's flag, asks for them as lora.train_text_encoder
    does) on every attention projection of CLIP."""
    cfg = TrainingConfig(method="lora", lora={"rank": RANK, "alpha": ALPHA, "dropout": 0.25}, train_text_encoder=True)
    parts = load_parts(tiny_model_dir)
    method = make_method(cfg)
    method.setup(parts, torch.bfloat16)
    assert set(method.trainable_modules()) == {"unet", "text_encoder"} and method.text_encoder_changes
    for part, targets in (("unet", cfg.lora.target_modules), ("text_encoder", ["q_proj", "k_proj", "v_proj",
                                                                                "out_proj"])):
        module = getattr(parts, part)
        layers = {n: m for n, m in module.named_modules() if hasattr(m, "lora_A")}
        assert layers and set(layers) == {n for n, _ in module.named_modules()
                                          if any(n.endswith(f".{t}") for t in targets)}, part
        assert all(m.scaling["default"] == ALPHA / RANK and m.lora_dropout["default"].p == 0.25
                   for m in layers.values()), part
        for n, p in module.named_parameters():
            assert p.dtype == (torch.float32 if "lora_" in n else torch.bfloat16), (part, n, p.dtype)
            assert p.requires_grad == ("lora_" in n), (part, n)


def test_the_adapters_initial_weights_follow_the_training_seed(split_dir, tiny_model_dir, tmp_path):
    """The engine seeds the global RNG with training.seed before the method builds its adapters (training/setup.py
    load_model): the same seed gives the same initial LoRA, another seed another one. And the trained modules
    checkpoint their activations as training.gradient_checkpointing says."""
    from rangefinder.config import ValidationConfig
    from rangefinder.training.loop import TrainSpec
    from tests.conftest import set_up_engine

    initial, checkpointing = [], []
    for run, seed in enumerate((1, 2, 1)):
        cfg = TrainingConfig(method="lora", steps=1, batch_size=2, seed=seed, gradient_checkpointing=run == 0,
                             cache_dir=str(tmp_path / "cache"))
        settings = set_up_engine(TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir,
                                           model=tiny_model_dir), tmp_path / f"run{run}")[0]
        initial.append(torch.cat([p.detach().flatten() for m in settings.method.trainable_modules().values()
                                  for p in m.parameters() if p.requires_grad]))
        checkpointing.append({m.is_gradient_checkpointing for m in settings.method.trainable_modules().values()})
    assert torch.equal(initial[0], initial[2]) and not torch.equal(initial[0], initial[1])
    assert checkpointing == [{True}, {False}, {False}]
