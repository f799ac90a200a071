"""Textual inversion: only the new rows train; the diffusers and A1111 files load into a pipeline and generate, and
A1111's own rules accept its files under the trigger word, with the update count and base model filled in."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rangefinder.config import TrainingConfig
from rangefinder.errors import ConfigError
from rangefinder.formats.embeddings import (
    TI_A1111_DIR,
    TI_WEIGHTS_NAME,
    a1111_embedding_name,
    base_model_name,
    save_textual_inversion,
)
from rangefinder.formats.weights_file import read_metadata
from rangefinder.training.methods import make_method
from tests.formats.consumers import A1111Rejected, a1111_load_embedding, a1111_safe_check
from tests.methods.harness import load_parts, pipeline_image, state_of, train_updates

TOKEN = "<rf-concept>"
TRIGGER = "rf-concept"  # what A1111 will call it: the token less the characters file names cannot hold
UPDATES = 3
A1111_ST = f"{TI_A1111_DIR}/{TRIGGER}.safetensors"
A1111_PT = f"{TI_A1111_DIR}/{TRIGGER}.pt"


def _cfg(**ti):
    return TrainingConfig(method="textual_inversion", textual_inversion={"num_vectors": 2, **ti}, lr=5e-2, epochs=1)


@pytest.fixture(scope="module")
def trained_ti(tiny_model_dir, tmp_path_factory):
    cfg = _cfg()
    method = make_method(cfg)
    parts = load_parts(tiny_model_dir)
    before = {"unet": state_of(parts.unet), "text_encoder": state_of(parts.text_encoder)}
    # The initializer word's row: its one token as the tokenizer encodes it ("object</w>"), not the token "object",
    # which this vocabulary lacks (convert_tokens_to_ids gives the unknown token's row).
    init_row = parts.text_encoder.get_input_embeddings().weight[
        parts.tokenizer.encode(cfg.textual_inversion.initializer_token, add_special_tokens=False)[0]].detach().clone()
    method.setup(parts, torch.float32)
    train_updates(method, parts, ["", "a red circle"], updates=UPDATES, lr=5e-2)
    out = tmp_path_factory.mktemp("ti") / "final"
    out.mkdir()
    method.save_final(parts, out)
    parts.text_encoder.eval()
    return method, parts, before, init_row, out


def test_captions_carry_the_placeholder(tiny_model_dir):
    method = make_method(_cfg(learnable_property="style"))
    method.setup(load_parts(tiny_model_dir), torch.float32)
    expanded = f"{TOKEN} {TOKEN}_1"
    assert method.transform_caption("") == f"a painting in the style of {expanded}"
    assert method.transform_caption("") != method.transform_caption("")  # templates vary across captionless items
    assert method.transform_caption("a red circle") == f"a red circle, in the style of {expanded}"
    assert method.transform_caption(f"a {TOKEN} circle") == f"a {expanded} circle"
    # An object's token leads a caption that lacks it ("<tok>, caption", as the module says); its templates name it
    # as an object.
    obj = make_method(_cfg(learnable_property="object"))
    obj.setup(load_parts(tiny_model_dir), torch.float32)
    assert obj.transform_caption("a red circle") == f"{expanded}, a red circle"
    assert obj.transform_caption("") == f"a photo of a {expanded}"


def test_only_the_new_rows_train(trained_ti):
    method, parts, before, init_row, _ = trained_ti
    emb_key = next(k for k in before["text_encoder"] if "token_embedding" in k)
    now = parts.text_encoder.state_dict()
    old = before["text_encoder"][emb_key]
    keep = [i for i in range(old.shape[0]) if i not in method.token_ids]
    assert torch.equal(now[emb_key][keep], old[keep])
    assert all(torch.equal(now[k], v) for k, v in before["text_encoder"].items() if k != emb_key)
    assert all(torch.equal(parts.unet.state_dict()[k], v) for k, v in before["unet"].items())
    learned = now[emb_key][method.token_ids]
    assert not torch.equal(learned[0], init_row) and not torch.equal(learned[1], init_row)
    assert [p.shape for p in method.trainable_parameters()] == [now[emb_key].shape]


@pytest.mark.parametrize("file_name,token", [(TI_WEIGHTS_NAME, None), (A1111_ST, TOKEN), (A1111_PT, TOKEN)])
def test_embedding_files_load_and_generate(trained_ti, tiny_model_dir, file_name, token):
    from diffusers import StableDiffusionPipeline

    method, parts, _, _, out = trained_ti
    prompt = f"a photo of a {TOKEN}"
    pipe = StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)
    base_img = pipeline_image(pipe, prompt)
    pipe.load_textual_inversion(str(out / file_name), token=token)
    # The pipeline expands the token the way training did, and encodes it with the learned rows.
    ids = pipe.tokenizer(pipe.maybe_convert_prompt(prompt, pipe.tokenizer), padding="max_length", max_length=77,
                         return_tensors="pt").input_ids
    trained_ids = parts.tokenizer(method.transform_caption(prompt), padding="max_length", max_length=77,
                                  return_tensors="pt").input_ids
    assert torch.equal(ids, trained_ids)
    with torch.no_grad():
        torch.testing.assert_close(pipe.text_encoder(ids)[0], parts.text_encoder(trained_ids)[0], rtol=0, atol=1e-6)
    img = pipeline_image(pipe, prompt)
    assert np.isfinite(img).all() and np.abs(img - base_img).max() > 0


def test_final_folder_holds_the_diffusers_file_and_the_a1111_embedding_under_its_trigger_word(trained_ti):
    *_, out = trained_ti
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == sorted([TI_WEIGHTS_NAME, A1111_ST, A1111_PT])


@pytest.mark.parametrize("file_name", [A1111_ST, A1111_PT])
def test_a1111_loads_the_embedding_with_its_step_and_checkpoint(trained_ti, tiny_model_dir, file_name):
    """A1111's safe loader lets the file through, and its embedding reader finds the learned vectors under the
    trigger word; the .pt also says how many updates made it and on which model."""
    method, *_, out = trained_ti
    emb = a1111_load_embedding(out / file_name)
    assert emb["name"] == TRIGGER
    torch.testing.assert_close(emb["vec"], method.learned_embeds().float(), rtol=0, atol=0)
    if file_name.endswith(".pt"):
        assert emb["step"] == UPDATES
        assert emb["sd_checkpoint_name"] == tiny_model_dir.name


def test_the_pt_names_its_base_model_as_a1111_names_a_checkpoint(tmp_path, monkeypatch):
    """A1111 shows an embedding's sd_checkpoint_name beside its own checkpoints' names, a file's name without its
    extension: a single-file base model (what models/loading.py resolves it from: its path) is named so; a folder
    by its name, a hub id as it is, the embedded model by its name alone (not "embedded tiny model (/root/...)").
    A pipeline's steps name the base model as model.base_model spelled it: under ~, or relative to a folder the
    step does not see (it loads the resolved folder on the data volume), a file is still named by its stem."""
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "my-model").mkdir()
    assert base_model_name("~/models/sd15-pruned.safetensors") == "sd15-pruned"
    assert base_model_name("models/sd15-pruned.safetensors") == "sd15-pruned"
    assert base_model_name("~/my-model") == "my-model"
    assert base_model_name("~rf-no-such-user/sd15.safetensors") == "sd15"  # no such home: no RuntimeError either
    assert base_model_name(str(tmp_path / "SD15.SafeTensors")) == "SD15"  # the suffix in any case, as loading reads it
    assert base_model_name("embedded tiny model (/root/.cache/rangefinder/tiny-sd-0123)") == "embedded tiny model"
    assert base_model_name("None") == "embedded tiny model"  # as early releases named it, which loading reads so
    assert base_model_name(str(tmp_path / "sd15-pruned.safetensors")) == "sd15-pruned"
    assert base_model_name(str(tmp_path / "v1-5.ckpt")) == "v1-5"
    assert base_model_name(str(tmp_path / "my-model")) == "my-model"
    assert base_model_name("runwayml/stable-diffusion-v1-5@main") == "runwayml/stable-diffusion-v1-5@main"


@pytest.mark.parametrize(("base", "revision", "shorthash"), [
    ("/models/sd15.safetensors", "sha256:" + "0123456789abcdef" * 4, "0123456789"),
    ("/models/sd15", "weights:" + "a" * 32, None),  # a folder: A1111 has no checkpoint hash of one
    # As a pipeline's steps name them, as model.base_model spelt them: under home unexpanded, or relative to a folder
    # the exporting step need not run in. Still a file's or folder's name, not the spelling whole.
    ("~/models/sd15.safetensors", "sha256:" + "0123456789abcdef" * 4, "0123456789"),
    ("models/sd15", "weights:" + "a" * 32, None),
])
def test_the_pt_names_a_single_file_base_model_by_a1111_s_short_hash(base, revision, shorthash, tmp_path):
    """A1111 sets an embedding's sd_checkpoint to the checkpoint's shorthash, its sha256's first 10 hex digits
    (modules/sd_models.py CheckpointInfo), which the run's resolved revision of a single file is."""
    files = save_textual_inversion(tmp_path, TOKEN, torch.zeros(1, 8), {"rangefinder.base_model": base,
                                                                        "rangefinder.base_model_revision": revision})
    data = torch.load(files["a1111_pt"], map_location="cpu", weights_only=True)
    assert (data["sd_checkpoint"], data["sd_checkpoint_name"]) == (shorthash, "sd15")


