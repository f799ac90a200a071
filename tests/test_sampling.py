"""The sampling grid: one column per model, one row per prompt x seed, only the weights differ along a row."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from rangefinder.cli.main import main as cli_main
from rangefinder.errors import ConfigError
from rangefinder.sampling import read_prompts, render_grid

PROMPTS = ["a red circle", "a blue square"]
SEEDS = [0, 7]


@pytest.fixture(scope="module")
def base_twice_grid(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    return render_grid(
        [tiny_model_dir, tiny_model_dir], PROMPTS, SEEDS, out_dir=out, steps=4, guidance_scale=3.0, device="cpu"
    )


def test_grid_has_one_cell_per_model_prompt_and_seed(base_twice_grid):
    r = base_twice_grid
    rows, cols = len(PROMPTS) * len(SEEDS), 2
    lay = r["layout"]
    assert (lay["rows"], lay["cols"]) == (rows, cols)
    grid = Image.open(r["grid"])
    assert grid.size == (lay["label_width"] + cols * lay["cell"], lay["header_height"] + rows * lay["cell"])
    assert len(r["images"]) == rows and all(len(row) == cols for row in r["images"])
    singles = {p for row in r["images"] for p in row}
    assert len(singles) == rows * cols
    for row_i, row in enumerate(r["images"]):
        for col_i, path in enumerate(row):
            single = Image.open(path).convert("RGB")
            # Each single image is what the grid shows in its cell (upscaled with nearest-neighbour).
            x0, y0 = lay["label_width"] + col_i * lay["cell"], lay["header_height"] + row_i * lay["cell"]
            cell = grid.crop((x0, y0, x0 + lay["cell"], y0 + lay["cell"]))
            expect = single.resize((lay["cell"], lay["cell"]), Image.NEAREST)
            assert np.array_equal(np.asarray(cell), np.asarray(expect))
    manifest = json.loads(open(r["manifest"]).read())
    assert [c["label"] for c in manifest["columns"]] == [c["label"] for c in r["columns"]]
    page = open(r["html"]).read()
    assert page.count("data:image/png;base64,") == rows * cols
    # The prompts name a colour and a shape: each column is scored on its own single images.
    from rangefinder.data.prompt_score import score_images

    assert [s["column"] for s in manifest["scores"]] == [c["label"] for c in r["columns"]]
    prompts = [row["prompt"] for row in r["rows"]]
    for c, score in enumerate(manifest["scores"]):
        expect = score_images([Image.open(row[c]) for row in r["images"]], prompts)
        assert expect is not None and score["images"] == rows
        assert (score["colour"], score["shape"]) == pytest.approx((expect["colour"], expect["shape"]))
    assert manifest["scores"][0]["colour"] == manifest["scores"][1]["colour"]  # the same weights twice
    assert "Does it follow the prompts?" in page


def test_the_manifest_names_the_grid_s_files_in_its_folder_wherever_the_folder_goes(base_twice_grid, tmp_path):
    """The sample-images step logs the grid's folder to MLflow (`samples/`): downloaded on another machine, its
    grid.json must find the grid, the page and every cell in the copy, not in the folder it was rendered in."""
    import shutil
    from pathlib import Path

    rendered = Path(base_twice_grid["manifest"]).parent
    copy = Path(shutil.copytree(rendered, tmp_path / "downloaded" / "samples"))
    text = (copy / "grid.json").read_text()
    assert str(rendered) not in text
    manifest = json.loads(text)
    assert (copy / manifest["manifest"]).samefile(copy / "grid.json")
    assert Image.open(copy / manifest["grid"]).size == tuple(manifest["layout"]["size"])
    assert "data:image/png;base64," in (copy / manifest["html"]).read_text()
    for row, rendered_row in zip(manifest["images"], base_twice_grid["images"], strict=True):
        for path, original in zip(row, rendered_row, strict=True):
            assert (copy / path).read_bytes() == Path(original).read_bytes()


def test_identical_weights_and_seed_give_identical_cells(base_twice_grid):
    for row in base_twice_grid["images"]:
        a, b = (np.asarray(Image.open(p)) for p in row)
        assert np.array_equal(a, b)
    # ... while another seed gives another image (the seed is really used).
    rows = base_twice_grid["images"]
    assert not np.array_equal(np.asarray(Image.open(rows[0][0])), np.asarray(Image.open(rows[1][0])))


def test_cli_sample_writes_grid(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("# comment\na red circle\n\n")
    out = tmp_path / "out"
    rc = cli_main(["sample", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--seeds", "3",
                   "--out", str(out), "--steps", "2", "--scheduler", "DDIMScheduler", "--json"])
    assert rc == 0
    result = json.loads(capsys.readouterr().out)
    assert result["images"] == 1 and (out / "grid.png").is_file() and (out / "grid.json").is_file()


def test_cli_sample_takes_a_single_file_or_a_hub_id_as_its_base_model_as_train_does(tiny_model_dir, fake_hub_cache,
                                                                                    tmp_path, capsys, monkeypatch):
    """`sample --model` took a diffusers folder alone: the checkpoint file or hub id a run trained on was "not a
    diffusers folder (no model_index.json)". Each is resolved as `train --model` resolves it, and draws the same
    cell as the folder it holds."""
    from rangefinder.formats.single_file import export_full
    from rangefinder.formats.weights_file import export_metadata
    from tests.conftest import HUB_REPO

    cache, _ = fake_hub_cache
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("RANGEFINDER_CACHE", str(tmp_path / "rf-cache"))  # where the file is converted
    single = export_full(tiny_model_dir, tmp_path / "sd.safetensors",
                         export_metadata(method="full", base_model=str(tiny_model_dir)))
    cells = []
    for name, model in (("folder", tiny_model_dir), ("file", single), ("hub", HUB_REPO)):
        rc = cli_main(["sample", "--model", str(model), "--prompts", str(_one_prompt(tmp_path)), "--seeds", "3",
                       "--out", str(tmp_path / name), "--steps", "1", "--json"])
        assert rc == 0, capsys.readouterr().err
        result = json.loads(capsys.readouterr().out)
        assert result["columns"] == [{"folder": tiny_model_dir.name, "file": "sd", "hub": "tiny-sd"}[name]]
        cells.append(np.asarray(Image.open(tmp_path / name / "images" / f"00-{result['columns'][0]}" / "p00-s3.png")))
    assert all(np.array_equal(cells[0], c) for c in cells[1:])


def _one_prompt(tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    return prompts


def test_cli_sample_renders_at_the_model_s_own_guidance_unless_told(tiny_flux_dir, tiny_schnell_dir, tmp_path,
                                                                    capsys):
    """`rangefinder sample` without --guidance sampled every family at 7.5; a Flux.1-dev model (the tiny one takes
    guidance) samples at FluxPipeline's own, 3.5: the grid says so, and its cell is the one FluxPipeline renders when
    given no guidance scale. --guidance still sets it."""
    import diffusers
    import torch

    from rangefinder.models.loading import pipeline_call_kwargs

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    cells = {}
    for name, extra in (("own", []), ("told", ["--guidance", "7.5"])):
        out = tmp_path / name
        assert cli_main(["sample", "--model", str(tiny_flux_dir), "--prompts", str(prompts), "--seeds", "3",
                         "--out", str(out), "--steps", "2", "--resolution", "32", "--json", *extra]) == 0
        manifest = json.loads((out / "grid.json").read_text())
        assert manifest["settings"]["guidance_scale"] == {"own": 3.5, "told": 7.5}[name]
        assert "guidance_scale=" + str(manifest["settings"]["guidance_scale"]) in (out / "grid.html").read_text()
        cells[name] = np.asarray(Image.open(out / manifest["images"][0][0]).convert("RGB"))
    capsys.readouterr()
    pipe = diffusers.FluxPipeline.from_pretrained(str(tiny_flux_dir), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    direct = pipe(prompt="a red circle", num_inference_steps=2, height=32, width=32,
                  generator=torch.Generator().manual_seed(3), **pipeline_call_kwargs(pipe)).images[0]
    assert np.array_equal(cells["own"], np.asarray(direct))
    assert not np.array_equal(cells["own"], cells["told"])

    # FLUX.1-schnell has no guidance embedding (guidance_embeds false) and FluxPipeline feeds it no scale: the grid
    # said it sampled at 3.5. It says none, and a scale given is refused before any cell, as one that does nothing.
    schnell = tiny_schnell_dir
    out = tmp_path / "schnell-grid"
    assert cli_main(["sample", "--model", str(schnell), "--prompts", str(prompts), "--seeds", "3", "--out", str(out),
                     "--steps", "1", "--resolution", "32", "--json"]) == 0
    assert json.loads((out / "grid.json").read_text())["settings"]["guidance_scale"] is None
    assert "guidance_scale=none" in (out / "grid.html").read_text()
    capsys.readouterr()
    assert cli_main(["sample", "--model", str(schnell), "--prompts", str(prompts), "--seeds", "3", "--out",
                     str(tmp_path / "refused"), "--guidance", "7.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "guidance scale 7.5: base model" in err and "no guidance embedding" in err, err
    assert not (tmp_path / "refused" / "grid.json").exists()


def test_bad_scheduler_and_missing_model_are_one_clear_error(tiny_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="DDIMScheduler"):
        render_grid([tiny_model_dir], PROMPTS, SEEDS, out_dir=tmp_path, scheduler="NoSuchScheduler")
    with pytest.raises(ConfigError, match="does not exist"):
        render_grid([tmp_path / "nope"], PROMPTS, SEEDS, out_dir=tmp_path)
    # A registered model's URI, as `register` prints it, was "models:/rf/1 does not exist": the fix is named.
    for uri in ("models:/rf-sd/1", "models:/rf-sd@champion"):
        with pytest.raises(ConfigError, match=rf"^{uri} is an MLflow model URI, .*`mlflow artifacts download -u {uri} "
                                              r"-d DIR`.* pass the folder under DIR/artifacts/ that holds "
                                              r"model_index.json$"):
            render_grid([tiny_model_dir, uri], PROMPTS, SEEDS, out_dir=tmp_path)
    assert not (tmp_path / "grid.json").exists()


def test_a_scheduler_the_flux_pipeline_cannot_drive_is_one_line_before_any_cell(tiny_flux_dir, tmp_path):
    """FlowMatchHeunDiscreteScheduler takes no sigmas, which FluxPipeline gives every call: diffusers' ValueError."""
    with pytest.raises(ConfigError, match=r"^sampling.scheduler: FlowMatchHeunDiscreteScheduler cannot sample Flux.1"):
        render_grid([tiny_flux_dir], PROMPTS, SEEDS, out_dir=tmp_path, scheduler="FlowMatchHeunDiscreteScheduler")
    assert not (tmp_path / "grid.json").exists()


