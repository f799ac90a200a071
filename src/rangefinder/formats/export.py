"""Output formats other tools load: diffusers folders, single-file SD checkpoints, LoRA files, embeddings.

Each file is written for named consumers, and the tests load it with those consumers' own code or key rules:

- `full`: the diffusers folder (`save_pipeline_folder`: its text encoder in the `text_model.` layout that
  transformers 4.x and 5.x both load, its tokenizer with `vocab.json`/`merges.txt` for slow tokenizers) and one
  `.safetensors` file in the original Stable Diffusion (LDM, CompVis) key layout, which AUTOMATIC1111, ComfyUI and
  diffusers' `from_single_file` load.
- `lora`: `pytorch_lora_weights.safetensors` (diffusers' default file name) in a naming that both diffusers'
  `load_lora_weights` and ComfyUI map completely, alpha/rank folded into the weights; and `lora_kohya.safetensors`
  in kohya's sd-scripts layout with an `.alpha` per module, for A1111, ComfyUI and kohya.
- `textual_inversion`: `learned_embeds.safetensors` (diffusers: `{token: (vectors, dim)}`) and, under `a1111/`,
  an embedding named after its trigger word (A1111 names an embedding after its file) as `.safetensors` and as a
  `.pt` that A1111's restricted unpickler accepts, with the update count and base model filled in.

Every file carries the run's facts in its safetensors metadata (`rangefinder.*` keys, see `export_metadata`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder import __version__
from rangefinder.formats.atomic import atomic_path, write_json, write_text

SINGLE_FILE_NAME = "model.safetensors"
LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default name; ComfyUI reads it as well
LORA_KOHYA_NAME = "lora_kohya.safetensors"  # A1111, ComfyUI, kohya's sd-scripts
TI_WEIGHTS_NAME = "learned_embeds.safetensors"  # diffusers' default name for `load_textual_inversion`
TI_A1111_DIR = "a1111"  # `<trigger>.safetensors` and `<trigger>.pt`, for A1111's embeddings folder
CLIP_TEXT_PREFIX = "text_model."


def export_metadata(
    *,
    method: str,
    base_model: Optional[str] = None,
    lr: Optional[float] = None,
    epochs: Optional[float] = None,
    updates: Optional[int] = None,
    extra: Optional[Mapping[str, Any]] = None,
) -> dict[str, str]:
    """Metadata for a weights file. safetensors metadata holds strings only, so numbers are written with repr."""
    meta = {
        "rangefinder.version": __version__,
        "rangefinder.method": method,
        "rangefinder.base_model": base_model or "embedded tiny model",
    }
    if lr is not None:
        meta["rangefinder.lr"] = repr(float(lr))
    if epochs is not None:
        meta["rangefinder.epochs"] = repr(float(epochs))
    if updates is not None:
        meta["rangefinder.updates"] = str(int(updates))
    for k, v in (extra or {}).items():
        meta[k if "." in k else f"rangefinder.{k}"] = v if isinstance(v, str) else json.dumps(v)
    return meta


def training_metadata(
    cfg, base_model: Optional[str] = None, extra=None, updates: Optional[int] = None
) -> dict[str, str]:
    """The facts every output file carries: base model, method, LR (or the schedule's range), budget, updates taken,
    version."""
    info: dict[str, Any] = {"schedule": cfg.schedule}
    if cfg.schedule != "constant":
        info.update(lr_min=cfg.lr_min, lr_max=cfg.lr_max)
    if cfg.steps is not None:
        info.update(steps=cfg.steps, steps_unit=cfg.steps_unit)
    info["effective_batch"] = cfg.batch_size * cfg.grad_accum * cfg.world_size
    info.update(extra or {})
    return export_metadata(
        method=cfg.method,
        base_model=base_model,
        lr=cfg.lr,
        epochs=cfg.epochs,
        updates=updates,
        extra=info,
    )


def save_safetensors(tensors: Mapping[str, Any], path: Path, metadata: Optional[Mapping[str, str]] = None) -> Path:
    """Write to a temporary name and rename, so a half-written file never looks finished."""
    from safetensors.torch import save_file

    # safetensors refuses shared or non-contiguous storage; a clone per tensor keeps the caller's tensors intact.
    with atomic_path(path) as tmp:
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata or {}))
    return Path(path)


def read_metadata(path: Path) -> dict[str, str]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        return dict(f.metadata() or {})


# ---------------------------------------------------------------------------------------------------------------
# full: diffusers -> original SD (LDM) single-file layout
#
# The LDM names come from CompVis' ldm/modules/diffusionmodules/openaimodel.py (UNetModel: input_blocks,
# middle_block, output_blocks; ResBlock: in_layers, emb_layers, out_layers, skip_connection) and
# ldm/modules/diffusionmodules/model.py (Encoder/Decoder: down.i.block.j, mid.block_1, mid.attn_1, up.i.upsample;
# decoder levels are numbered from the bottom, diffusers' from the top). The inverse direction ships in diffusers
# (`loaders.single_file_utils.convert_ldm_unet_checkpoint`, `convert_ldm_vae_checkpoint`), which the tests use to
# check this mapping round-trips exactly. The tables below are built from the model configs, so any depth and
# `layers_per_block` map, not only SD 1.x's four levels of two.

LDM_UNET_PREFIX = "model.diffusion_model."
LDM_VAE_PREFIX = "first_stage_model."
LDM_CLIP_PREFIX = "cond_stage_model.transformer."
# SDXL's single file (Stability's generative-models "SGM" layout, which ComfyUI and A1111 load): the two text
# encoders under the conditioner, CLIP ViT-L in transformers' naming, OpenCLIP bigG in open_clip's.
SGM_CLIP_L_PREFIX = "conditioner.embedders.0.transformer."
SGM_CLIP_G_PREFIX = "conditioner.embedders.1.model."

# Inside a UNet ResBlock (openaimodel.ResBlock), diffusers' ResnetBlock2D names -> LDM names.
UNET_RESNET_RENAMES = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "time_emb_proj": "emb_layers.1",
    "conv_shortcut": "skip_connection",
}
# Inside a VAE ResnetBlock (model.ResnetBlock) only the shortcut differs.
VAE_RESNET_RENAMES = {"conv_shortcut": "nin_shortcut"}
# Inside the VAE mid-block attention (model.AttnBlock): 1x1 convolutions in LDM, linear layers in diffusers.
VAE_ATTENTION_RENAMES = {
    "group_norm": "norm",
    "to_q": "q",
    "to_k": "k",
    "to_v": "v",
    "to_out.0": "proj_out",
}


def _unet_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
    """(diffusers prefix, LDM prefix, renames inside the block) for every block of a UNet2DConditionModel."""
    n = len(config["block_out_channels"])
    per = config["layers_per_block"]
    if not isinstance(per, int):
        raise ValueError("single-file export supports an integer layers_per_block (SD 1.x/2.x UNets)")
    table: list[tuple[str, str, Mapping[str, str]]] = []
    for i in range(n):
        for j in range(per):
            k = i * (per + 1) + j + 1  # input_blocks.0 is conv_in; each level adds `per` blocks + a downsampler
            table.append((f"down_blocks.{i}.resnets.{j}.", f"input_blocks.{k}.0.", UNET_RESNET_RENAMES))
            table.append((f"down_blocks.{i}.attentions.{j}.", f"input_blocks.{k}.1.", {}))
        if i < n - 1:
            table.append((f"down_blocks.{i}.downsamplers.0.conv.", f"input_blocks.{(i + 1) * (per + 1)}.0.op.", {}))
    table += [
        ("mid_block.resnets.0.", "middle_block.0.", UNET_RESNET_RENAMES),
        ("mid_block.attentions.0.", "middle_block.1.", {}),
        ("mid_block.resnets.1.", "middle_block.2.", UNET_RESNET_RENAMES),
    ]
    for i, block_type in enumerate(config["up_block_types"]):
        for j in range(per + 1):
            k = i * (per + 1) + j
            table.append((f"up_blocks.{i}.resnets.{j}.", f"output_blocks.{k}.0.", UNET_RESNET_RENAMES))
            table.append((f"up_blocks.{i}.attentions.{j}.", f"output_blocks.{k}.1.", {}))
        if i < n - 1:
            # The upsampler follows the attention layer where the level has one.
            slot = 2 if "CrossAttn" in block_type else 1
            table.append((f"up_blocks.{i}.upsamplers.0.", f"output_blocks.{i * (per + 1) + per}.{slot}.", {}))
    return table


def _vae_prefix_table(config: Mapping[str, Any]) -> list[tuple[str, str, Mapping[str, str]]]:
    n = len(config["block_out_channels"])
    per = config["layers_per_block"]
    table: list[tuple[str, str, Mapping[str, str]]] = []
    for i in range(n):
        for j in range(per):
            table.append((f"encoder.down_blocks.{i}.resnets.{j}.", f"encoder.down.{i}.block.{j}.", VAE_RESNET_RENAMES))
        if i < n - 1:
            table.append((f"encoder.down_blocks.{i}.downsamplers.0.", f"encoder.down.{i}.downsample.", {}))
        for j in range(per + 1):
            table.append(
                (f"decoder.up_blocks.{i}.resnets.{j}.", f"decoder.up.{n - 1 - i}.block.{j}.", VAE_RESNET_RENAMES)
            )
        if i < n - 1:
            table.append((f"decoder.up_blocks.{i}.upsamplers.0.", f"decoder.up.{n - 1 - i}.upsample.", {}))
    for part in ("encoder", "decoder"):
        table += [
            (f"{part}.mid_block.resnets.0.", f"{part}.mid.block_1.", VAE_RESNET_RENAMES),
            (f"{part}.mid_block.resnets.1.", f"{part}.mid.block_2.", VAE_RESNET_RENAMES),
            (f"{part}.mid_block.attentions.0.", f"{part}.mid.attn_1.", VAE_ATTENTION_RENAMES),
        ]
    return table


def _top_level_tables() -> tuple[dict[str, str], dict[str, str]]:
    """The non-block layers, from diffusers' own diffusers->LDM name table (used by its single-file loader)."""
    from diffusers.loaders.single_file_utils import DIFFUSERS_TO_LDM_MAPPING

    mapping: dict[str, Any] = DIFFUSERS_TO_LDM_MAPPING  # diffusers types it as dict[str, object]
    # SDXL's added (pooled text + size) embedding is `label_emb` there.
    return dict(mapping["unet"]["layers"]) | dict(mapping["unet"]["addition_embed_type"]), dict(mapping["vae"])


def _map_keys(state_dict, table, top_level: Mapping[str, str], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    table = sorted(table, key=lambda row: -len(row[0]))  # longest prefix first
    for key, value in state_dict.items():
        if key in top_level:
            out[top_level[key]] = value
            continue
        for d_prefix, ldm_prefix, renames in table:
            if key.startswith(d_prefix):
                rest = key[len(d_prefix):]
                for d_name, ldm_name in renames.items():
                    if rest.startswith(d_name + "."):
                        rest = ldm_name + rest[len(d_name):]
                        break
                out[ldm_prefix + rest] = value
                break
        else:
            raise ValueError(f"{what} weight {key!r} has no place in the original SD layout; cannot export it")
    return out


def open_clip_state_dict(text_encoder_2) -> dict[str, Any]:
    """A transformers CLIPTextModelWithProjection's weights in open_clip's naming (SDXL's bigG encoder in its single
    file): q/k/v fused into `attn.in_proj_*`, the projection transposed. The inverse of diffusers'
    `convert_open_clip_checkpoint` (loaders/single_file_utils.py), which the tests use to check the round trip."""
    te = {k.removeprefix("text_model."): v for k, v in text_encoder_2.state_dict().items()}
    out: dict[str, Any] = {
        "token_embedding.weight": te.pop("embeddings.token_embedding.weight"),
        "positional_embedding": te.pop("embeddings.position_embedding.weight"),
        "ln_final.weight": te.pop("final_layer_norm.weight"),
        "ln_final.bias": te.pop("final_layer_norm.bias"),
        "text_projection": te.pop("text_projection.weight").T.contiguous(),
    }
    te.pop("embeddings.position_ids", None)  # a buffer, not a weight
    renames = {"layer_norm1": "ln_1", "layer_norm2": "ln_2", "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj",
               "self_attn.out_proj": "attn.out_proj"}
    for i in range(text_encoder_2.config.num_hidden_layers):
        src, dst = f"encoder.layers.{i}.", f"transformer.resblocks.{i}."
        for kind in ("weight", "bias"):
            out[f"{dst}attn.in_proj_{kind}"] = torch_cat(
                [te.pop(f"{src}self_attn.{p}_proj.{kind}") for p in ("q", "k", "v")]
            )
            for d_name, o_name in renames.items():
                out[f"{dst}{o_name}.{kind}"] = te.pop(f"{src}{d_name}.{kind}")
    if te:
        raise ValueError(f"text encoder 2 weight {sorted(te)[0]!r} has no place in the SDXL layout; cannot export it")
    return out


def torch_cat(tensors: list[Any]) -> Any:
    import torch

    return torch.cat(tensors, dim=0)


def diffusers_to_ldm_state_dict(unet, vae, text_encoder, text_encoder_2=None) -> dict[str, Any]:
    """One state dict in the original layout from diffusers modules: SD 1.x's (one CLIP text encoder), or SDXL's
    when `text_encoder_2` is given (both encoders under `conditioner.embedders.`)."""
    unet_top, vae_top = _top_level_tables()
    sd: dict[str, Any] = {}
    for k, v in _map_keys(unet.state_dict(), _unet_prefix_table(unet.config), unet_top, "UNet").items():
        sd[LDM_UNET_PREFIX + k] = v
    for k, v in _map_keys(vae.state_dict(), _vae_prefix_table(vae.config), vae_top, "VAE").items():
        if ".mid.attn_1." in k and k.endswith(".weight") and v.ndim == 2:
            v = v[:, :, None, None]  # LDM's AttnBlock uses 1x1 convolutions where diffusers uses linear layers
        sd[LDM_VAE_PREFIX + k] = v
    te_sd = text_encoder.state_dict()
    if "embeddings.token_embedding.weight" not in te_sd and "text_model.embeddings.token_embedding.weight" not in te_sd:
        raise ValueError("single-file export supports a CLIPTextModel text encoder (SD 1.x)")
    clip_prefix = LDM_CLIP_PREFIX if text_encoder_2 is None else SGM_CLIP_L_PREFIX
    for k, v in te_sd.items():
        sd[clip_prefix + clip_text_key(k)] = v
    if text_encoder_2 is not None:
        for k, v in open_clip_state_dict(text_encoder_2).items():
            sd[SGM_CLIP_G_PREFIX + k] = v
    return sd


def save_single_file_checkpoint(unet, vae, text_encoder, path: Path, metadata: Optional[Mapping[str, str]] = None,
                                text_encoder_2=None):
    """The `.safetensors` single file A1111 and ComfyUI load (and `StableDiffusionPipeline.from_single_file`, or
    StableDiffusionXLPipeline's for SDXL)."""
    return save_safetensors(diffusers_to_ldm_state_dict(unet, vae, text_encoder, text_encoder_2), Path(path), metadata)


def export_full(model_dir: Path, out_path: Optional[Path] = None, metadata: Optional[Mapping[str, str]] = None):
    """The single file next to a diffusers folder (`final/` -> `final/model.safetensors` by default)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    model_dir = Path(model_dir)
    unet = UNet2DConditionModel.from_pretrained(str(model_dir / "unet"))
    vae = AutoencoderKL.from_pretrained(str(model_dir / "vae"))
    text_encoder = CLIPTextModel.from_pretrained(str(model_dir / "text_encoder"))
    text_encoder_2 = None
    if (model_dir / "text_encoder_2" / "config.json").is_file():  # SDXL
        text_encoder_2 = CLIPTextModelWithProjection.from_pretrained(str(model_dir / "text_encoder_2"))
    return save_single_file_checkpoint(unet, vae, text_encoder, out_path or model_dir / SINGLE_FILE_NAME, metadata,
                                       text_encoder_2=text_encoder_2)


# ---------------------------------------------------------------------------------------------------------------
# diffusers folders: what transformers 4.x and 5.x, fast and slow tokenizers all load


def clip_text_key(key: str) -> str:
    """A CLIPTextModel weight name in the layout every consumer knows, under `text_model.`.

    transformers 5 dropped that wrapper module (and strips the prefix when it loads: its conversion_mapping.py,
    `PrefixChange(prefix_to_remove="text_model")` for CLIPTextModel); transformers 4.x, SD 1.x single files, kohya and
    ComfyUI all name the weights under it.
    """
    return key if key.startswith(CLIP_TEXT_PREFIX) else CLIP_TEXT_PREFIX + key


def write_text_encoder_weights_with_prefix(text_encoder_dir: Path) -> None:
    """Rename the saved CLIP text encoder's weights to the `text_model.` layout, in place (one file at a time, each
    atomically). transformers 4.x loads a CLIPTextModel saved without the prefix with every weight missing: a text
    encoder left at random initialisation, with only a warning."""
    from safetensors import safe_open

    text_encoder_dir = Path(text_encoder_dir)
    config = json.loads((text_encoder_dir / "config.json").read_text())
    if "CLIPTextModel" not in config.get("architectures", []):
        return  # only CLIPTextModel has the wrapper (CLIPTextModelWithProjection keeps `text_model.` in 5.x)
    for path in sorted(text_encoder_dir.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if all(k.startswith(CLIP_TEXT_PREFIX) for k in f.keys()):
                continue
            tensors = {clip_text_key(k): f.get_tensor(k) for k in f.keys()}
        # transformers 4.x refuses a safetensors file whose metadata lacks {"format": "pt"}.
        save_safetensors(tensors, path, {"format": "pt", **meta})
    index = text_encoder_dir / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"] = {clip_text_key(k): v for k, v in data["weight_map"].items()}
        write_json(index, data)


def write_slow_tokenizer_files(tokenizer, tokenizer_dir: Path) -> None:
    """`vocab.json`, `merges.txt` and (when tokens were added) `added_tokens.json` beside `tokenizer.json`, from the
    tokenizer's own BPE model.

    transformers 5 saves only `tokenizer.json` (added tokens included); the slow (pure Python) CLIPTokenizer of
    transformers 4.x and the tools built on it read these files instead. Tokens added on top of the BPE vocabulary
    (textual inversion's) go to `added_tokens.json`, `{token: id}`, the slow tokenizers' file for them.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return  # a slow tokenizer's save_pretrained writes these files itself
    spec = json.loads(backend.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer model {model.get('type')!r} is not BPE; cannot write vocab.json/merges.txt")
    vocab = model["vocab"]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    tokenizer_dir = Path(tokenizer_dir)
    write_text(tokenizer_dir / "vocab.json", json.dumps(vocab, ensure_ascii=False) + "\n")
    # The header line is part of the format: CLIP's slow tokenizer skips the first line of merges.txt.
    write_text(tokenizer_dir / "merges.txt", "\n".join(["#version: 0.2", *merges]) + "\n")
    added = {t["content"]: t["id"] for t in spec.get("added_tokens", []) if t["content"] not in vocab}
    if added:
        write_json(tokenizer_dir / "added_tokens.json", added)


def save_pipeline_folder(pipe, out_dir: Path) -> Path:
    """`pipe.save_pretrained` (safetensors), then the two fixes above, so the folder loads under transformers 4.x
    and 5.x, with fast or slow tokenizers."""
    out_dir = Path(out_dir)
    pipe.save_pretrained(str(out_dir), safe_serialization=True)
    if (out_dir / "text_encoder").is_dir():
        write_text_encoder_weights_with_prefix(out_dir / "text_encoder")
    for name in ("tokenizer", "tokenizer_2"):  # tokenizer_2: SDXL's second
        if getattr(pipe, name, None) is not None:
            write_slow_tokenizer_files(getattr(pipe, name), out_dir / name)
    return out_dir


# ---------------------------------------------------------------------------------------------------------------
# lora: one file named for diffusers that ComfyUI also maps, and kohya's layout for A1111, ComfyUI and kohya
#
# ComfyUI (comfy/lora.py, `model_lora_keys_unet`) does not map today's diffusers/peft UNet names
# (`unet.<block>.attn1.to_q.lora_A.weight`): such a file loads no UNet weight there, with only "lora key not loaded"
# lines in its console. It does map diffusers' attention-processor names (`unet.<block>.attn1.processor.to_q`,
# `processor.to_out` for `to_out.0`), which diffusers' own loader still reads (state_dict_utils.py drops
# `.processor.` and maps `_lora.up`/`.lora.up` to `lora_B`). ComfyUI reads alpha only from an `.alpha` tensor, which
# diffusers refuses in diffusers naming; so the diffusers-named file has alpha/rank folded into `up`, and loads at
# scale 1 in both (no `.alpha`, no peft config: diffusers then takes alpha = rank).


@dataclass(frozen=True)
class LoraWeights:
    down: Any  # (r, in) lora_A
    up: Any  # (out, r) lora_B
    scale: float  # what peft multiplies up @ down by: alpha / r (alpha / sqrt(r) with rsLoRA)

    @property
    def rank(self) -> int:
        return int(self.down.shape[0])


def trained_lora_layers(module, adapter: str = "default") -> dict[str, LoraWeights]:
    """{module path: its adapter} for every peft LoRA layer of `module` that has `adapter`, with the scale peft
    itself applies, so rank and alpha patterns and rsLoRA come out as trained."""
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, m in module.named_modules():
        if isinstance(m, LoraLayer) and adapter in m.lora_A:
            # lora_A/B are nn.ModuleDicts; mypy reads them through nn.Module.__getattr__ (Tensor | Module).
            layers[name] = LoraWeights(
                down=m.lora_A[adapter].weight.detach(),  # type: ignore[operator]
                up=m.lora_B[adapter].weight.detach(),  # type: ignore[operator]
                scale=float(m.scaling[adapter]),
            )
    return layers


def _comfy_readable_unet_name(path: str) -> tuple[str, str]:
    """(module name, separator before `up`/`down`) under which both ComfyUI and diffusers find a UNet module."""
    name = path.replace(".to_", ".processor.to_")
    if name.endswith(".to_out.0"):
        return name[: -len(".0")], "_lora."  # ComfyUI maps `processor.to_out`; diffusers knows `to_out_lora`
    return name, ".lora."


def lora_to_diffusers(unet_layers: Mapping[str, LoraWeights], text_encoder_layers: Mapping[str, LoraWeights],
                      text_encoder_2_layers: Optional[Mapping[str, LoraWeights]] = None) -> dict:
    """The diffusers-named file's tensors (see the section comment), alpha/rank folded into `up`; SDXL's second
    encoder under `text_encoder_2.` (diffusers' StableDiffusionXLLoraLoaderMixin)."""
    out = {}
    for path, w in unet_layers.items():
        name, sep = _comfy_readable_unet_name(path)
        out[f"unet.{name}{sep}down.weight"] = w.down
        out[f"unet.{name}{sep}up.weight"] = (w.up.float() * w.scale).to(w.up.dtype)
    for prefix, layers in (("text_encoder.", text_encoder_layers), ("text_encoder_2.", text_encoder_2_layers or {})):
        for path, w in layers.items():
            # peft's names under the text encoder, which ComfyUI maps as `text_encoder.text_model.encoder.layers...`.
            name = prefix + clip_text_key(path)
            out[f"{name}.lora_A.weight"] = w.down
            out[f"{name}.lora_B.weight"] = (w.up.float() * w.scale).to(w.up.dtype)
    return out


def kohya_sdxl_unet_name(path: str, unet_config: Mapping[str, Any]) -> str:
    """A diffusers UNet module path under the name kohya's SDXL LoRA gives it: kohya trains SDXL on its own UNet,
    in the original (SGM) layout (sd-scripts library/sdxl_original_unet.py; the name mapping is
    library/sdxl_model_util.py `make_unet_conversion_map`), so its LoRA names are `lora_unet_` + the original
    module path (`input_blocks_4_1_transformer_blocks_0_attn1_to_q`), not the diffusers one as for SD 1.x."""
    top_level, _ = _top_level_tables()
    key = path + ".weight"
    mapped = _map_keys({key: None}, _unet_prefix_table(unet_config), top_level, "UNet")
    return next(iter(mapped)).removesuffix(".weight")


def lora_to_kohya(unet_layers: Mapping[str, LoraWeights], text_encoder_layers: Mapping[str, LoraWeights],
                  text_encoder_2_layers: Optional[Mapping[str, LoraWeights]] = None,
                  sdxl_unet_config: Optional[Mapping[str, Any]] = None) -> dict:
    """kohya's sd-scripts layout (networks/lora.py `LoRANetwork.create_modules` names a module `lora_unet_` /
    `lora_te_` + its path with `_` for `.`): `lora_down`/`lora_up` as trained and `.alpha` = scale * rank, from
    which every reader takes alpha / rank.

    SD 1.x's single text encoder is `lora_te_`; SDXL's two are `lora_te1_` and `lora_te2_` (LORA_PREFIX_TEXT_ENCODER1
    and 2 there), both under `text_model.`, and SDXL's UNet modules go by their original names
    (`kohya_sdxl_unet_name`) when `sdxl_unet_config` is given.
    """
    import torch

    sdxl = sdxl_unet_config is not None
    te_prefixes = ("lora_te1_", "lora_te2_") if sdxl else ("lora_te_", "lora_te2_")
    out = {}
    for prefix, layers in (("lora_unet_", unet_layers), (te_prefixes[0], text_encoder_layers),
                           (te_prefixes[1], text_encoder_2_layers or {})):
        for path, w in layers.items():
            if prefix != "lora_unet_":
                path = clip_text_key(path)
            elif sdxl_unet_config is not None:
                path = kohya_sdxl_unet_name(path, sdxl_unet_config)
            name = prefix + path.replace(".", "_")
            out[f"{name}.lora_down.weight"] = w.down
            out[f"{name}.lora_up.weight"] = w.up
            out[f"{name}.alpha"] = torch.tensor(w.scale * w.rank, dtype=torch.float32)
    return out


def save_lora_files(out_dir: Path, unet=None, text_encoder=None, metadata: Optional[Mapping[str, str]] = None,
                    text_encoder_2=None, sdxl: bool = False):
    """Both LoRA files into `out_dir`; returns {"diffusers": path, "kohya": path}. `sdxl`: kohya's SDXL names."""
    out_dir = Path(out_dir)
    unet_layers = trained_lora_layers(unet) if unet is not None else {}
    te_layers = trained_lora_layers(text_encoder) if text_encoder is not None else {}
    te2_layers = trained_lora_layers(text_encoder_2) if text_encoder_2 is not None else {}
    if not unet_layers and not te_layers and not te2_layers:
        raise ValueError("no LoRA adapters found on the UNet or the text encoder; nothing to export")
    meta = dict(metadata or {})
    kohya_meta = dict(meta)
    # sd-scripts' own training metadata keys, which A1111's and ComfyUI's LoRA browsers show.
    kohya_meta.setdefault("ss_network_module", "networks.lora")
    if sdxl:
        kohya_meta.setdefault("ss_base_model_version", "sdxl_base_v1-0")  # what sd-scripts writes for SDXL
    any_layer = next(iter({**unet_layers, **te_layers, **te2_layers}.values()))
    kohya_meta.setdefault("ss_network_dim", str(any_layer.rank))
    kohya_meta.setdefault("ss_network_alpha", repr(any_layer.scale * any_layer.rank))
    if "rangefinder.updates" in meta:
        kohya_meta.setdefault("ss_steps", meta["rangefinder.updates"])
    return {
        "diffusers": save_safetensors(lora_to_diffusers(unet_layers, te_layers, te2_layers),
                                      out_dir / LORA_WEIGHTS_NAME, meta),
        "kohya": save_safetensors(
            lora_to_kohya(unet_layers, te_layers, te2_layers, dict(unet.config) if sdxl and unet is not None else None),
            out_dir / LORA_KOHYA_NAME, kohya_meta),
    }


# ---------------------------------------------------------------------------------------------------------------
# textual_inversion: diffusers' learned_embeds and A1111's embedding files


def a1111_embedding_name(token: str) -> str:
    """The file stem, hence A1111's trigger word, for a placeholder token: `<rf-concept>` -> `rf-concept`.

    Kept are the characters A1111 keeps when it names an embedding file itself (`create_embedding` in
    modules/textual_inversion/textual_inversion.py): letters, digits and `._- `. What it drops includes every
    character some file system refuses (Windows: <>:"/\\|?*) and the path separators.
    """
    name = "".join(ch for ch in token if ch.isalnum() or ch in "._- ").strip(" .")
    if not name:
        raise ValueError(
            f"placeholder token {token!r} has no letter or digit to name its A1111 embedding file by; "
            "choose a token with some (e.g. '<my-concept>')"
        )
    return name


def base_model_name(base_model: Optional[str]) -> str:
    """What A1111 shows as an embedding's checkpoint: a file or folder's name, a hub id as is."""
    if not base_model:
        return "embedded tiny model"
    p = Path(base_model)
    if p.is_absolute() or p.exists():
        return p.stem if p.suffix in (".safetensors", ".ckpt") else p.name
    return base_model


def save_a1111_pt(path: Path, embeds, name: str, step: Optional[int], checkpoint_name: Optional[str]) -> Path:
    """An A1111 `.pt` embedding that passes its restricted unpickler (modules/safe.py).

    That loader accepts a zip only if every entry is `<dir>/data.pkl`, `<dir>/version` or `<dir>/data/<n>`, and
    today's torch zip writer adds `byteorder`, `.format_version` and `.data/serialization_id`. torch's legacy
    (non-zip) serialization has none of those: safe.py then checks the five pickles in turn, and they hold only
    what its unpickler allows (dict, str, int, None, `torch._utils._rebuild_tensor_v2`, `torch.FloatStorage`,
    `collections.OrderedDict`). The fields are A1111's own (`Embedding.save`).
    """
    import torch

    data = {
        "string_to_token": {"*": 265},  # CLIP's id of "*", as A1111 writes it
        "string_to_param": {"*": embeds.detach().to(torch.float32).contiguous().clone()},
        "name": name,
        "step": step,
        "sd_checkpoint": None,  # A1111's short hash of the checkpoint file; not known for a folder or hub model
        "sd_checkpoint_name": checkpoint_name,
    }
    with atomic_path(path) as tmp:
        torch.save(data, tmp, _use_new_zipfile_serialization=False)
    return Path(path)


def save_textual_inversion(
    out_dir: Path, token: str, embeds, metadata: Optional[Mapping[str, str]] = None
) -> dict[str, Path]:
    """`embeds` is (num_vectors, dim). Writes diffusers' `learned_embeds.safetensors` and A1111's embedding.

    A1111 names an embedding after its file, so the A1111 files are `a1111/<trigger>.safetensors` (one tensor,
    `emb_params`: A1111 takes a single-tensor file as an embedding) and `a1111/<trigger>.pt` (which also carries the
    update count and the base model, shown in A1111's UI).
    """
    out_dir = Path(out_dir)
    meta = dict(metadata or {})
    meta.setdefault("rangefinder.placeholder_token", token)
    name = a1111_embedding_name(token)
    meta["rangefinder.a1111_trigger"] = name
    updates = meta.get("rangefinder.updates")
    a1111 = out_dir / TI_A1111_DIR
    return {
        "diffusers": save_safetensors({token: embeds}, out_dir / TI_WEIGHTS_NAME, meta),
        "a1111": save_safetensors({"emb_params": embeds}, a1111 / f"{name}.safetensors", meta),
        "a1111_pt": save_a1111_pt(a1111 / f"{name}.pt", embeds, name, None if updates is None else int(updates),
                                  base_model_name(meta.get("rangefinder.base_model"))),
    }


def save_textual_inversion_sdxl(
    out_dir: Path, token: str, clip_l, clip_g, metadata: Optional[Mapping[str, str]] = None
) -> dict[str, Path]:
    """SDXL's embedding format: one file holding `clip_l` (num_vectors, D1), the rows of the first encoder (CLIP
    ViT-L), and `clip_g` (num_vectors, D2), those of the second (OpenCLIP bigG); A1111 and ComfyUI load it as an
    SDXL embedding, and diffusers with `load_textual_inversion(state["clip_l"], text_encoder=pipe.text_encoder, ...)`
    and again for `clip_g` with text_encoder_2. Written as `learned_embeds.safetensors` and, under the trigger word
    A1111 knows it by, `a1111/<trigger>.safetensors`."""
    out_dir = Path(out_dir)
    meta = dict(metadata or {})
    meta.setdefault("rangefinder.placeholder_token", token)
    name = a1111_embedding_name(token)
    meta["rangefinder.a1111_trigger"] = name
    tensors = {"clip_l": clip_l, "clip_g": clip_g}
    return {
        "diffusers": save_safetensors(tensors, out_dir / TI_WEIGHTS_NAME, meta),
        "a1111": save_safetensors(tensors, out_dir / TI_A1111_DIR / f"{name}.safetensors", meta),
    }
