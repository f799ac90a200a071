"""`lora`'s files: one named for diffusers that ComfyUI also maps, and kohya's layout for A1111, ComfyUI and kohya.

`pytorch_lora_weights.safetensors` (diffusers' default file name) in a naming that both diffusers'
`load_lora_weights` and ComfyUI map completely, alpha/rank folded into the weights; and `lora_kohya.safetensors` in
kohya's sd-scripts layout with an `.alpha` per module.

ComfyUI (comfy/lora.py, `model_lora_keys_unet`) does not map today's diffusers/peft UNet names
(`unet.<block>.attn1.to_q.lora_A.weight`): such a file loads no UNet weight there, with only "lora key not loaded"
lines in its console. It does map diffusers' attention-processor names (`unet.<block>.attn1.processor.to_q`,
`processor.to_out` for `to_out.0`), which diffusers' own loader still reads (state_dict_utils.py drops
`.processor.` and maps `_lora.up`/`.lora.up` to `lora_B`). ComfyUI reads alpha only from an `.alpha` tensor, which
diffusers refuses in diffusers naming; so the diffusers-named file has alpha/rank folded into `up`, and loads at
scale 1 in both (no `.alpha`, no peft config: diffusers then takes alpha = rank).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from rangefinder.formats.diffusers_folder import clip_text_key
from rangefinder.formats.model_spec import (
    ADAPTER_LORA,
    ARCH_SDXL,
    MODELSPEC_IMPL_DIFFUSERS,
    MODELSPEC_IMPL_FLUX,
    MODELSPEC_IMPL_SGM,
    SpecFacts,
    flux_architecture,
    is_sd2,
    model_spec,
    sd3_architecture,
    sd3_model_type,
    sd_base_model,
)
from rangefinder.formats.single_file import map_keys, top_level_tables, unet_prefix_table
from rangefinder.formats.weights_file import (
    FILE_REVISION_PREFIX,
    FOLDER_REVISION_PREFIX,
    base_model_path,
    names_embedded_model,
    save_safetensors,
)

LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # diffusers' default name; ComfyUI reads it as well
LORA_KOHYA_NAME = "lora_kohya.safetensors"  # A1111, ComfyUI, kohya's sd-scripts
# A1111's "old model hash" of a checkpoint (modules/sd_models.py `model_hash`), which sd-scripts writes as a LoRA's
# ss_sd_model_hash (library/train_util.py at 48d368f, `model_hash`, lines 3223-3237): the first 8 hex digits of the
# sha256 of the 64 KiB (LEGACY_HASH_LENGTH) that start 1 MiB (LEGACY_HASH_OFFSET) into the file, empty if shorter.
LEGACY_HASH_OFFSET = 0x100000
LEGACY_HASH_LENGTH = 0x10000


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
    top_level, _ = top_level_tables()
    key = path + ".weight"
    mapped = map_keys({key: None}, unet_prefix_table(unet_config), top_level, "UNet")
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


def lora_to_diffusers_flux(transformer_layers: Mapping[str, LoraWeights],
                           text_encoder_layers: Mapping[str, LoraWeights]) -> dict:
    """Flux's diffusers-named file: peft's names under `transformer.` (diffusers' FluxLoraLoaderMixin, and ComfyUI's
    `transformer.<diffusers module>` names for Flux, comfy/lora.py `model_lora_keys_unet` at 41444b5236c6, which
    patch the slice of a fused BFL weight the module is), and CLIP-L's under `text_encoder.`; alpha/rank folded into
    `lora_B`, as for SD."""
    out = {}
    for prefix, layers, rename in (("transformer.", transformer_layers, False),
                                   ("text_encoder.", text_encoder_layers, True)):
        for path, w in layers.items():
            name = prefix + (clip_text_key(path) if rename else path)
            out[f"{name}.lora_A.weight"] = w.down
            out[f"{name}.lora_B.weight"] = (w.up.float() * w.scale).to(w.up.dtype)
    return out


def lora_to_kohya_flux(transformer_layers: Mapping[str, LoraWeights], text_encoder_layers: Mapping[str, LoraWeights],
                       transformer_config: Mapping[str, Any]) -> dict:
    """kohya's Flux LoRA (sd-scripts networks/lora_flux.py at 0087a46e14c8): `lora_unet_` + the module's path in
    Black Forest Labs' layout (formats/flux_layout.py), CLIP-L as `lora_te1_`.

    Where BFL fuses diffusers modules into one linear layer (`img_attn.qkv`, a single block's `linear1`), the
    adapters fuse as sd-scripts' own `split_qkv` LoRA saves them (LoRANetwork.state_dict there): the parts' `down`
    stacked, `up` block-diagonal, so the fused product is each part's product in its rows. A part without an
    adapter is rows of zeros. Every module keeps `up` as trained and `.alpha` = its first part's scale x its rank
    (down's rows), from which every reader takes alpha / rank (ComfyUI's comfy/weight_adapter/lora.py
    `calculate_weight`, diffusers' `_convert_kohya_flux_lora_to_diffusers`): so the file's alpha is the trained one,
    as `ss_network_alpha` says. A part whose scale differs from the first's (peft's alpha_pattern) has the ratio
    folded into its `up` block; with one LoRA config the ratio is 1 and nothing is folded.
    """
    import torch

    from rangefinder.formats.flux_layout import (
        KOHYA_FLUX_CLIP_PREFIX,
        KOHYA_FLUX_PREFIX,
        SWAPPED_HALVES,
        bfl_module_of,
        bfl_modules,
        swap_halves,
    )

    fused_parts = bfl_modules(transformer_config)
    where = bfl_module_of(transformer_config)
    by_bfl: dict[str, dict[int, LoraWeights]] = {}
    for path, w in transformer_layers.items():
        if path not in where:
            raise ValueError(f"LoRA on Flux module {path!r}, which has no place in Black Forest Labs' layout")
        bfl, j = where[path]
        by_bfl.setdefault(bfl, {})[j] = w
    out = {}
    for bfl, adapters in by_bfl.items():
        parts = fused_parts[bfl]
        ordered = [adapters[j] for j in sorted(adapters)]
        down = torch.cat([w.down for w in ordered], dim=0)
        rows = [_fused_rows(j, adapters, transformer_config, parts) for j in range(len(parts))]
        scale = ordered[0].scale
        up = torch.zeros((sum(rows), down.shape[0]), dtype=ordered[0].up.dtype)
        row, col = 0, 0
        for j, n_rows in enumerate(rows):
            if j in adapters:
                w = adapters[j]
                block = w.up if w.scale == scale else (w.up.float() * (w.scale / scale)).to(up.dtype)
                up[row: row + n_rows, col: col + w.rank] = block
                col += w.rank
            row += n_rows
        if bfl == SWAPPED_HALVES:  # the weight's (scale, shift) rows are BFL's (shift, scale): the change's too
            up = swap_halves(up)
        out.update(_kohya_module(KOHYA_FLUX_PREFIX + bfl.replace(".", "_"), down, up, scale))
    for path, w in text_encoder_layers.items():
        out.update(_kohya_module(KOHYA_FLUX_CLIP_PREFIX + clip_text_key(path).replace(".", "_"), w.down, w.up,
                                 w.scale))
    return out


def _fused_rows(j: int, adapters: Mapping[int, LoraWeights], config: Mapping[str, Any], parts: tuple[str, ...]) -> int:
    """The output rows of fused part j: its adapter's, else (no adapter on it) the width the config gives it."""
    if j in adapters:
        return int(adapters[j].up.shape[0])
    inner = int(config["num_attention_heads"]) * int(config["attention_head_dim"])
    return inner * 4 if parts[j].endswith("proj_mlp") else inner  # FluxSingleTransformerBlock's mlp_ratio 4


def kohya_metadata(meta: Mapping[str, str], any_layer: LoraWeights, network_module: str,
                   base_model_version: Optional[str], spec: Optional[Mapping[str, str]] = None,
                   trainer: Optional[Mapping[str, str]] = None) -> dict[str, str]:
    """`meta` plus sd-scripts' own training metadata keys (train_network.py), which A1111's and ComfyUI's LoRA
    browsers show: the network module, the base model version, dim and alpha as trained (what the file's `.alpha`
    tensors hold: each family's `lora_to_kohya*` writes alpha = scale x rank), and the updates as `ss_steps`, the
    same for every family; the file's model spec (formats/model_spec.py), when its base model is known; and
    `trainer`, the family's keys of its objective (a flow model's, as its sd-scripts network trainer's
    `update_metadata` writes them: training/family_rules.py kohya_training_metadata)."""
    out = {**meta, "ss_network_module": network_module, "ss_network_dim": str(any_layer.rank),
           "ss_network_alpha": repr(any_layer.scale * any_layer.rank), **kohya_base_model(meta)}
    if base_model_version is not None:
        out["ss_base_model_version"] = base_model_version
    out.update(spec or {})
    if "rangefinder.updates" in meta:
        out["ss_steps"] = meta["rangefinder.updates"]
    return out | dict(trainer or {})


def kohya_base_model(meta: Mapping[str, str]) -> dict[str, str]:
    """The base model as sd-scripts names it in a LoRA's metadata (train_network.py at 48d368f, lines 1206-1213),
    from the run's `rangefinder.base_model` and `rangefinder.base_model_revision`: `ss_sd_model_name`, a path's last
    component or a hub id as given; and for a single file, `ss_new_sd_model_hash` (the whole file's sha256, as its
    `calculate_sha256`, library/train_util.py lines 3240-3256: the revision the run resolved, so the file is not read
    again) and `ss_sd_model_hash` (`legacy_model_hash`, where the file can still be read). sd-scripts writes the
    hashes of any path that exists, and of a folder they come out as the words "IsADirectory" (its open() of a
    folder fails), which name no model: a folder gets its name only, as a hub id does; the embedded tiny model none.

    A1111 reads only the name: its LoRA tab shows `ss_sd_model_name` as "Model:"
    (extensions-builtin/Lora/ui_edit_user_metadata.py, `get_metadata_table`) and puts it first among the file's
    metadata (network.py, `metadata_tags_order`); it reads neither hash. Metadata viewers that look a LoRA's base
    model up on Civitai by hash take `ss_new_sd_model_hash`, else `ss_sd_model_hash`."""
    base = meta.get("rangefinder.base_model")
    revision = meta.get("rangefinder.base_model_revision") or ""
    if not base or names_embedded_model(base):
        return {}
    if revision.startswith(FILE_REVISION_PREFIX):  # a single file (models/loading.py _resolve_single_file)
        out = {"ss_sd_model_name": Path(base).name, "ss_new_sd_model_hash": revision.removeprefix(FILE_REVISION_PREFIX)}
        legacy = legacy_model_hash(base_model_path(base))
        return out if legacy is None else {**out, "ss_sd_model_hash": legacy}
    # A folder, `~/...` as the run spelt it expanded (a file without the revision: an older release's, or one
    # written outside a run), where unexpanded it was named by its whole spelling, as a hub id is.
    path = base_model_path(base)
    if revision.startswith(FOLDER_REVISION_PREFIX) or path.is_absolute() or path.exists():
        return {"ss_sd_model_name": path.name}
    return {"ss_sd_model_name": base.partition("@")[0]}  # a hub id, "org/name@revision" as the run names it


def legacy_model_hash(path: Path) -> Optional[str]:
    """A1111's old short hash of a checkpoint file (LEGACY_HASH_OFFSET): one 64 KiB read; None when the file cannot
    be read here (a step that does not see the volume the run's file is on)."""
    import hashlib

    try:
        with open(path, "rb") as f:
            f.seek(LEGACY_HASH_OFFSET)
            return hashlib.sha256(f.read(LEGACY_HASH_LENGTH)).hexdigest()[:8]
    except OSError:
        return None


def lora_specs(architecture: Optional[str], kohya_implementation: str, facts: Optional[SpecFacts],
               prediction_type: Optional[str]) -> tuple[dict[str, str], dict[str, str]]:
    """(the diffusers-named file's model spec, the kohya file's): a LoRA on the base model `architecture`, the first
    in diffusers' module names, the second in those of `kohya_implementation`; neither without an architecture."""
    if architecture is None:
        return {}, {}
    return (model_spec(architecture, MODELSPEC_IMPL_DIFFUSERS, facts, prediction_type, ADAPTER_LORA),
            model_spec(architecture, kohya_implementation, facts, prediction_type, ADAPTER_LORA))


def save_lora_files(out_dir: Path, unet=None, text_encoder=None, metadata: Optional[Mapping[str, str]] = None,
                    text_encoder_2=None, sdxl: bool = False, flux: bool = False,
                    prediction_type: Optional[str] = None, facts: Optional[SpecFacts] = None,
                    trainer_metadata: Optional[Mapping[str, str]] = None):
    """Both LoRA files into `out_dir`; returns {"diffusers": path, "kohya": path}. `sdxl`: kohya's SDXL names;
    `flux`: `unet` is Flux's transformer, in Flux's names (lora_to_diffusers_flux, lora_to_kohya_flux).
    `prediction_type`: what the UNet's base model predicts ("epsilon" | "v_prediction"; as trained), which with its
    config names an SD 1.x/2.x base model; without it (or without the UNet) an SD 1.x/2.x LoRA claims none. Both
    files carry the model spec of a LoRA on their base model, with the run's `facts`. `trainer_metadata`:
    sd-scripts' `ss_*` keys of the training objective (family_rules' kohya_training_metadata), for the kohya file."""
    out_dir = Path(out_dir)
    unet_layers = trained_lora_layers(unet) if unet is not None else {}
    te_layers = trained_lora_layers(text_encoder) if text_encoder is not None else {}
    te2_layers = trained_lora_layers(text_encoder_2) if text_encoder_2 is not None else {}
    if not unet_layers and not te_layers and not te2_layers:
        raise ValueError("no LoRA adapters found on the UNet or the text encoder; nothing to export")
    meta = dict(metadata or {})
    any_layer = next(iter({**unet_layers, **te_layers, **te2_layers}.values()))
    version: Optional[str] = None
    architecture: Optional[str] = None
    if flux:
        # sd-scripts' Flux values (flux_train_network.py: flux_utils.MODEL_VERSION_FLUX_V1; dev or schnell by
        # whether the model takes guidance, as its flux_utils.analyze_checkpoint_state tells them).
        network_module, version, architecture, implementation = ("networks.lora_flux", "flux1",
                                                                 flux_architecture(dict(unet.config)),
                                                                 MODELSPEC_IMPL_FLUX)
    elif sdxl:  # sdxl_base_v1-0: what sd-scripts writes for SDXL (A1111 tells an SDXL LoRA by its `sdxl_` prefix)
        network_module, version, architecture, implementation = ("networks.lora", "sdxl_base_v1-0", ARCH_SDXL,
                                                                 MODELSPEC_IMPL_SGM)
    else:
        # SD 1.x or 2.x by the UNet's config, v-prediction or not by what it trained (model_spec.sd_base_model);
        # sd-scripts' implementation for such a LoRA is diffusers' (`determine_implementation`), whose module paths
        # its `lora_unet_` names are. A text encoder's LoRA alone, or no prediction type: no base model is claimed.
        network_module, implementation = "networks.lora", MODELSPEC_IMPL_DIFFUSERS
        if unet is not None and prediction_type is not None:
            version, architecture = sd_base_model(unet.config, prediction_type)
        if unet is not None:
            # sd-scripts' --v2 as it writes it (train_network.py), which A1111 tells an SD 2.x LoRA by: without it
            # the LoRA counts as SD 1.x's (extensions-builtin/Lora/network.py `detect_version`), and its Lora tab
            # hides it under an SD 2.x checkpoint (ui_extra_networks_lora.py `create_item`, lora_show_all off).
            trainer_metadata = {"ss_v2": str(is_sd2(unet.config)), **(trainer_metadata or {})}
    diffusers_spec, kohya_spec = lora_specs(architecture, implementation, facts, prediction_type)
    kohya_meta = kohya_metadata(meta, any_layer, network_module, version, kohya_spec, trainer_metadata)
    if flux:
        return {
            "diffusers": save_safetensors(lora_to_diffusers_flux(unet_layers, te_layers), out_dir / LORA_WEIGHTS_NAME,
                                          {**meta, **diffusers_spec}),
            "kohya": save_safetensors(lora_to_kohya_flux(unet_layers, te_layers, dict(unet.config)),
                                      out_dir / LORA_KOHYA_NAME, kohya_meta),
        }
    return {
        "diffusers": save_safetensors(lora_to_diffusers(unet_layers, te_layers, te2_layers),
                                      out_dir / LORA_WEIGHTS_NAME, {**meta, **diffusers_spec}),
        "kohya": save_safetensors(
            lora_to_kohya(unet_layers, te_layers, te2_layers, dict(unet.config) if sdxl and unet is not None else None),
            out_dir / LORA_KOHYA_NAME, kohya_meta),
    }


def sd3_lora_to_diffusers(transformer_layers: Mapping[str, LoraWeights],
                          text_encoder_layers: Mapping[str, LoraWeights],
                          text_encoder_2_layers: Mapping[str, LoraWeights]) -> dict:
    """SD3's diffusers-named LoRA (what diffusers' SD3LoraLoaderMixin.load_lora_weights reads, and
    train_dreambooth_lora_sd3.py saves): peft names under `transformer.`, `text_encoder.` and `text_encoder_2.`,
    alpha/rank folded into lora_B (so it loads at scale 1 without a peft config)."""
    out = {}
    for prefix, layers in (("transformer.", transformer_layers), ("text_encoder.", text_encoder_layers),
                           ("text_encoder_2.", text_encoder_2_layers)):
        for path, w in layers.items():
            name = prefix + (path if prefix == "transformer." else clip_text_key(path))
            out[f"{name}.lora_A.weight"] = w.down
            out[f"{name}.lora_B.weight"] = (w.up.float() * w.scale).to(w.up.dtype)
    return out


def sd3_lora_to_kohya(transformer_layers: Mapping[str, LoraWeights], text_encoder_layers: Mapping[str, LoraWeights],
                      text_encoder_2_layers: Mapping[str, LoraWeights], transformer_config: Mapping[str, Any]) -> dict:
    """kohya's sd-scripts SD3 layout (networks/lora_sd3.py: `lora_unet_` + the module path in its own MMDiT,
    library/sd3_models.py; `lora_te1_`/`lora_te2_` for CLIP-L/G), which ComfyUI's key map also reads (every
    `diffusion_model.` weight as `lora_unet_<path>`). The original fuses q, k and v into one `attn.qkv` module: the
    adapters of to_q, to_k and to_v (or add_q/k/v_proj) become one LoRA on it whose down is theirs stacked (rank
    3r) and whose up places each one's rows in its third, zeros elsewhere, so up @ down is exactly the three deltas
    stacked (the layout sd-scripts' own split_qkv option merges to). `.alpha` = scale x the module's rank. An adaLN
    whose halves the original orders the other way round (single_file_sd3.swaps_halves) has its `up` swapped too."""
    import torch

    from rangefinder.formats.single_file_sd3 import mmdit_module_name, swap_halves, swaps_halves

    out: dict = {}
    fused: dict[str, dict[int, LoraWeights]] = {}
    for path, w in transformer_layers.items():
        name, third = mmdit_module_name(path)
        if third is None:
            up = swap_halves(w.up) if swaps_halves(path, transformer_config) else w.up
            out.update(_kohya_module("lora_unet_" + name.replace(".", "_"), w.down, up, w.scale))
        else:
            fused.setdefault(name, {})[third] = w
    for name, parts in fused.items():
        ws = [parts[i] for i in sorted(parts)]
        if len({w.scale for w in ws}) != 1 or len({w.rank for w in ws}) != 1:
            raise ValueError(f"the q, k and v adapters of {name} differ in rank or alpha; they cannot be fused")
        out_rows, rank = ws[0].up.shape[0], ws[0].rank
        down = torch.cat([w.down for w in ws], dim=0)
        up = torch.zeros((3 * out_rows, rank * len(ws)), dtype=ws[0].up.dtype, device=ws[0].up.device)
        for j, third in enumerate(sorted(parts)):
            up[third * out_rows:(third + 1) * out_rows, j * rank:(j + 1) * rank] = parts[third].up
        out.update(_kohya_module("lora_unet_" + name.replace(".", "_"), down, up, ws[0].scale))
    for prefix, layers in (("lora_te1_", text_encoder_layers), ("lora_te2_", text_encoder_2_layers)):
        for path, w in layers.items():
            out.update(_kohya_module(prefix + clip_text_key(path).replace(".", "_"), w.down, w.up, w.scale))
    return out


def _kohya_module(name: str, down, up, scale: float) -> dict:
    import torch

    return {f"{name}.lora_down.weight": down, f"{name}.lora_up.weight": up,
            f"{name}.alpha": torch.tensor(scale * down.shape[0], dtype=torch.float32)}


# One signature per family's LoRA export, (out_dir, denoiser, text_encoder, text_encoder_2, metadata,
# prediction_type, facts, trainer_metadata), which training/family_detection.py's FamilyLayout.lora_export names.
# SD 1.x/2.x's base model is named by the prediction type too; SDXL's is one whatever it predicts (sd-scripts names it
# sdxl_base_v1-0 either way), which its model spec's prediction_type says; the flow families predict no epsilon or v.
def save_sd_lora_files(out_dir: Path, unet, text_encoder=None, text_encoder_2=None,
                       metadata: Optional[Mapping[str, str]] = None, prediction_type: Optional[str] = None,
                       facts: Optional[SpecFacts] = None,
                       trainer_metadata: Optional[Mapping[str, str]] = None) -> dict[str, Path]:
    return save_lora_files(out_dir, unet, text_encoder, metadata, prediction_type=prediction_type, facts=facts,
                           trainer_metadata=trainer_metadata)


def save_sdxl_lora_files(out_dir: Path, unet, text_encoder=None, text_encoder_2=None,
                         metadata: Optional[Mapping[str, str]] = None, prediction_type: Optional[str] = None,
                         facts: Optional[SpecFacts] = None,
                         trainer_metadata: Optional[Mapping[str, str]] = None) -> dict[str, Path]:
    return save_lora_files(out_dir, unet, text_encoder, metadata, text_encoder_2=text_encoder_2, sdxl=True,
                           prediction_type=prediction_type, facts=facts, trainer_metadata=trainer_metadata)


def save_flux_lora_files(out_dir: Path, transformer, text_encoder=None, text_encoder_2=None,
                         metadata: Optional[Mapping[str, str]] = None, prediction_type: Optional[str] = None,
                         facts: Optional[SpecFacts] = None,
                         trainer_metadata: Optional[Mapping[str, str]] = None) -> dict[str, Path]:
    return save_lora_files(out_dir, transformer, text_encoder, metadata, text_encoder_2=text_encoder_2, flux=True,
                           facts=facts, trainer_metadata=trainer_metadata)


def save_sd3_lora_files(out_dir: Path, transformer, text_encoder=None, text_encoder_2=None,
                        metadata: Optional[Mapping[str, str]] = None, prediction_type: Optional[str] = None,
                        facts: Optional[SpecFacts] = None,
                        trainer_metadata: Optional[Mapping[str, str]] = None) -> dict[str, Path]:
    """SD3's LoRA in diffusers' naming and in kohya's (`lora_kohya.safetensors`); returns {"diffusers": path,
    "kohya": path}."""
    layers = trained_lora_layers(transformer)
    te = trained_lora_layers(text_encoder) if text_encoder is not None else {}
    te2 = trained_lora_layers(text_encoder_2) if text_encoder_2 is not None else {}
    if not layers and not te and not te2:
        raise ValueError("no LoRA adapters found on the transformer or the text encoders; nothing to export")
    meta = dict(metadata or {})
    # The kohya file's module names are the original MMDiT's, which sd-scripts and ComfyUI both call Stability's
    # (the implementation of an SD3 checkpoint they save, in the same names: sd3_train_utils.py, nodes_model_merging.py
    # "sgm"); sd-scripts' own "diffusers" for its SD3 LoRA (`determine_implementation`) names no codebase of them.
    diffusers_spec, kohya_spec = lora_specs(sd3_architecture(transformer.config), MODELSPEC_IMPL_SGM, facts, None)
    kohya_meta = kohya_metadata(meta, next(iter({**layers, **te, **te2}.values())), "networks.lora_sd3",
                                sd3_model_type(transformer.config), kohya_spec, trainer_metadata)
    return {"diffusers": save_safetensors(sd3_lora_to_diffusers(layers, te, te2), Path(out_dir) / LORA_WEIGHTS_NAME,
                                          {**meta, **diffusers_spec}),
            "kohya": save_safetensors(sd3_lora_to_kohya(layers, te, te2, transformer.config),
                                      Path(out_dir) / LORA_KOHYA_NAME,
                                      kohya_meta)}