def test_a_flux_kohya_lora_with_adapters_diffusers_drops_is_refused_and_one_of_the_blocks_taken(tmp_path):
    """diffusers' kohya Flux converter names img_in, txt_in, the embedders and the final layer without the
    `transformer.` prefix, and load_lora_weights leaves them unapplied: such a column drew the model without them."""
    import torch
    from safetensors.torch import save_file

    from rangefinder.sampling import resolve_column

    def kohya(path, modules):
        save_file({f"lora_unet_{m}.{part}": torch.zeros(4, 4) for m in modules
                   for part in ("lora_down.weight", "lora_up.weight")}, str(path),
                  {"modelspec.architecture": "flux-1-dev/lora"})
        return path

    blocks = kohya(tmp_path / "blocks.safetensors", ["double_blocks_0_img_attn_qkv", "single_blocks_0_linear1"])
    assert resolve_column(blocks).kind == "lora"
    outside = kohya(tmp_path / "outside.safetensors", ["double_blocks_0_img_attn_qkv", "img_in", "final_layer_linear"])
    with pytest.raises(ConfigError, match=r"is a Flux LoRA in kohya's names with adapters outside the blocks "
                                          r"\(lora_unet_final_layer_linear, lora_unet_img_in\), which diffusers' "
                                          r"Flux loader .* drops: .* pass the pytorch_lora_weights.safetensors"):
        resolve_column(outside)


