"""Single-file SD checkpoints: the LDM layout round-trips exactly through diffusers' own converters and loader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rangefinder import __version__
from rangefinder.formats.single_file import (
    LDM_CLIP_PREFIX,
    LDM_UNET_PREFIX,
    LDM_VAE_PREFIX,
    diffusers_to_ldm_state_dict,
    export_full,
)
from rangefinder.formats.weights_file import export_metadata, read_metadata, under_home


@pytest.fixture(scope="module")
def tiny_pipe(tiny_model_dir):
    from diffusers import StableDiffusionPipeline

    return StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), safety_checker=None)


def _assert_same(a: dict, b: dict, what: str) -> None:
    assert set(a) == set(b), f"{what}: keys differ: {sorted(set(a) ^ set(b))[:5]}"
    for k in a:
        assert torch.equal(a[k].reshape(b[k].shape), b[k]), f"{what}: {k} differs"


def test_ldm_layout_inverts_diffusers_converters(tiny_pipe):
    from diffusers.loaders.single_file_utils import convert_ldm_unet_checkpoint, convert_ldm_vae_checkpoint

    sd = diffusers_to_ldm_state_dict(tiny_pipe.unet, tiny_pipe.vae, tiny_pipe.text_encoder)
    assert {k.split(".")[0] for k in sd} == {"model", "first_stage_model", "cond_stage_model"}
    assert f"{LDM_UNET_PREFIX}input_blocks.0.0.weight" in sd and f"{LDM_UNET_PREFIX}out.2.weight" in sd
    assert f"{LDM_VAE_PREFIX}encoder.mid.attn_1.q.weight" in sd
    assert sd[f"{LDM_VAE_PREFIX}encoder.mid.attn_1.q.weight"].ndim == 4  # LDM's 1x1 convolution
    assert f"{LDM_CLIP_PREFIX}text_model.embeddings.token_embedding.weight" in sd
    _assert_same(convert_ldm_unet_checkpoint(sd, tiny_pipe.unet.config), tiny_pipe.unet.state_dict(), "unet")
    _assert_same(convert_ldm_vae_checkpoint(sd, tiny_pipe.vae.config), tiny_pipe.vae.state_dict(), "vae")


def test_single_file_loads_back_with_from_single_file(tiny_model_dir, tiny_pipe, tmp_path):
    from diffusers import StableDiffusionPipeline

    meta = export_metadata(method="full", base_model=str(tiny_model_dir), lr=3e-5, epochs=4, updates=40)
    path = export_full(tiny_model_dir, tmp_path / "model.safetensors", meta)
    assert not list(tmp_path.glob(".*.tmp"))
    got = read_metadata(path)
    assert got["rangefinder.method"] == "full" and got["rangefinder.version"] == __version__
    assert float(got["rangefinder.lr"]) == 3e-5 and float(got["rangefinder.epochs"]) == 4.0
    assert got["rangefinder.base_model"] == under_home(str(tiny_model_dir))  # ~/... where the cache is under home

    loaded = StableDiffusionPipeline.from_single_file(
        str(path), config=str(tiny_model_dir), local_files_only=True, safety_checker=None
    )
    for name in ("unet", "vae", "text_encoder"):
        _assert_same(getattr(loaded, name).state_dict(), getattr(tiny_pipe, name).state_dict(), name)


def test_an_sdxl_single_file_of_a_v_prediction_folder_reads_as_v_prediction_in_comfyui(tiny_sdxl_dir, tmp_path):
    """An SDXL folder whose scheduler predicts v exports a file ComfyUI loads as V_PREDICTION (its `v_pred` tensor),
    the epsilon one a file it loads as EPS; diffusers' from_single_file takes the marked file whole, and
    rangefinder's reading of it predicts v where the folder it borrows the scheduler from predicts epsilon."""
    import json
    import shutil

    from diffusers import StableDiffusionXLPipeline
    from safetensors.torch import load_file

    from rangefinder.models.loading import predict_as_the_file_says
    from tests.formats.consumers import comfy_model_type

    folder = Path(shutil.copytree(tiny_sdxl_dir, tmp_path / "v-model"))
    config = folder / "scheduler" / "scheduler_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "prediction_type": "v_prediction"}))
    marked = export_full(folder, tmp_path / "v.safetensors")
    plain = export_full(tiny_sdxl_dir, tmp_path / "eps.safetensors")
    assert comfy_model_type(load_file(str(marked)), sdxl=True) == "V_PREDICTION"
    assert comfy_model_type(load_file(str(plain)), sdxl=True) == "EPS"

    pipe = StableDiffusionXLPipeline.from_single_file(str(marked), config=str(tiny_sdxl_dir), local_files_only=True)
    assert pipe.scheduler.config.prediction_type == "epsilon"  # the config folder's: diffusers reads no marker
    predict_as_the_file_says(pipe, marked)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    # Every weight comes back, the bigG encoder's too (open_clip's fused in_proj and transposed projection, which
    # diffusers' convert_open_clip_checkpoint splits and turns back).
    folder_pipe = StableDiffusionXLPipeline.from_pretrained(str(tiny_sdxl_dir), local_files_only=True)
    for name in ("unet", "vae", "text_encoder", "text_encoder_2"):
        _assert_same(getattr(pipe, name).state_dict(), getattr(folder_pipe, name).state_dict(), name)