def test_a1111_safe_check_refuses_what_torch_save_writes_by_default(tmp_path):
    """The check above can fail: torch's own zip format (what the .pt used to be) is refused by A1111's loader."""
    path = tmp_path / "plain.pt"
    torch.save({"string_to_param": {"*": torch.zeros(1, 4)}}, path)
    with pytest.raises(A1111Rejected, match="bad file inside"):
        a1111_safe_check(path)


def test_metadata_and_resume_state(trained_ti, tiny_model_dir):
    method, parts, _, _, out = trained_ti
    for name in (TI_WEIGHTS_NAME, A1111_ST):
        meta = read_metadata(out / name)
        assert meta["rangefinder.method"] == "textual_inversion" and meta["rangefinder.placeholder_token"] == TOKEN
        assert meta["rangefinder.updates"] == str(UPDATES) and meta["rangefinder.a1111_trigger"] == TRIGGER
        assert meta["rangefinder.family"] == "sd1"  # as the full and LoRA files, and SDXL's embeddings, say theirs
    state = method.trainable_state_dict()
    fresh = make_method(_cfg())
    fresh.setup(load_parts(tiny_model_dir), torch.float32)
    fresh.load_trainable_state_dict(state)
    assert torch.equal(fresh.learned_embeds(), method.learned_embeds())
    assert fresh.updates_taken == UPDATES