def test_columns_are_recognised_by_their_contents(tmp_path):
    """Each output the methods write resolves to the loader that can read it (by its keys, not its name)."""
    import torch
    from safetensors.torch import save_file

    from rangefinder.sampling import resolve_column

    def st(name, keys):
        path = tmp_path / name
        save_file({k: torch.zeros(2, 2) for k in keys}, str(path))
        return path

    assert resolve_column(st("a.safetensors", ["model.diffusion_model.out.2.weight"])).kind == "single_file"
    assert resolve_column(st("b.safetensors", ["lora_unet_x.lora_down.weight"])).kind == "lora"
    ti = resolve_column(st("c.safetensors", ["<tok>"]))
    assert (ti.kind, ti.token) == ("textual_inversion", "<tok>")
    assert resolve_column(st("d.safetensors", ["emb_params"])).kind == "textual_inversion"
    # A1111's .pt embedding: its vectors under string_to_param, its trigger word under name.
    torch.save({"string_to_token": {"*": 265}, "string_to_param": {"*": torch.zeros(1, 4)}, "name": "shape-tok",
                "step": 10}, str(tmp_path / "e.pt"))
    pt = resolve_column(tmp_path / "e.pt")
    assert (pt.kind, pt.token) == ("textual_inversion", "shape-tok")
    ckpt = tmp_path / "checkpoint-000002"
    ckpt.mkdir()
    save_file({"unet.w": torch.zeros(1)}, str(ckpt / "weights.safetensors"))
    (ckpt / "state.json").write_text("{}")
    assert resolve_column(ckpt / "weights.safetensors").kind == "engine_checkpoint"
    with pytest.raises(ConfigError, match="not a checkpoint"):
        resolve_column(st("e.safetensors", ["foo", "bar"]))
    with pytest.raises(ConfigError, match="no model_index.json"):
        empty = tmp_path / "empty"
        empty.mkdir()
        resolve_column(empty)


