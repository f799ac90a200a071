"""The evaluation grid: fixed prompts and seeds, one column per model, so that only the weights differ along a row.

A column is a base model or anything the training methods write (see `resolve_column`): a diffusers folder, a
single-file checkpoint, a LoRA (diffusers or kohya file) or a textual-inversion embedding, the last two applied on
top of the base model. Each cell draws its initial latents from a CPU `torch.Generator` seeded with the row's seed,
so a cell is the same on any device order and identical weights give identical cells.

Outputs under `out_dir`: `grid.png` (labelled rows and columns), the single images under `images/`, `grid.html`
(images embedded as base64, since the KFP UI shows no plain image files) and `grid.json` (the manifest, written
last: its presence means the grid is complete; it names the grid's files relative to its own folder).
"""

from __future__ import annotations

import base64
import html
import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from rangefinder.config import FAMILY_NAMES
from rangefinder.errors import ConfigError, RangefinderError
from rangefinder.formats import checkpoints
from rangefinder.formats.atomic import TEMPORARY, atomic_dir, atomic_path, usable_folder, write_text
from rangefinder.formats.diffusers_folder import save_pipeline_folder
from rangefinder.formats.embeddings import TI_WEIGHTS_NAME
from rangefinder.formats.flux_layout import FLUX_DOUBLE_BLOCK_KEY, FLUX_SINGLE_BLOCK_KEY
from rangefinder.formats.grid import compose_grid
from rangefinder.formats.lora import LORA_WEIGHTS_NAME
from rangefinder.formats.model_spec import architecture_family
from rangefinder.formats.text import NotUtf8, decode_utf8
from rangefinder.formats.weights_file import pickle_format
from rangefinder.models.loading import (
    check_scheduler_name,
    check_scheduler_takes,
    flux_transformer_from_file,
    folder_variant,
    parts_not_in_single_file,
    pipeline_call_kwargs,
    predict_as_the_file_says,
    refuse_shipped_code,
)
from rangefinder.training.family_detection import detect_family, guidance_scale_in, sampling_dtype

ColumnKind = str  # "pipeline" | "single_file" | "unet" | "lora" | "textual_inversion" | "engine_checkpoint"


@dataclass(frozen=True)
class GridColumn:
    """One column of the grid: what to load, and how to label it."""

    label: str
    path: Path
    kind: ColumnKind
    token: Optional[str] = None  # textual inversion: the placeholder token its prompts use


def _safetensors_info(path: Path) -> tuple[list[str], dict[str, str]]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys()), dict(f.metadata() or {})
    except (SafetensorError, OSError) as e:
        pickled = pickle_format(path)
        if pickled is not None:
            raise ConfigError(f"{path} is {pickled}, not safetensors (a pickle checkpoint such as a .ckpt, renamed), "
                              "which can run code when loaded, so it is refused unread; pass a .safetensors file") \
                from None
        raise ConfigError(f"{path} is not a readable .safetensors file ({str(e).splitlines()[0]}): it is damaged, "
                          "cut short or not a weights file; pass a whole checkpoint") from None


# kohya's Flux LoRA modules outside the double and single blocks (BFL's img_in, txt_in, time_in, vector_in,
# guidance_in, final_layer): diffusers 0.42's `_convert_kohya_flux_lora_to_diffusers` converts them to names without
# the `transformer.` prefix, which load_lora_weights then leaves unapplied, without an error.
FLUX_KOHYA_OUTSIDE_BLOCKS = tuple(f"lora_unet_{m}" for m in ("img_in", "txt_in", "time_in", "vector_in",
                                                                "guidance_in", "final_layer"))