def test_a_single_file_s_prediction_type_is_read_from_its_tensor_or_else_its_metadata(tmp_path):
    """ComfyUI and A1111 tell a v-prediction checkpoint by its empty `v_pred` tensor, which files without a model spec
    carry alone; rangefinder's reading takes that first, then `modelspec.predict_key`, else says nothing."""
    from safetensors.torch import save_file

    from rangefinder.formats.model_spec import PREDICT_KEY
    from rangefinder.formats.single_file import V_PRED_KEY, single_file_prediction_type

    weight = {"model.diffusion_model.out.2.bias": torch.zeros(4)}
    cases = {"tensor only": ({**weight, V_PRED_KEY: torch.tensor([])}, None, "v_prediction"),
             "key only": (weight, {PREDICT_KEY: "v"}, "v_prediction"),
             "epsilon": (weight, {PREDICT_KEY: "epsilon"}, "epsilon"),
             "nothing": (weight, None, None)}
    for name, (tensors, metadata, predicts) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        save_file(tensors, str(path), metadata)
        assert single_file_prediction_type(path) == predicts, name


# ---------------------------------------------------------------------------------------------------------------
# diffusers folders: transformers 5.x here, and 4.x's own loaders in a venv of their own

PROMPTS = ["a red circle", "a photo of the small blue square", "<rf-added> on the left"]

# Runs inside the transformers 4.x venv: load the folder's text encoder and both tokenizers with 4.x's own classes and
# report what they made of it.
TRANSFORMERS4_SCRIPT = """
import json, sys
import torch, transformers
from safetensors.torch import save_file
from transformers import CLIPTextModel, CLIPTokenizer, CLIPTokenizerFast

prompts = json.loads(sys.argv[1])
reports = []
for folder, out in zip(sys.argv[2::2], sys.argv[3::2]):
    model, info = CLIPTextModel.from_pretrained(folder, subfolder="text_encoder", output_loading_info=True)
    slow = CLIPTokenizer.from_pretrained(folder, subfolder="tokenizer")
    fast = CLIPTokenizerFast.from_pretrained(folder, subfolder="tokenizer")
    ids = slow(prompts, padding="max_length", max_length=slow.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        hidden = model.eval()(ids)[0]
    save_file({"ids": ids.contiguous(), "hidden": hidden.contiguous()}, out)
    reports.append({"version": transformers.__version__, "slow_class": type(slow).__name__,
                    "fast_ids": fast(prompts, padding="max_length", max_length=77).input_ids,
                    **{k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys")}})
print(json.dumps(reports))
"""


@pytest.fixture(scope="module")
def saved_folder(tiny_model_dir, tmp_path_factory):
    """A pipeline folder as a full fine-tune's `final/` is written (full.save_pipeline), its tokenizer extended by a
    token as textual inversion extends it, so added tokens are covered too."""
    from rangefinder.training.methods.full import save_pipeline
    from tests.methods.harness import load_parts

    parts = load_parts(tiny_model_dir)
    parts.tokenizer.add_tokens(["<rf-added>"])
    parts.text_encoder.resize_token_embeddings(len(parts.tokenizer), mean_resizing=False)
    out = tmp_path_factory.mktemp("pipeline") / "final"
    out.mkdir()
    save_pipeline(parts, out)
    return out, parts


def _hidden(text_encoder, tokenizer, prompts):
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    with torch.no_grad():
        return ids, text_encoder.eval()(ids)[0]