def test_read_prompts_drops_a_byte_order_mark(tmp_path):
    # Notepad writes UTF-8 with a byte-order mark; it is not part of the first prompt.
    (tmp_path / "p.txt").write_bytes("a red circle\r\n# a comment\r\nun cercle bleu é\r\n".encode("utf-8-sig"))
    assert read_prompts(tmp_path / "p.txt") == ["a red circle", "un cercle bleu é"]


def _sample_with_a_sigint_inside_its_first_weight_read(argv: list[str]) -> None:
    """In the child: `rangefinder sample`, given a real SIGINT inside safetensors' read of the first weight it loads
    (tests/training/test_caching.py)."""
    from tests.training.test_caching import sigint_inside_the_next_cache_read

    sigint_inside_the_next_cache_read()
    raise SystemExit(cli_main(argv))


def test_ctrl_c_while_sample_loads_a_model_says_interrupted_not_damaged(tiny_model_dir, tmp_path):
    """A Ctrl-C that lands inside the load of a column's weights: torch turns it into a ValueError, diffusers into
    "Unable to load weights from checkpoint file", and `sample` exited 2 saying the model "is damaged, or a
    checkpoint of another model". It is a Ctrl-C: exit 130 and the "interrupted" line."""
    from tests.training.test_resume import ForkedChild

    args = ["sample", "--model", str(tiny_model_dir), "--out", str(tmp_path / "grid"), "--steps", "1", "--seeds", "0"]
    child = ForkedChild(tmp_path / "child", tmp_path / "child.out", tmp_path / "child.err",
                        target=_sample_with_a_sigint_inside_its_first_weight_read, args=(args,))
    _, err = child.communicate(timeout=300)
    assert child.returncode == 130 and "Traceback" not in err and "damaged" not in err, err[-3000:]
    assert "rangefinder sample: interrupted" in err.splitlines()[-1], err[-3000:]
    assert not (tmp_path / "grid" / "grid.json").exists()