def _classify_file(path: Path) -> tuple[ColumnKind, Optional[str]]:
    """The kind of a weights file, from its keys (the file name is not trusted)."""
    if path.suffix == ".safetensors":
        keys, meta = _safetensors_info(path)
    elif path.suffix in (".pt", ".bin", ".ckpt"):
        import torch

        try:
            sd = torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises RuntimeError, UnpicklingError, EOFError, ... for a bad file
            # Only the exception's name: torch's own message for a pickle suggests turning weights_only off, never wise.
            raise ConfigError(f"{path} cannot be read as a PyTorch weights file ({type(e).__name__}); it is "
                              "damaged, cut short or holds more than tensors; pass a whole checkpoint") from None
        if isinstance(sd, dict) and "state_dict" in sd:
            sd = sd["state_dict"]
        keys, meta = (list(sd) if isinstance(sd, dict) else []), {}
        if "string_to_param" in keys:
            return "textual_inversion", sd.get("name")
    else:
        raise ConfigError(f"{path}: unknown weights file type; pass a .safetensors, .pt or .ckpt file or a folder")
    if any(k.startswith("model.diffusion_model.") for k in keys):
        return "single_file", None
    if FLUX_DOUBLE_BLOCK_KEY in keys and FLUX_SINGLE_BLOCK_KEY in keys:
        return "single_file", None  # Flux's transformer alone, in BFL's layout: `full`'s model.safetensors
    kohya = any(k.startswith(("lora_unet_", "lora_te")) for k in keys)
    if kohya and (architecture_family(meta) == "sd3" or any(k.startswith("lora_unet_joint_blocks_") for k in keys)):
        raise ConfigError(
            f"{path} is a LoRA in kohya's SD3 names, which diffusers' SD3 loader (what samples and the registered "
            f"model are drawn with) does not read: it would draw the base model unchanged; pass the "
            f"{LORA_WEIGHTS_NAME} written beside it (the kohya file is for ComfyUI and sd-scripts)"
        )
    outside = sorted({k.split(".")[0] for k in keys if k.startswith(FLUX_KOHYA_OUTSIDE_BLOCKS)}) if kohya else []
    if outside:
        raise ConfigError(
            f"{path} is a Flux LoRA in kohya's names with adapters outside the blocks ({', '.join(outside[:3])}), "
            f"which diffusers' Flux loader (what samples and the registered model are drawn with) drops: it would "
            f"draw the model without them; pass the {LORA_WEIGHTS_NAME} written beside it (the kohya file is for "
            "ComfyUI and sd-scripts)"
        )
    if any("lora" in k for k in keys):
        return "lora", None
    if sorted(keys) == ["clip_g", "clip_l"]:  # an SDXL embedding (A1111's and ComfyUI's format)
        return "textual_inversion", meta.get("rangefinder.placeholder_token") or meta.get("name") or path.stem
    if keys == ["emb_params"]:
        return "textual_inversion", meta.get("rangefinder.placeholder_token") or meta.get("name") or path.stem
    if len(keys) == 1:  # diffusers' learned_embeds: {token: (num_vectors, dim)}
        return "textual_inversion", keys[0]
    raise ConfigError(
        f"{path}: not a checkpoint, LoRA or embedding file rangefinder knows (keys {keys[:3]}...); "
        "pass a diffusers folder or a file written by `rangefinder train`"
    )