@pytest.mark.parametrize("which", ["tiny model", "full fine-tune final/"])
def test_diffusers_folder_loads_in_transformers_5_with_no_key_missing(which, tiny_model_dir, saved_folder, tmp_path):
    import shutil

    from safetensors import safe_open
    from transformers import CLIPTextModel, CLIPTokenizer

    folder = tiny_model_dir if which == "tiny model" else saved_folder[0]
    with safe_open(str(folder / "text_encoder" / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert f.metadata().get("format") == "pt"
    assert keys and all(k.startswith("text_model.") for k in keys)  # the layout transformers 4.x and 5.x share
    model, info = CLIPTextModel.from_pretrained(str(folder / "text_encoder"), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info

    # The slow tokenizer's files are complete: built from vocab.json/merges.txt alone (+ the added tokens in
    # tokenizer_config.json), the tokenizer gives the ids tokenizer.json gives.
    assert (folder / "tokenizer" / "vocab.json").is_file() and (folder / "tokenizer" / "merges.txt").is_file()
    slow_only = tmp_path / "tokenizer"
    shutil.copytree(folder / "tokenizer", slow_only)
    (slow_only / "tokenizer.json").unlink()
    from_bpe = CLIPTokenizer.from_pretrained(str(slow_only))
    from_json = CLIPTokenizer.from_pretrained(str(folder / "tokenizer"))
    assert from_bpe(PROMPTS).input_ids == from_json(PROMPTS).input_ids
    if which != "tiny model":
        assert from_bpe.convert_tokens_to_ids("<rf-added>") == saved_folder[1].tokenizer.convert_tokens_to_ids(
            "<rf-added>")
        _, expected = _hidden(saved_folder[1].text_encoder, saved_folder[1].tokenizer, PROMPTS)
        torch.testing.assert_close(_hidden(model, from_bpe, PROMPTS)[1], expected, rtol=0, atol=0)


def test_text_encoder_saved_without_the_prefix_is_rewritten(tiny_model_dir, tmp_path):
    """What transformers 5 writes for a CLIPTextModel built from scratch, unprefixed, becomes the shared layout."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import CLIPTextModel

    from rangefinder.formats.diffusers_folder import write_text_encoder_weights_with_prefix

    te_dir = tmp_path / "text_encoder"
    shutil.copytree(tiny_model_dir / "text_encoder", te_dir)
    original = load_file(str(te_dir / "model.safetensors"))
    save_file({k.removeprefix("text_model."): v for k, v in original.items()}, str(te_dir / "model.safetensors"))
    write_text_encoder_weights_with_prefix(te_dir)
    rewritten = load_file(str(te_dir / "model.safetensors"))
    assert set(rewritten) == set(original) and all(torch.equal(rewritten[k], original[k]) for k in original)
    assert not list(te_dir.glob(".*.tmp"))
    _, info = CLIPTextModel.from_pretrained(str(te_dir), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.fixture(scope="module")
def read_by_transformers_4(transformers4_python, tiny_model_dir, saved_folder, tmp_path_factory):
    """{which: (folder, report, the ids and embeddings file)}: both folders read by transformers 4.x in one process
    of its venv (its imports are most of the cost of each)."""
    import json
    import subprocess

    folders = {"tiny model": tiny_model_dir, "full fine-tune final/": saved_folder[0]}
    work = tmp_path_factory.mktemp("transformers4")
    outs = {which: work / f"t4-{i}.safetensors" for i, which in enumerate(folders)}
    proc = subprocess.run([str(transformers4_python), "-c", TRANSFORMERS4_SCRIPT, json.dumps(PROMPTS),
                           *(str(p) for which in folders for p in (folders[which], outs[which]))],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = json.loads(proc.stdout.strip().splitlines()[-1])
    return {which: (folders[which], report, outs[which]) for which, report in zip(folders, reports, strict=True)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["tiny model", "full fine-tune final/"])
def test_diffusers_folder_loads_in_transformers_4(which, read_by_transformers_4):
    """transformers 4.x's own CLIPTextModel, slow CLIPTokenizer and fast tokenizer load the folder with no key
    missing, and give the text embeddings transformers 5 gives here."""
    from safetensors.torch import load_file
    from transformers import CLIPTextModel, CLIPTokenizer

    folder, report, out = read_by_transformers_4[which]
    assert report["version"].startswith("4.") and report["slow_class"] == "CLIPTokenizer"
    assert report["missing_keys"] == [] and report["unexpected_keys"] == [], report

    ids5, hidden5 = _hidden(CLIPTextModel.from_pretrained(str(folder / "text_encoder")),
                            CLIPTokenizer.from_pretrained(str(folder / "tokenizer")), PROMPTS)
    got = load_file(str(out))
    assert torch.equal(got["ids"], ids5)
    assert report["fast_ids"] == ids5.tolist()
    torch.testing.assert_close(got["hidden"], hidden5, rtol=0, atol=1e-6)


def test_the_same_weights_and_facts_make_the_same_file_in_every_process(tmp_path):
    """safetensors writes `__metadata__` from a hash map seeded per process, so an export of the same weights with
    the same facts once had other bytes (another sha256) in each run, a resumed run's included. The header's
    metadata is now in key order; the file still reads back whole, in safetensors' own reader and diffusers'."""
    import hashlib
    import json
    import subprocess
    import sys

    from safetensors.torch import load_file

    write = ("import sys, torch; from pathlib import Path; from rangefinder.formats.weights_file import "
             "save_safetensors; save_safetensors({'b': torch.arange(5.0), 'a': torch.zeros(2, 3)}, Path(sys.argv[1]), "
             "metadata={f'rangefinder.k{i}': f'v\\u00e9{i}\"' for i in range(16)})")
    paths = [tmp_path / f"{i}.safetensors" for i in range(3)]
    for p in paths:
        subprocess.run([sys.executable, "-c", write, str(p)], check=True, timeout=120)
    assert len({hashlib.sha256(p.read_bytes()).hexdigest() for p in paths}) == 1
    raw = paths[0].read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    assert list(header["__metadata__"]) == sorted(header["__metadata__"])
    assert read_metadata(paths[0])["rangefinder.k3"] == 'v\u00e93"'
    assert torch.equal(load_file(str(paths[0]))["b"], torch.arange(5.0))


def test_delivered_weights_files_have_the_mode_a_usual_write_gives(saved_folder, tmp_path):
    """safetensors creates its file 0600, so an exported LoRA, embedding or model file, and the weights of a full
    fine-tune's folder (diffusers' save_pretrained writes through it), were unreadable to the group and others: a
    serving tool run as another user, or a shared volume's readers, could not load them. They get 0666 less the
    umask, as the folder's other files (config.json) have; the umask still decides."""
    import os
    import stat

    from rangefinder.formats.weights_file import save_safetensors

    folder, _ = saved_folder
    weights = sorted(folder.rglob("*.safetensors"))
    assert {"unet", "vae", "text_encoder"} <= {p.parent.name for p in weights}
    usual = stat.S_IMODE((folder / "unet" / "config.json").stat().st_mode)
    assert usual == 0o666 & ~os.umask(os.umask(0o022))  # the process's umask, put straight back
    modes = {str(p.relative_to(folder)): oct(stat.S_IMODE(p.stat().st_mode)) for p in weights}
    assert modes == dict.fromkeys(modes, oct(usual))
    previous = os.umask(0o027)
    try:
        path = save_safetensors({"a": torch.zeros(2)}, tmp_path / "lora.safetensors")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(path.stat().st_mode) == 0o640


@pytest.mark.parametrize("which", ["full fine-tune final/", "pipeline loaded whole"])
def test_a_delivered_folder_s_configs_name_no_path_of_the_machine_that_wrote_it(which, saved_folder, tiny_pipe,
                                                                                tiny_model_dir, tmp_path):
    """diffusers' save_pretrained writes the folder each model was loaded from (`_name_or_path`) into its
    config.json, and a pipeline loaded whole (sampling.export_pipeline's, a LoRA fused into its base model for the
    registry) into model_index.json: a full fine-tune's final/ and a registered pipeline named the trainer's
    base-model folder (/home/<user>/..., a cache path) to whoever they were shared with, and the folder's revision
    changed when only that path did. No file of the folder names it; the folder still loads (the tests above)."""
    from rangefinder.formats.diffusers_folder import save_pipeline_folder

    folder = saved_folder[0] if which == "full fine-tune final/" else save_pipeline_folder(tiny_pipe, tmp_path / "f")
    named = [p.relative_to(folder).as_posix() for p in sorted(folder.rglob("*.json"))
             if str(tiny_model_dir) in p.read_text() or "_name_or_path" in p.read_text()]
    assert named == []