# A prompt, a column label and a negative prompt as someone hostile would write them: closing the attribute they are
# quoted in, opening an element of their own.
HOSTILE = ["<script>alert(1)</script> a red circle", "a square\" onerror=\"alert(2)", "a' onload='alert(3)"]


def test_the_grid_page_shows_prompts_and_labels_as_text_never_as_markup(tiny_model_dir, tmp_path):
    """The KFP UI and MLflow render grid.html: every prompt, label and setting on it is escaped, in an element or an
    attribute, so no element or event attribute of its own comes from them."""
    from html.parser import HTMLParser

    class Page(HTMLParser):
        def __init__(self) -> None:
            super().__init__()
            self.tags: set[str] = set()
            self.attributes: set[str] = set()
            self.text = ""

        def handle_starttag(self, tag, attrs):
            self.tags.add(tag)
            self.attributes |= {k for k, _ in attrs}
            self.text += " ".join(v or "" for _, v in attrs)

        def handle_data(self, data):
            self.text += data

    out = render_grid([tiny_model_dir], HOSTILE[:2], [0], labels=[HOSTILE[2]], out_dir=tmp_path, steps=1,
                      negative_prompt=HOSTILE[0], device="cpu")
    page = Page()
    page.feed((tmp_path / "grid.html").read_text())
    assert "script" not in page.tags and page.attributes <= {"lang", "charset", "name", "content", "class", "alt",
                                                              "width", "height", "src"}
    assert all(text in page.text for text in HOSTILE) and out["html"] == str(tmp_path / "grid.html")


def test_a_cell_is_what_diffusers_renders_with_the_grid_s_settings(tiny_model_dir, tmp_path):
    """A cell is the base model's pipeline called with every setting the grid was given: the scheduler (not the
    model's own DDPM), the steps, the guidance, the resolution (not the native one), the negative prompt and the
    row's seed, in fp32 on the CPU. Each was read by no test that looked at the pixels."""
    import diffusers
    import torch

    settings = dict(steps=3, guidance_scale=4.0, scheduler="DDIMScheduler", resolution=48,
                    negative_prompt="a green triangle")
    manifest = render_grid([tiny_model_dir], ["a red circle"], [5], out_dir=tmp_path, device="cpu", **settings)
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(str(tiny_model_dir), local_files_only=True,
                                                             safety_checker=None, requires_safety_checker=False)
    pipe.scheduler = diffusers.DDIMScheduler.from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    direct = pipe(["a red circle"], negative_prompt=["a green triangle"], num_inference_steps=3, guidance_scale=4.0,
                  height=48, width=48, generator=[torch.Generator("cpu").manual_seed(5)]).images[0]
    cell = np.asarray(Image.open(manifest["images"][0][0]).convert("RGB"))
    assert cell.shape == (48, 48, 3) and np.array_equal(cell, np.asarray(direct))


def test_a_base_model_of_variant_files_alone_is_sampled_as_its_plain_copy(tiny_model_dir, tmp_path):
    """A base model downloaded with model.variant: fp16 holds its weights as `*.fp16.safetensors` alone, which diffusers
    loads only when told the variant: after the whole fine-tune, sample-images and register-model's pipeline of a
    LoRA refused it ("no file named diffusion_pytorch_model.bin found in directory"), and so did `sample`."""
    import shutil

    fp16 = tmp_path / "fp16-only"
    shutil.copytree(tiny_model_dir, fp16)
    for weights in fp16.glob("*/*.safetensors"):  # the same tensors, under the variant's names
        weights.rename(weights.with_name(weights.name.replace(".safetensors", ".fp16.safetensors")))
    cells = [render_grid([model], ["a red circle"], [5], out_dir=tmp_path / name, steps=1, device="cpu")["images"]
             for name, model in (("variant", fp16), ("plain", tiny_model_dir))]
    assert np.array_equal(*(np.asarray(Image.open(grid[0][0])) for grid in cells))