def _column_family(column: GridColumn) -> Optional[str]:
    """The family (config.FAMILY_NAMES) of a column whose files tell it without loading weights (a diffusers folder,
    a full fine-tune's unet/, a .safetensors file, or a LoRA folder's, whose model spec names its architecture, as
    rangefinder's and kohya's exports do, a training checkpoint, whose state records its run's); None for the others
    (files that say nothing are checked when loaded). diffusers loaded a Flux LoRA on SD3 in part, and an SD 1.x
    embedding on SDXL, without a word."""
    from rangefinder.models.loading import detect_family

    if column.kind == "pipeline":
        return detect_family(column.path)
    if column.path.is_file() and column.path.suffix == ".safetensors":
        return architecture_family(_safetensors_info(column.path)[1])
    if column.kind == "lora" and (column.path / LORA_WEIGHTS_NAME).is_file():  # a LoRA run's final/: its file's
        return architecture_family(_safetensors_info(column.path / LORA_WEIGHTS_NAME)[1])
    if column.kind == "engine_checkpoint":  # the family its run trained (checked intact before this is read)
        family = checkpoints.read_state(column.path).get("family")
        return family if family in FAMILY_NAMES else None
    if column.kind == "unet":
        try:
            unet = json.loads((column.path / "unet" / "config.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{column.path / 'unet' / 'config.json'} cannot be read ({e}); the checkpoint is "
                              "damaged: pass a whole one") from None
        # SDXL's UNet takes the pooled text and image sizes as "text_time" added conditioning; SD 1.x/2.x's none.
        return "sdxl" if unet.get("addition_embed_type") == "text_time" else "sd1"
    return None


def undelivered(path: Path) -> Optional[str]:
    """Why a run's `final/` or `chosen/` that does not exist is not there, when its run folder says: the run stopped
    (killed, or still training) before it delivered them; the line names its newest whole checkpoint, which samples
    and registers as a model does. None where the path is no such folder."""
    run = path.parent
    # A run that wrote final/ ended (`train` writes no chosen/).
    if path.name not in ("final", "chosen") or (run / "final").is_dir() or not (run / checkpoints.RUN_DIR).is_dir():
        return None
    newest = checkpoints.latest_checkpoint(run / checkpoints.RUN_DIR)
    instead = (f"pass its newest checkpoint, {newest}, or resume the run (`rangefinder train --resume` with --out "
               f"{run})") if newest is not None else "it left no whole checkpoint: train it again"
    return (f"{path} does not exist: the run in {run} stopped before it wrote {path.name}/ (killed, or still "
            f"training); {instead}")


def resolve_column(path: Union[str, Path], label: Optional[str] = None) -> GridColumn:
    """What a path holds, for the grid: a diffusers pipeline folder, a training checkpoint or an adapter."""
    p = Path(path)
    if not p.exists() and re.match(r"(models|runs):/", str(path)):
        # A registered model's URI, as `register` prints it: it was "models:/NAME/1 does not exist".
        raise ConfigError(f"{path} is an MLflow model URI, and only folders and files are sampled here; download it "
                          f"(`mlflow artifacts download -u {path} -d DIR`, with MLFLOW_TRACKING_URI set) and pass the "
                          "folder under DIR/artifacts/ that holds model_index.json")
    if not p.exists():
        raise ConfigError(undelivered(p) or f"{p} does not exist; pass a model folder, a checkpoint folder or a "
                          "weights file")
    if p.is_file() and p.name == checkpoints.WEIGHTS_NAME and (p.parent / checkpoints.STATE_NAME).is_file():
        p = p.parent
    label = label or (p.parent.name if p.name == "final" else p.stem if p.is_file() else p.name)
    if p.is_dir() and (p / checkpoints.WEIGHTS_NAME).is_file() and (p / checkpoints.STATE_NAME).is_file():
        return GridColumn(label, p, "engine_checkpoint")
    if p.is_file():
        kind, token = _classify_file(p)
        return GridColumn(label, p, kind, token)
    if (p / "model_index.json").is_file():
        return GridColumn(label, p, "pipeline")
    if (p / LORA_WEIGHTS_NAME).is_file():
        return GridColumn(label, p, "lora")
    if (p / TI_WEIGHTS_NAME).is_file():
        _, token = _classify_file(p / TI_WEIGHTS_NAME)
        return GridColumn(label, p / TI_WEIGHTS_NAME, "textual_inversion", token)
    if (p / "unet" / "config.json").is_file():
        return GridColumn(label, p, "unet")  # a full fine-tune checkpoint: unet/ (and text_encoder/) only
    # A run's own folder (`train --out`, the fine-tune step's), given for the model in it: named as what it holds.
    inside = [str(p / name) for name in ("chosen", "final") if (p / name).is_dir()]
    inside += [f"a checkpoint under {p / 'checkpoints'}"] if (p / "checkpoints").is_dir() else []
    if inside:
        raise ConfigError(f"{p} is a training run's folder, not a model; pass {' or '.join(inside)}")
    raise ConfigError(
        f"{p}: no model_index.json, unet/, {LORA_WEIGHTS_NAME} or {TI_WEIGHTS_NAME} inside; "
        "pass a diffusers model folder or a checkpoint folder written by `rangefinder train`"
    )


# ---------------------------------------------------------------------------------------------------------------
# Loading one column


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def pipeline_class(base_model: Path) -> tuple[Any, dict[str, Any]]:
    """The diffusers pipeline class of the base model's family, and the keyword arguments its loaders take."""
    import diffusers

    from rangefinder.training.family_detection import FAMILY_LAYOUTS, detect_family

    layout = FAMILY_LAYOUTS[detect_family(Path(base_model))]
    return getattr(diffusers, layout.pipeline), dict(layout.pipeline_kwargs)


def load_column_pipeline(column: GridColumn, base_model: Path, *, device: str, dtype=None, scheduler=None,
                         variant: Optional[str] = None):
    """A pipeline of the base model's family (StableDiffusionPipeline or StableDiffusionXLPipeline) with the
    column's weights; adapters go on top of `base_model`, loaded in its weights' `variant` (model.variant). `dtype`
    None: the family's on `device` (family_detection.sampling_dtype: bf16 for SD3 and Flux on a GPU)."""
    from diffusers import UNet2DConditionModel

    dtype = dtype or sampling_dtype(detect_family(Path(base_model)), device)
    cls, family_kwargs = pipeline_class(base_model)
    common = dict(dtype=dtype, **family_kwargs)  # `torch_dtype` is deprecated since diffusers 0.40
    if column.kind == "pipeline":
        # The base model's own column is the base model: in the variant it is trained in.
        asked = variant if Path(column.path) == Path(base_model) else None
        pipe = cls.from_pretrained(str(column.path), local_files_only=True, **_variant_of(column.path, asked),
                                   **common)
    elif column.kind == "single_file" and FLUX_DOUBLE_BLOCK_KEY in _safetensors_info(column.path)[0]:
        # A Flux transformer file holds nothing else: the base model's VAE and text encoders go with it.
        pipe = cls.from_pretrained(str(base_model), local_files_only=True, **_variant_of(base_model, variant),
                                   **common)
        pipe.transformer = flux_transformer_from_file(column.path, pipe.transformer.config, base_model,
                                                      f"column {column.label}").to(dtype)
    elif column.kind == "single_file":
        pipe = cls.from_single_file(str(column.path), config=str(base_model), local_files_only=True, **common,
                                    **parts_not_in_single_file(column.path, base_model, detect_family(base_model),
                                                               dtype))
        predict_as_the_file_says(pipe, column.path)  # not the base model's: the file may predict otherwise
    elif column.kind == "engine_checkpoint":
        pipe = _engine_checkpoint_pipeline(column.path, base_model, common, variant)
    else:
        pipe = cls.from_pretrained(str(base_model), local_files_only=True, **_variant_of(base_model, variant),
                                   **common)
        if column.kind == "unet":
            pipe.unet = UNet2DConditionModel.from_pretrained(str(column.path / "unet"), dtype=dtype)
            if (column.path / "text_encoder" / "config.json").is_file():
                from transformers import CLIPTextModel

                pipe.text_encoder = CLIPTextModel.from_pretrained(str(column.path / "text_encoder"), dtype=dtype)
            if (column.path / "text_encoder_2" / "config.json").is_file():
                from transformers import CLIPTextModelWithProjection

                pipe.text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(
                    str(column.path / "text_encoder_2"), dtype=dtype)
        elif column.kind == "lora":
            if column.path.is_dir():
                pipe.load_lora_weights(str(column.path), weight_name=LORA_WEIGHTS_NAME)
            else:
                pipe.load_lora_weights(str(column.path.parent), weight_name=column.path.name)
        elif column.kind == "textual_inversion":
            load_embedding(pipe, column.path, column.token)
    if scheduler is not None:
        import diffusers

        from rangefinder.training.family_rules import check_flow_scheduler

        check_flow_scheduler(type(pipe.scheduler).__name__, scheduler)
        pipe.scheduler = getattr(diffusers, scheduler).from_config(pipe.scheduler.config)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _variant_of(folder: Path, asked: Optional[str] = None) -> dict[str, str]:
    """diffusers' `variant` for a base model's folder: `asked` (model.variant, which training loaded: a folder may
    hold it beside the plain weights, which diffusers loads unless told), else the one its parts hold their weights
    in alone (a base model downloaded with model.variant: fp16), which it loads only when told; none for plain
    weights."""
    variant = asked or folder_variant(Path(folder))
    return {"variant": variant} if variant else {}


def export_pipeline(weights: Path, base_model: Path, out_dir: Path, variant: Optional[str] = None) -> Path:
    """A whole diffusers pipeline folder for any trained output: a full fine-tune's folder as it is; LoRA adapters
    fused into the base model's weights; a textual-inversion embedding added to the base tokenizer and text encoder.

    What a registry or a plain `from_pretrained` user needs when the method only trained a small part. Written to a
    temporary name and renamed, so a half-written folder never looks finished.
    """
    weights, out_dir = Path(weights), Path(out_dir)
    column = resolve_column(weights)
    if column.kind == "pipeline":
        refuse_shipped_code(weights, f"model {weights}")  # registered as it is: loaded wherever it is served
        return weights
    refuse_shipped_code(Path(base_model), f"base model {base_model}")
    pipe = load_column_pipeline(column, Path(base_model), device="cpu", variant=variant)
    if column.kind == "lora":
        # Bake the adapters into the base weights, then drop the adapter layers: a plain pipeline remains.
        pipe.fuse_lora()
        pipe.unload_lora_weights()
    with atomic_dir(out_dir) as tmp:
        save_pipeline_folder(pipe, tmp)  # loadable under transformers 4.x too (text_model. names, vocab.json)
    return out_dir


def load_embedding(pipe: Any, path: Path, token: Optional[str]) -> None:
    """A textual-inversion file into the pipeline: SDXL's `clip_l`/`clip_g` file into both encoders, any other
    through diffusers' own loader."""
    if path.suffix == ".safetensors" and sorted(_safetensors_info(path)[0]) == ["clip_g", "clip_l"]:
        from safetensors.torch import load_file

        state = load_file(str(path))
        pipe.load_textual_inversion(state["clip_l"], token=token, text_encoder=pipe.text_encoder,
                                    tokenizer=pipe.tokenizer)
        pipe.load_textual_inversion(state["clip_g"], token=token, text_encoder=pipe.text_encoder_2,
                                    tokenizer=pipe.tokenizer_2)
        return
    pipe.load_textual_inversion(str(path), token=token)


def _engine_checkpoint_pipeline(ckpt_dir: Path, base_model: Path, common: dict, variant: Optional[str] = None):
    """A pipeline with a training checkpoint's weights (rangefinder.training.restore: the run's method rebuilt on the
    base model, the checkpoint's tensors, or their EMA average, put back), sampling with the base model's own
    scheduler predicting what the run trained, as the run's own samples do."""
    from rangefinder.training.restore import method_from_checkpoint
    from rangefinder.training.samples import sampling_scheduler

    _, sd = method_from_checkpoint(ckpt_dir, base_model, variant)
    cls, _ = pipeline_class(base_model)
    from rangefinder.training.family_detection import FAMILY_LAYOUTS

    layout = FAMILY_LAYOUTS[sd.family]  # the denoiser is the pipeline's unet or transformer
    parts = {layout.denoiser: sd.unet, "text_encoder": sd.text_encoder, "tokenizer": sd.tokenizer,
             "scheduler": sampling_scheduler(sd), **{name: getattr(sd, name) for name in layout.parts}}
    pipe = cls.from_pretrained(str(base_model), local_files_only=True, **parts, **_variant_of(base_model, variant),
                               **common)
    return pipe.to(common["dtype"])


# ---------------------------------------------------------------------------------------------------------------
# The grid


def _slug(text: str, limit: int = 40) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-")[:limit] or "x"


def _save_png(img, path: Path) -> None:
    with atomic_path(path) as tmp:
        img.save(tmp, format="PNG")


def _png_b64(img) -> str:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return base64.b64encode(buf.getvalue()).decode("ascii")


_GRID_CSS = (
    "body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:24px auto;padding:0 16px;"
    "max-width:1200px;color:#1d2733;line-height:1.45}h1{font-size:1.4em}p{overflow-wrap:anywhere}"
    ".scroll{overflow-x:auto}table{border-collapse:collapse}td,th{padding:2px 4px;vertical-align:top}"
    "th{font-weight:600;font-size:.9em;max-width:12em}th.row{text-align:left;max-width:16em;font-weight:normal}"
    "img{image-rendering:pixelated;display:block}.muted{color:#6b7785;font-size:.9em}h2{font-size:1.1em}"
    ".scores td{font-family:ui-monospace,Menlo,Consolas,monospace;padding:2px 12px;border-bottom:1px solid #e3e7ec}"
)


def _grid_html(images, row_labels, col_labels, cell: int, settings: dict, extra_html: str = "") -> str:
    """The grid as one self-contained page. A grid wider than the screen scrolls inside its box, not the page."""
    head = "".join(f"<th>{html.escape(c)}</th>" for c in col_labels)
    body = []
    for r, row in enumerate(images):
        cells = "".join(
            f'<td><img alt="{html.escape(row_labels[r])} | {html.escape(col_labels[c])}" width="{cell}" '
            f'height="{cell}" src="data:image/png;base64,{_png_b64(img)}"></td>'
            for c, img in enumerate(row)
        )
        body.append(f"<tr><th class=row>{html.escape(row_labels[r])}</th>{cells}</tr>")
    settings_txt = html.escape(", ".join(f"{k}={'none' if v is None else v}" for k, v in settings.items()))
    return (
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>rangefinder samples</title><style>{_GRID_CSS}</style></head><body><h1>Samples</h1>"
        "<p>Every row uses one prompt and one seed; columns differ only in their weights.</p>"
        f"<p class=muted>{settings_txt}</p>"
        f"<div class=scroll><table><tr><th></th>{head}</tr>{''.join(body)}</table></div>{extra_html}</body></html>"
    )


def prompt_scores(images: list[list[Any]], prompts: list[str], labels: list[str]) -> list[dict[str, Any]]:
    """Per column, how well its images follow the shapes prompts (data.prompt_score): [{"column", "colour",
    "shape", "images"}]; empty when no prompt names a colour and shape of the synthetic dataset."""
    from rangefinder.data.prompt_score import score_image

    out: list[dict[str, Any]] = []
    for c, label in enumerate(labels):
        cells = [s for s in (score_image(row[c], p) for row, p in zip(images, prompts, strict=True)) if s is not None]
        if cells:
            out.append({"column": label, "images": len(cells),
                        **{k: sum(s[k] for s in cells) / len(cells) for k in ("colour", "shape")}})
    return out


def _scores_html(scores: list[dict[str, Any]]) -> str:
    if not scores:
        return ""
    rows = "".join(f"<tr><th class=row>{html.escape(s['column'])}</th><td>{s['colour']:.2f}</td>"
                   f"<td>{s['shape']:.2f}</td></tr>" for s in scores)
    return (
        "<h2>Does it follow the prompts?</h2>"
        "<p>Scored over the images whose prompt names a colour and a shape of the synthetic dataset "
        f"({scores[0]['images']} per column). <b>colour</b>: share of pixels in the colours the prompt names (its "
        "shape's and its background's). Compare a column with the base model's: what ignoring the colour words "
        "scores depends on the prompts (about 0.25 when they name two of the eight colours, more when one is a white "
        "background that most pictures already hold; the embedded demo's base scores about 0.5). <b>shape</b>: "
        "overlap (IoU) of the pixels in the shape's colour with the named shape drawn around them; 0 when that "
        "colour is missing.</p>"
        f"<table class=scores><tr><th></th><th>colour</th><th>shape</th></tr>{rows}</table>"
    )


# Images one pipeline call renders together: the cells of a column in batches of at most this many pixels each
# (4 images at 512 px, 1 at 1024 px; the demo's 12 at 32 px in one call). Per-call overhead dominates a small model:
# the demo's column took 9.8 s one image at a time and 3.4 s in one batch of 12, the pixels within 1/255; a large
# model's memory stays what 4 SD 1.x images at 512 px take.
PIXELS_PER_CALL = 4 * 512 * 512


def check_negative_prompt_steers(family: str, guidance_scale: Optional[float],
                                 negative_prompt: Optional[str]) -> None:
    """ConfigError for a negative prompt the grid's pipeline would draw without, every cell the same as with none:
    FluxPipeline reads one only with true_cfg_scale (its guidance_scale is Flux.1-dev's distilled guidance input),
    and the other pipelines for classifier-free guidance, which they run only above guidance scale 1. The registered
    model refuses the same (tracking/sd_pyfunc.py, check_negative_prompt_steers: its script cannot import this)."""
    if negative_prompt is None:
        return
    if family == "flux":
        raise ConfigError("--negative-prompt: a Flux model draws without one (its guidance scale is Flux.1-dev's "
                          "distilled guidance input, not classifier-free guidance, which a negative prompt steers); "
                          "leave it out")
    if guidance_scale is not None and guidance_scale <= 1:
        raise ConfigError(f"--negative-prompt: the guidance scale is {guidance_scale:g}, and classifier-free guidance, "
                          "which a negative prompt steers, runs only above 1; pass --guidance above 1, or leave the "
                          "negative prompt out")


def render_grid(
    models: Sequence[Union[str, Path, GridColumn]],
    prompts: Sequence[str],
    seeds: Sequence[int],
    *,
    out_dir: Union[str, Path],
    labels: Optional[Sequence[str]] = None,
    base_model: Union[str, Path, None] = None,
    steps: int = 25,
    guidance_scale: Optional[float] = None,
    scheduler: Optional[str] = None,
    resolution: Optional[int] = None,
    negative_prompt: Optional[str] = None,
    device: Optional[str] = None,
    dtype=None,
    cell_size: Optional[int] = None,
    variant: Optional[str] = None,
) -> dict[str, Any]:
    """Render every prompt x seed (rows) for every model (columns) into `out_dir`.

    `models[0]` is normally the base model, so the first column shows what training changed. A LoRA or embedding
    column is applied on top of `base_model` (default: `models[0]`). `guidance_scale` None: the base model's own
    (family_detection.guidance_scale_in), which the manifest's settings record: none for a model whose pipeline
    ignores it (FLUX.1-schnell), which refuses one given. `variant`: the base model's weights
    variant (model.variant), where its folder holds it beside the plain weights. Returns the paths written and the
    layout:
    `{"grid", "html", "manifest", "images": [[path per column] per row], "rows", "columns", "layout", "settings",
    "scores"}`; "scores" says per column how well its images follow shapes prompts (`prompt_scores`).
    """
    import torch

    if not models:
        raise ConfigError("render_grid: pass at least one model (the base model first)")
    if not prompts or not seeds:
        raise ConfigError("sampling.prompts and sampling.seeds must each list at least one entry")
    if labels is not None and len(labels) != len(models):
        raise ConfigError(f"render_grid: {len(labels)} labels for {len(models)} models; give one label per model")
    check_scheduler_name(scheduler)
    columns = [
        m if isinstance(m, GridColumn) else resolve_column(m, labels[i] if labels else None)
        for i, m in enumerate(models)
    ]
    if labels is None:
        seen: dict[str, int] = {}
        fixed = []
        for c in columns:  # the same folder twice (or two `final`s) must still be told apart
            n = seen.get(c.label, 0)
            seen[c.label] = n + 1
            fixed.append(c if n == 0 else GridColumn(f"{c.label} ({n + 1})", c.path, c.kind, c.token))
        columns = fixed
    base = Path(base_model) if base_model is not None else columns[0].path
    for c in columns:  # no folder's own code runs, whichever column or base model names it
        if c.kind == "pipeline":
            refuse_shipped_code(c.path, f"column {c.label} ({c.path})")
    if (base / "model_index.json").is_file() and all(c.path != base for c in columns):
        refuse_shipped_code(base, f"base model {base}")
    if any(c.kind != "pipeline" for c in columns):
        if not (base / "model_index.json").is_file():
            raise ConfigError(
                f"base model {base} is not a diffusers folder (no model_index.json); adapters and checkpoints "
                "are applied on top of it, so pass --model DIR with the base model's folder"
            )
    base_family = _column_family(GridColumn("base", base, "pipeline")) if (base / "model_index.json").is_file() \
        else None
    for c in columns:  # a damaged checkpoint is refused before any cell is rendered or the old grid touched
        if c.kind == "engine_checkpoint":
            checkpoints.require_intact(c.path)
        family = _column_family(c)
        if base_family is not None and family is not None and family != base_family:
            what = {"lora": "LoRA", "textual_inversion": "embedding",
                    "engine_checkpoint": "checkpoint"}.get(c.kind, "model")
            raise ConfigError(f"column {c.label} ({c.path}) is a {FAMILY_NAMES[family]} {what}, but the base model "
                              f"{base} is {FAMILY_NAMES[base_family]}: a grid compares weights of one family; pass "
                              "--model of its family")
    grid_family = base_family or detect_family(base)
    guidance_scale = guidance_scale_in(base, grid_family, guidance_scale, refuse=(
        f"guidance scale {guidance_scale or 0:g}", "leave the guidance scale out"))
    check_negative_prompt_steers(grid_family, guidance_scale, negative_prompt)
    check_scheduler_takes(grid_family, scheduler)
    device = device or _default_device()
    out = grid_folder(out_dir)
    manifest_path = out / "grid.json"

    rows = [(i, p, s) for i, p in enumerate(prompts) for s in seeds]
    row_labels = [f"{p} | seed {s}" for _, p, s in rows]
    images: list[list[Any]] = [[None] * len(columns) for _ in rows]
    paths: list[list[str]] = [[""] * len(columns) for _ in rows]
    size: Optional[int] = None
    for c_index, column in enumerate(columns):
        try:
            pipe = load_column_pipeline(column, base, device=device, dtype=dtype, scheduler=scheduler,
                                        variant=variant)
        except RangefinderError:
            raise
        except Exception as e:  # diffusers, transformers, peft and safetensors each raise their own for bad weights
            first = str(e).splitlines()[0][:300] if str(e) else ""
            raise ConfigError(f"column {column.label} ({column.path}) cannot be loaded on base model {base} "
                              f"({type(e).__name__}: {first}); it is damaged, or a checkpoint of another model; "
                              "pass a whole checkpoint of this base model") from None
        # A transformer (Flux) has no sample size: its VAE's is the native resolution in pixels.
        res = resolution or (pipe.unet.config.sample_size * pipe.vae_scale_factor if hasattr(pipe, "unet")
                             else int(pipe.vae.config.sample_size))
        col_dir = out / "images" / f"{c_index:02d}-{_slug(column.label)}"
        per_call, cells = max(1, PIXELS_PER_CALL // (res * res)), list(enumerate(rows))
        for start in range(0, len(cells), per_call):
            batch = cells[start:start + per_call]
            # One CPU generator per cell: the initial latents depend on the seed alone, not on what ran before
            # or beside it in the batch (diffusers draws each image's latents from its own generator).
            generators = [torch.Generator("cpu").manual_seed(int(seed)) for _, (_, _, seed) in batch]
            rendered = pipe(
                [prompt for _, (_, prompt, _) in batch],
                negative_prompt=None if negative_prompt is None else [negative_prompt] * len(batch),
                num_inference_steps=steps,
                **({} if guidance_scale is None else {"guidance_scale": guidance_scale}),
                height=res,
                width=res,
                generator=generators,
                **pipeline_call_kwargs(pipe),
            ).images
            for (r, (p_index, _, seed)), img in zip(batch, rendered, strict=True):
                path = col_dir / f"p{p_index:02d}-s{seed}.png"
                images[r][c_index] = img
                paths[r][c_index] = str(path)
            size = res
        del pipe
        if device.startswith("cuda"):
            torch.cuda.empty_cache()

    cell = cell_size or max(size or 0, 128)
    grid, layout = compose_grid(images, row_labels, [c.label for c in columns], cell)
    grid_path = out / "grid.png"
    settings = {
        "steps": steps,
        "guidance_scale": guidance_scale,
        "scheduler": scheduler or "model default",
        "resolution": size,
    }
    scores = prompt_scores(images, [p for _, p, _ in rows], [c.label for c in columns])
    html_path = out / "grid.html"
    result = {
        "grid": str(grid_path),
        "html": str(html_path),
        "manifest": str(manifest_path),
        "images": paths,
        "rows": [{"prompt": p, "seed": s} for _, p, s in rows],
        "columns": [{"label": c.label, "path": str(c.path), "kind": c.kind} for c in columns],
        "layout": {
            "cell": layout.cell,
            "label_width": layout.label_width,
            "header_height": layout.header_height,
            "rows": layout.rows,
            "cols": layout.cols,
            "size": list(layout.size),
        },
        "settings": settings,
        "scores": scores,
    }
    # The manifest names its own files relative to its folder: the folder is what travels (MLflow's `samples/`, a
    # KFP artifact downloaded elsewhere), and the render folder's absolute path means nothing once it has.
    local = {**result, "grid": grid_path.name, "html": html_path.name, "manifest": manifest_path.name,
             "images": [[Path(p).relative_to(out).as_posix() for p in row] for row in paths]}
    # Every file goes into a folder beside `out` that takes its place whole, the manifest in it: a Ctrl-C, a full
    # disk or a column that failed to load part-way left the earlier grid's grid.png and grid.html beside cells of
    # this one, which a reader took for one grid. The cells were held for the grid image anyway.
    with atomic_dir(out) as work:
        for row, row_paths in zip(images, paths, strict=True):
            for img, cell_path in zip(row, row_paths, strict=True):
                _save_png(img, work / Path(cell_path).relative_to(out))
        _save_png(grid, work / grid_path.name)
        write_text(work / html_path.name, _grid_html(images, row_labels, [c.label for c in columns], cell, settings,
                                                     _scores_html(scores)))
        write_text(work / manifest_path.name, json.dumps(local, indent=2))
    return result


# What a grid's folder holds (render_grid); anything else in --out would be lost when the new grid takes its place.
GRID_ENTRIES = frozenset({"grid.json", "grid.png", "grid.html", "images"})


def grid_folder(out_dir: Union[str, Path]) -> Path:
    """`out_dir` as the folder a grid replaces whole: absent, empty or an earlier grid's; ConfigError, before any
    cell is rendered, where it holds anything else (a run's folder, the working folder), which the swap would
    delete."""
    # Resolved: a link's target takes the new grid and the link stays (swapped, the link became a folder of its own,
    # on the link's disk); the working folder, or one holding it, would be moved from under the shell.
    out = usable_folder(out_dir, "the grid's output folder").resolve()
    if Path.cwd().resolve().is_relative_to(out):
        raise ConfigError(f"{out} is the working folder or holds it, and a grid replaces its folder whole; pass a "
                          "new folder, e.g. --out samples")
    if out.is_dir():
        others = sorted(p.name for p in out.iterdir() if p.name not in GRID_ENTRIES and not TEMPORARY.match(p.name))
        if others:
            raise ConfigError(f"{out} holds {', '.join(others[:3])}{' and more' if len(others) > 3 else ''}, "
                              "which is no part of a sample grid, and a grid replaces its folder whole; pass a new "
                              "or empty folder, or an earlier grid's")
    return out


def read_prompts(path: Union[str, Path]) -> list[str]:
    """Prompts from a text file, one per line; blank lines and lines starting with # are skipped."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"prompts file {p} is a folder; pass a text file with one prompt per line")
    if not p.is_file():
        raise ConfigError(f"prompts file {p} does not exist; pass a text file with one prompt per line")
    try:
        text = decode_utf8(p.read_bytes())
    except NotUtf8 as e:
        how = f", e.g. `iconv -f {e.encoding} -t utf-8 {p.name} > fixed.txt`, and pass fixed.txt" if e.encoding else ""
        raise ConfigError(f"prompts file {p} {e}; save it as UTF-8{how}") from None
    prompts = [ln.strip() for ln in text.splitlines()]
    prompts = [ln for ln in prompts if ln and not ln.startswith("#")]
    if not prompts:
        raise ConfigError(f"prompts file {p} holds no prompts; write one prompt per line")
    return prompts