def test_a1111_embedding_names():
    assert a1111_embedding_name("<rf-concept>") == "rf-concept"
    assert a1111_embedding_name("my concept.v2") == "my concept.v2"
    assert a1111_embedding_name("../a/b:c") == "abc"  # never a path, nothing Windows refuses
    with pytest.raises(ValueError, match="no letter or digit"):
        a1111_embedding_name("<*>")


def test_bad_tokens_are_one_clear_error(tiny_model_dir):
    with pytest.raises(ConfigError, match="initializer_token"):
        make_method(_cfg(initializer_token="a red circle")).setup(load_parts(tiny_model_dir), torch.float32)
    with pytest.raises(ConfigError, match="already in the tokenizer"):
        make_method(_cfg(placeholder_token="red")).setup(load_parts(tiny_model_dir), torch.float32)


def test_whole_pipeline_export_keeps_the_new_tokens_for_slow_tokenizers(trained_ti, tiny_model_dir, tmp_path):
    """The pipeline registered for a textual-inversion run (embedding added to the base model) tokenizes and encodes
    the new tokens from the slow tokenizer's files alone, with every text-encoder weight in the shared layout."""
    import json
    import shutil

    from safetensors import safe_open
    from transformers import CLIPTextModel, CLIPTokenizer

    from rangefinder.sampling import export_pipeline

    method, parts, *_, out = trained_ti
    whole = export_pipeline(out, tiny_model_dir, tmp_path / "whole")
    added = json.loads((whole / "tokenizer" / "added_tokens.json").read_text())
    assert {t: added[t] for t in method.tokens} == dict(zip(method.tokens, method.token_ids, strict=True))
    slow_only = tmp_path / "slow"
    shutil.copytree(whole / "tokenizer", slow_only)
    (slow_only / "tokenizer.json").unlink()
    tok = CLIPTokenizer.from_pretrained(str(slow_only))
    prompt = method.transform_caption(f"a photo of a {TOKEN}")
    ids = tok(prompt, padding="max_length", max_length=77, return_tensors="pt").input_ids
    assert torch.equal(ids, parts.tokenizer(prompt, padding="max_length", max_length=77, return_tensors="pt").input_ids)
    with safe_open(str(whole / "text_encoder" / "model.safetensors"), framework="pt") as f:
        assert all(k.startswith("text_model.") for k in f.keys())
    te, info = CLIPTextModel.from_pretrained(str(whole / "text_encoder"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        torch.testing.assert_close(te.eval()(ids)[0], parts.text_encoder(ids)[0], rtol=0, atol=1e-6)


def test_a_folder_of_images_alone_trains_an_embedding_and_nothing_else(shapes_dataset_dir, tiny_model_dir, tmp_path,
                                                                       capsys):
    """Images with no captions, through the real CLI: `split --captionless` keeps them, textual inversion trains on
    its prompt templates and writes its embedding; LoRA, which trains on captions, refuses the split in one line
    before anything is loaded or written."""
    import shutil

    from rangefinder.cli.main import main

    data = tmp_path / "images"
    data.mkdir()
    for png in sorted(shapes_dataset_dir.glob("*.png"))[:8]:
        shutil.copy(png, data / png.name)
    split = tmp_path / "split"
    assert main(["split", str(data), "--out", str(split), "--captionless", "--resolution", "32"]) == 0
    common = ["--data", str(split), "--model", str(tiny_model_dir), "--steps", "2", "--batch-size", "2",
              "--validate-every-updates", "2"]
    assert main(["train", *common, "--out", str(tmp_path / "ti"), "--method", "textual_inversion",
                 "--lr", "5e-3"]) == 0
    assert (tmp_path / "ti" / "final" / TI_WEIGHTS_NAME).is_file()
    capsys.readouterr()
    assert main(["train", *common, "--out", str(tmp_path / "lora"), "--method", "lora", "--lr", "1e-4"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "8 images without a caption" in err and "split --captionless" in err, err
    assert not (tmp_path / "lora").exists()


def test_every_new_row_starts_at_the_initializer_s_and_sdxl_trains_both_encoders_rows(tiny_model_dir, tiny_sdxl_dir):
    """Each placeholder vector starts as the initializer word's embedding, in each text encoder (SDXL: CLIP-L and
    bigG, each through its own tokenizer), and the optimizer gets both encoders' embeddings."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components

    for parts in (load_parts(tiny_model_dir), load_sd_components(ModelConfig(base_model=str(tiny_sdxl_dir)))):
        named = {"text_encoder": (parts.text_encoder, parts.tokenizer)}
        if parts.text_encoder_2 is not None:
            named["text_encoder_2"] = (parts.text_encoder_2, parts.tokenizer_2)
        init = {name: te.get_input_embeddings().weight[tok.encode("object", add_special_tokens=False)].detach()[0]
                for name, (te, tok) in named.items()}
        method = make_method(_cfg(initializer_token="object"))
        method.setup(parts, torch.float32)
        trained = method.param_groups()[0]["params"]
        assert [id(p) for p in trained] == [id(te.get_input_embeddings().weight) for te, _ in named.values()]
        for name in named:
            learned = method.learned_embeds(name)
            assert learned.shape[0] == 2 and all(torch.equal(row, init[name]) for row in learned), name


def test_validation_captions_carry_the_placeholder_as_training_captions_do(split_dir, tiny_model_dir, tmp_path):
    """The validation loss of a textual inversion run measures the learned word: the validation and stabilize
    captions are tokenized with the placeholder's vectors, as the training captions are."""
    from rangefinder.config import ValidationConfig
    from rangefinder.training.encoding import encode_data
    from rangefinder.training.loop import TrainSpec
    from rangefinder.training.setup import native_data_config
    from tests.conftest import set_up_engine

    cfg = TrainingConfig(method="textual_inversion", textual_inversion={"num_vectors": 2}, steps=1, batch_size=2,
                         cache_dir=str(tmp_path / "cache"))
    settings, accelerator, sd, family = set_up_engine(
        TrainSpec(cfg, ValidationConfig(every_updates=1), split_dir=split_dir, model=tiny_model_dir), tmp_path / "run")
    encoded = encode_data(settings, sd, family, accelerator, native_data_config(sd))
    placeholder = set(sd.tokenizer.convert_tokens_to_ids([TOKEN, f"{TOKEN}_1"]))
    names: set[str] = set()
    for vs in encoded.val_sets:
        names.add(vs.name)
        for ids in vs.conditioning:  # (77,) token ids: the text encoder trains
            assert placeholder <= set(ids.tolist()), vs.name
    assert names == {"val", "stabilize"}