def test_a_full_fine_tune_s_unet_column_is_told_sdxl_by_its_config(tiny_model_dir, tiny_sdxl_dir, tmp_path):
    """A full fine-tune's checkpoint folder (unet/ alone) of SDXL is an SDXL column: refused on an SD 1.x base
    before anything renders, in the line naming both families."""
    import shutil

    ckpt = tmp_path / "checkpoint"
    (ckpt / "unet").mkdir(parents=True)
    shutil.copy(tiny_sdxl_dir / "unet" / "config.json", ckpt / "unet" / "config.json")
    with pytest.raises(ConfigError, match=r"checkpoint\) is a Stable Diffusion XL model, but the base model "
                                          r".* is Stable Diffusion 1"):
        render_grid([tiny_model_dir, ckpt], PROMPTS, SEEDS, out_dir=tmp_path / "grid", device="cpu")


def test_a_full_fine_tune_s_column_samples_with_its_own_text_encoder(tiny_model_dir, tmp_path):
    """A full fine-tune's checkpoint (unet/ and text_encoder/, the method trained both) is sampled with both: its
    text encoder, not the base model's, encodes the prompts."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    from rangefinder.sampling import load_column_pipeline, resolve_column

    ckpt = tmp_path / "checkpoint"
    UNet2DConditionModel.from_pretrained(str(tiny_model_dir / "unet")).save_pretrained(str(ckpt / "unet"))
    encoder = CLIPTextModel.from_pretrained(str(tiny_model_dir / "text_encoder"))
    with torch.no_grad():
        for p in encoder.parameters():
            p.add_(0.01)
    encoder.save_pretrained(str(ckpt / "text_encoder"))
    column = resolve_column(ckpt)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        pipe = load_column_pipeline(column, tiny_model_dir, device="cpu")
    assert column.kind == "unet" and all(
        torch.equal(a, b) for a, b in zip(pipe.text_encoder.parameters(), encoder.parameters(), strict=True))
    # The base pipeline and the column's UNet are loaded with diffusers' `dtype`: `torch_dtype` printed a
    # FutureWarning on every `sample`.
    assert not [w for w in said if "torch_dtype" in str(w.message)], [str(w.message) for w in said]


def test_an_sdxl_embedding_column_puts_each_encoder_s_vectors_in_that_encoder(tiny_sdxl_dir, tmp_path):
    """An SDXL embedding file (A1111's and ComfyUI's `clip_l` and `clip_g`) loads its CLIP-L vectors into the first
    text encoder and its OpenCLIP-G vectors into the second, under the one placeholder token."""
    import torch
    from safetensors.torch import save_file

    from rangefinder.sampling import load_column_pipeline, resolve_column

    widths = [json.loads((tiny_sdxl_dir / part / "config.json").read_text())["hidden_size"]
              for part in ("text_encoder", "text_encoder_2")]
    generator = torch.Generator().manual_seed(0)
    vectors = {"clip_l": torch.randn(1, widths[0], generator=generator),
               "clip_g": torch.randn(1, widths[1], generator=generator)}
    save_file(vectors, str(tmp_path / "emb.safetensors"), metadata={"rangefinder.placeholder_token": "<shape>"})
    column = resolve_column(tmp_path / "emb.safetensors")
    pipe = load_column_pipeline(column, tiny_sdxl_dir, device="cpu")
    for encoder, tokenizer, key in ((pipe.text_encoder, pipe.tokenizer, "clip_l"),
                                    (pipe.text_encoder_2, pipe.tokenizer_2, "clip_g")):
        row = encoder.get_input_embeddings().weight[tokenizer.convert_tokens_to_ids("<shape>")]
        assert torch.equal(row, vectors[key][0]), key


def test_model_variant_is_the_base_model_sampled_where_the_folder_holds_plain_weights_too(tiny_model_dir, tmp_path):
    """model.variant: fp16 on a folder holding `*.fp16.safetensors` beside the plain weights (a hub snapshot with
    both, a folder saved with both): training loads the variant, and the grid (sample-images, the delivered model's
    samples) and register-model's pipeline loaded the plain weights, which diffusers takes unless told the variant.
    Here the variant's weights differ from the plain ones: the grid draws the variant's."""
    import shutil

    from safetensors.torch import load_file, save_file

    both, variant_alone = tmp_path / "both", tmp_path / "variant-alone"
    shutil.copytree(tiny_model_dir, both)
    for weights in both.glob("*/*.safetensors"):
        tensors = {k: v.half() for k, v in load_file(str(weights)).items()}
        if weights.parent.name == "unet":
            tensors["conv_out.weight"] = -tensors["conv_out.weight"]  # the variant is other weights than the plain
        save_file(tensors, str(weights.with_name(weights.name.replace(".safetensors", ".fp16.safetensors"))))
    shutil.copytree(both, variant_alone, ignore=lambda _, names: [n for n in names if n.endswith(".safetensors")
                                                                   and ".fp16." not in n])

    def cell(model: Path, name: str, **kw) -> np.ndarray:
        grid = render_grid([model], ["a red circle"], [5], out_dir=tmp_path / name, steps=1, device="cpu", **kw)
        return np.asarray(Image.open(grid["images"][0][0]))

    asked = cell(both, "asked", variant="fp16")
    assert np.array_equal(asked, cell(variant_alone, "alone"))
    assert not np.array_equal(asked, cell(both, "plain"))


def test_a_flux_full_fine_tune_s_transformer_file_is_a_column_drawn_as_its_folder(tiny_flux_dir, tiny_sd3_dir,
                                                                                 tmp_path):
    """`full`'s model.safetensors on Flux is the transformer alone in Black Forest Labs' layout: `sample` called the
    run's own file "not a checkpoint ... rangefinder knows", and on an SD3 base said no more. On its base model it
    draws what its folder draws (the VAE and encoders the base model's); on another family's, the family line."""
    from rangefinder.formats.flux_layout import export_flux_transformer

    weights = export_flux_transformer(tiny_flux_dir, tmp_path / "flux.safetensors", {})
    grid = render_grid([tiny_flux_dir, weights], ["a red circle"], [3], out_dir=tmp_path / "grid", steps=2,
                       resolution=32, device="cpu")
    assert [c["kind"] for c in grid["columns"]] == ["pipeline", "single_file"]
    assert np.array_equal(*(np.asarray(Image.open(cell)) for cell in grid["images"][0]))
    with pytest.raises(ConfigError, match=r"column flux \(.*\) is a Flux.1 model, but the base model .* is Stable "
                                          r"Diffusion 3/3.5"):
        render_grid([tiny_sd3_dir, weights], ["a red circle"], [3], out_dir=tmp_path / "sd3", device="cpu")


def test_a_lora_run_s_folder_of_another_family_is_refused_as_its_file_is(tiny_sd3_dir, tiny_flux_dir, tmp_path):
    """A LoRA run's final/ (its pytorch_lora_weights.safetensors) of SD3 on a Flux base was drawn, the two families
    sharing diffusers' attention names; its file alone was refused."""
    from tests.conftest import delivered_files

    final = delivered_files(tiny_sd3_dir, "lora", tmp_path / "run" / "final")
    for column in (final, final / "pytorch_lora_weights.safetensors"):
        with pytest.raises(ConfigError, match=r"is a Stable Diffusion 3/3.5 LoRA, but the base model .* is Flux.1: "):
            render_grid([tiny_flux_dir, column], ["a red circle"], [3], out_dir=tmp_path / "grid", device="cpu")
    assert not (tmp_path / "grid").exists()


@pytest.mark.parametrize("family_dir,guidance,refused", [
    ("tiny_flux_dir", None, "a Flux model draws without one"),
    ("tiny_model_dir", 1.0, "the guidance scale is 1, and classifier-free guidance, which a negative prompt steers, "
                            "runs only above 1"),
])
def test_a_negative_prompt_the_pipeline_would_draw_without_is_refused(family_dir, guidance, refused, request,
                                                                      tmp_path, capsys):
    """`sample --negative-prompt` on Flux (FluxPipeline reads one only with true_cfg_scale) or at guidance 1 drew
    every cell exactly as without it; the registered model already refused both."""
    model = request.getfixturevalue(family_dir)
    (tmp_path / "p.txt").write_text("a red circle\\n")
    args = ["sample", "--model", str(model), "--prompts", str(tmp_path / "p.txt"), "--seeds", "1", "--out",
            str(tmp_path / "grid"), "--steps", "1", "--resolution", "32", "--negative-prompt", "blurry"]
    assert cli_main(args + (["--guidance", str(guidance)] if guidance is not None else [])) != 0
    err = capsys.readouterr().err
    assert f"--negative-prompt: {refused}" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "grid" / "grid.json").exists()


def test_a_grid_that_fails_part_way_leaves_the_earlier_grid_in_its_folder_whole(base_twice_grid, tiny_model_dir,
                                                                                 tmp_path):
    """`sample` into the --out of an earlier grid, stopped after its first column (here a damaged second column; a
    Ctrl-C or a full disk alike): the folder holds the earlier grid as it was, not its grid.png beside new cells. A
    folder holding anything but a grid is refused before any cell, since the new grid takes its place whole."""
    import shutil

    out = Path(shutil.copytree(Path(base_twice_grid["manifest"]).parent, tmp_path / "grid"))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    for part in tiny_model_dir.iterdir():
        (damaged / part.name).symlink_to(part)
    (damaged / "unet").unlink()
    (damaged / "unet").mkdir()
    for part in (tiny_model_dir / "unet").iterdir():  # its weights cut short, as a copy interrupted leaves them
        if part.suffix == ".safetensors":
            with part.open("rb") as whole:
                (damaged / "unet" / part.name).write_bytes(whole.read(1000))
        else:
            (damaged / "unet" / part.name).symlink_to(part)
    with pytest.raises(ConfigError, match="column damaged .* cannot be loaded"):
        render_grid([tiny_model_dir, damaged], PROMPTS[:1], SEEDS[:1], out_dir=out, steps=1, device="cpu")
    assert {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["damaged", "grid"]  # no temporary folder left beside it

    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"run holds notes.txt, which is no part of a sample grid"):
        render_grid([tiny_model_dir], PROMPTS[:1], SEEDS[:1], out_dir=tmp_path / "run", steps=1, device="cpu")
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["notes.txt"]


def test_a_grid_s_folder_is_never_the_working_folder_and_a_link_to_it_stays_a_link(tmp_path, monkeypatch):
    """A grid replaces its folder whole: an empty working folder given as `--out .` was moved from under the shell,
    and a link given as --out became a folder of its own, on the link's disk, the link's target left unused."""
    from rangefinder.sampling import grid_folder

    monkeypatch.chdir(tmp_path)
    for given in (".", str(tmp_path), str(tmp_path.parent)):
        with pytest.raises(ConfigError, match="working folder"):
            grid_folder(given)
    target = tmp_path / "disk" / "grids"
    target.mkdir(parents=True)
    (tmp_path / "link").symlink_to(target)
    assert grid_folder(tmp_path / "link") == target.resolve()
    assert grid_folder("samples") == (tmp_path / "samples").resolve()
