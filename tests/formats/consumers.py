"""The loading rules of consumers that cannot be installed here (ComfyUI, AUTOMATIC1111), re-expressed from their
source so tests can hold our files to them. Each rule cites the file and commit it was read from; none of their
code is copied.

ComfyUI's checkpoint loader: comfy/supported_models.py (`SDXL.model_type`) and supported_models_base.py
(`BASE.model_type`).

ComfyUI: comfy/lora.py (`model_lora_keys_unet`, `model_lora_keys_clip`, `load_lora`) at 41444b5236c6 and its later
form that hands the tensors to comfy/weight_adapter (same SD 1.x key map), and comfy/weight_adapter/lora.py
(`LoRAAdapter.load`, `calculate_weight`) at 6fd406fb14ca.
A1111: modules/safe.py (`check_zip_filenames`, `RestrictedUnpickler`, `check_pt`) at 05933840f067,
modules/textual_inversion/textual_inversion.py (`EmbeddingDatabase.load_from_file`) at 22ecb78b51f7, and its LoRA
loader: extensions-builtin/Lora/networks.py (`convert_diffusers_name_to_compvis`,
`assign_network_names_to_compvis_modules`, `load_network`) at 873edba44bed (the same SD 1.x rules in later versions,
which add `norm1`/`norm2` to the resnet renames), network.py (`NetworkModule`: `alpha`, `calc_scale`) at
f2844bd024ff and network_lora.py (`ModuleTypeLora`, `NetworkModuleLora.create_module`/`calc_updown`) at
ea903819cb7e.
"""

from __future__ import annotations

import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rangefinder.formats.diffusers_folder import clip_text_key
from rangefinder.formats.single_file import map_keys, top_level_tables, unet_prefix_table

# ---------------------------------------------------------------------------------------------------------------
# ComfyUI: what a whole checkpoint's UNet predicts


def comfy_model_type(state: Mapping[str, Any], sdxl: bool) -> str:
    """The ModelType ComfyUI's checkpoint loader gives a single file's UNet: comfy/supported_models.py `SDXL.model_type`
    (at 005e37025 and later) reads an SDXL file's `v_pred` tensor as V_PREDICTION; SD15 has no model_type of its own,
    so supported_models_base.py `BASE.model_type` (at 01e93c7b7f) gives an SD 1.x file EPS whatever it holds (SD 2.x's
    is a guess from its weights, not read here)."""
    return "V_PREDICTION" if sdxl and "v_pred" in state else "EPS"


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI: which LoRA tensor names patch which model weight, for an SD 1.x model

# comfy/lora.py LORA_CLIP_MAP: the CLIP sub-modules a LoRA may patch, and kohya's spelling of each.
COMFY_CLIP_MODULES = {
    "mlp.fc1": "mlp_fc1",
    "mlp.fc2": "mlp_fc2",
    "self_attn.k_proj": "self_attn_k_proj",
    "self_attn.q_proj": "self_attn_q_proj",
    "self_attn.v_proj": "self_attn_v_proj",
    "self_attn.out_proj": "self_attn_out_proj",
}
# comfy/weight_adapter/lora.py LoRAAdapter.load: the (up, down) suffix pairs it tries after a module name, in order.
COMFY_UP_DOWN = (
    (".lora_up.weight", ".lora_down.weight"),  # kohya
    ("_lora.up.weight", "_lora.down.weight"),  # diffusers' attention processors
    (".lora_B.weight", ".lora_A.weight"),  # peft
    (".lora.up.weight", ".lora.down.weight"),
    (".lora_B", ".lora_A"),  # mochi
    (".lora_linear_layer.up.weight", ".lora_linear_layer.down.weight"),  # transformers
    (".lora_B.default.weight", ".lora_A.default.weight"),  # qwen
)
# Per-module tensors `load_lora` takes besides the pair (the LoRA ones; loha/lokr/glora names cannot occur here).
COMFY_EXTRAS = (".alpha", ".dora_scale", ".reshape_weight", ".lora_mid.weight")


def _diffusers_to_ldm_unet_keys(unet) -> dict[str, str]:
    """{diffusers UNet key: LDM key}. Stands in for ComfyUI's comfy.utils.unet_to_diffusers (the same
    correspondence, for every weight of an SD 1.x UNet); tests/formats/test_export.py checks these tables against
    diffusers' own converters."""
    names = {k: k for k in unet.state_dict()}
    unet_top, _ = top_level_tables()
    return {d: ldm for ldm, d in map_keys(names, unet_prefix_table(unet.config), unet_top, "UNet").items()}


def comfy_sd1_key_map(unet, text_encoder) -> dict[str, tuple[str, str]]:
    """{LoRA module name: (part, weight key in our diffusers/transformers module)}, the names comfy/lora.py
    `model_lora_keys_unet` and `model_lora_keys_clip` give an SD 1.x model (CLIP-L only)."""
    key_map: dict[str, tuple[str, str]] = {}
    for d_key, ldm_key in _diffusers_to_ldm_unet_keys(unet).items():
        # ComfyUI's UNet is the LDM one under `diffusion_model.`.
        if ldm_key.endswith(".weight"):
            base = ldm_key[: -len(".weight")]
            key_map["lora_unet_" + base.replace(".", "_")] = ("unet", d_key)
            key_map["lora_prior_unet_" + base.replace(".", "_")] = ("unet", d_key)
            key_map["diffusion_model." + base] = ("unet", d_key)  # "generic" names
        else:
            key_map["diffusion_model." + ldm_key] = ("unet", d_key)
        if d_key.endswith(".weight"):
            # The diffusers names it knows, from unet_to_diffusers: kohya-on-diffusers, lycoris, attention processors.
            base = d_key[: -len(".weight")]
            key_map["lora_unet_" + base.replace(".", "_")] = ("unet", d_key)
            key_map["lycoris_" + base.replace(".", "_")] = ("unet", d_key)
            for prefix in ("", "unet."):
                name = prefix + base.replace(".to_", ".processor.to_")
                if name.endswith(".to_out.0"):
                    name = name[: -len(".0")]
                key_map[name] = ("unet", d_key)

    key_map.update(comfy_clip_l_key_map(text_encoder))
    return key_map


def comfy_clip_l_key_map(text_encoder) -> dict[str, tuple[str, str]]:
    """The CLIP-L names of model_lora_keys_clip (SD 1.x's encoder, and Flux's CLIP-L, are `clip_l` there)."""
    key_map: dict[str, tuple[str, str]] = {}
    # ComfyUI's SD 1.x CLIP holds the transformers model under `clip_l.transformer.`, in the `text_model.` layout.
    clip_keys = {"clip_l.transformer." + clip_text_key(k): k for k in text_encoder.state_dict()}
    for comfy_key, hf_key in clip_keys.items():
        if comfy_key.endswith(".weight"):
            key_map["text_encoders." + comfy_key[: -len(".weight")]] = ("text_encoder", hf_key)
    for b in range(32):
        for module, kohya_module in COMFY_CLIP_MODULES.items():
            comfy_key = f"clip_l.transformer.text_model.encoder.layers.{b}.{module}.weight"
            if comfy_key in clip_keys:
                target = ("text_encoder", clip_keys[comfy_key])
                key_map[f"lora_te_text_model_encoder_layers_{b}_{kohya_module}"] = target
                key_map[f"lora_te1_text_model_encoder_layers_{b}_{kohya_module}"] = target
                key_map[f"text_encoder.text_model.encoder.layers.{b}.{module}"] = target
    return key_map


@dataclass
class ComfyPatch:
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None

    @property
    def scale(self) -> float:
        # calculate_weight: alpha / rank (rank = down's first dimension) when the file has an alpha, else 1.
        return 1.0 if self.alpha is None else self.alpha / self.down.shape[0]


def comfy_load_lora(lora: Mapping[str, torch.Tensor], key_map) -> tuple[dict[tuple[str, str], ComfyPatch], set]:
    """(patches by target weight, file keys not loaded): what comfy/lora.py `load_lora` makes of a LoRA file. Every
    key left over is a "lora key not loaded" line in ComfyUI's console, and that tensor is not applied."""
    patches: dict[tuple[str, str], ComfyPatch] = {}
    loaded: set[str] = set()
    for name, target in key_map.items():
        alpha = None
        for extra in COMFY_EXTRAS:
            if name + extra in lora:
                loaded.add(name + extra)
                if extra == ".alpha":
                    alpha = float(lora[name + extra].item())
        for up, down in COMFY_UP_DOWN:
            if name + up in lora:
                patches[target] = ComfyPatch(lora[name + up], lora[name + down], alpha)
                loaded.update((name + up, name + down))
                break
    return patches, set(lora) - loaded


def comfy_patched_state(state: Mapping[str, torch.Tensor], patches, part: str) -> dict[str, torch.Tensor]:
    """`state` with each patch of `part` applied as calculate_weight does at strength 1: W + scale * up @ down."""
    out = dict(state)
    for (p, key), patch in patches.items():
        if p != part:
            continue
        w = out[key]
        diff = patch.up.flatten(start_dim=1).float() @ patch.down.flatten(start_dim=1).float()
        out[key] = (w.float() + patch.scale * diff.reshape(w.shape)).to(w.dtype)
    return out


# ---------------------------------------------------------------------------------------------------------------
# A1111: what its safe loader lets through, and how it reads an embedding

# modules/safe.py: the zip entries it accepts, `<dir>/data.pkl`, `<dir>/version`, `<dir>/data/<n>`.
A1111_ZIP_ENTRY = re.compile(r"^[^/]+/(data/\d+|version|data\.pkl)$")
# modules/safe.py RestrictedUnpickler.find_class: the only globals a pickle may name (the pytorch_lightning entries,
# for old full checkpoints, left out).
A1111_ALLOWED_GLOBALS = {
    ("collections", "OrderedDict"),
    ("torch._utils", "_rebuild_tensor_v2"),
    ("torch._utils", "_rebuild_parameter"),
    ("torch._utils", "_rebuild_device_tensor_from_numpy"),
    *(("torch", n) for n in ("FloatStorage", "HalfStorage", "IntStorage", "LongStorage", "DoubleStorage",
                             "ByteStorage", "float32", "BFloat16Storage")),
    ("torch.nn.modules.container", "ParameterDict"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy", "dtype"),
    ("numpy", "ndarray"),
    ("_codecs", "encode"),
    ("__builtin__", "set"),
}


class A1111Rejected(Exception):
    """What A1111 reports as "The file may be malicious, so the program is not going to read it"."""


class _A1111Unpickler(pickle.Unpickler):
    def persistent_load(self, saved_id):
        if saved_id[0] != "storage":
            raise A1111Rejected(f"persistent id {saved_id[0]!r}")
        return torch.storage.TypedStorage(_internal=True)  # an empty storage, as safe.py gives it

    def find_class(self, module, name):
        if (module, name) not in A1111_ALLOWED_GLOBALS:
            raise A1111Rejected(f"global '{module}/{name}' is forbidden")
        return super().find_class(module, name)


def a1111_safe_check(path: Path) -> None:
    """Raise A1111Rejected where modules/safe.py `check_pt` would refuse `path`."""
    try:
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            bad = [n for n in names if not A1111_ZIP_ENTRY.match(n)]
            if bad:
                raise A1111Rejected(f"bad file inside {path}: {bad[0]}")
            pkls = [n for n in names if re.match(r"^[^/]+/data\.pkl$", n)]
            if len(pkls) != 1:
                raise A1111Rejected(f"{len(pkls)} data.pkl in {path}")
            with z.open(pkls[0]) as f:
                _A1111Unpickler(f).load()
    except zipfile.BadZipFile:
        # Not a zip: torch's legacy format, five pickles in a row (magic, protocol, sys info, object, storage keys).
        with open(path, "rb") as f:
            for _ in range(5):
                _A1111Unpickler(f).load()


def a1111_load_embedding(path: Path) -> dict[str, Any]:
    """What A1111's EmbeddingDatabase.load_from_file makes of an embedding file: its name (the file's stem), the
    vectors, step and checkpoint name. Raises A1111Rejected for a .pt its safe loader refuses."""
    path = Path(path)
    ext = path.suffix.upper()
    if ext in (".PT", ".BIN"):
        a1111_safe_check(path)
        data = torch.load(path, map_location="cpu", weights_only=True)
    elif ext == ".SAFETENSORS":
        from safetensors.torch import load_file

        data = load_file(str(path))
    else:
        raise ValueError(f"A1111 does not read {path.suffix} embeddings")
    if "string_to_param" in data:
        params = data["string_to_param"]
        if len(params) != 1:
            raise ValueError("embedding file has multiple terms in it")
        vec = next(iter(params.values()))
    elif len(data) == 1 and isinstance(next(iter(data.values())), torch.Tensor):  # a single-tensor file
        vec = next(iter(data.values()))
        vec = vec.unsqueeze(0) if vec.ndim == 1 else vec
    else:
        raise ValueError(f"Couldn't identify {path.name} as neither textual inversion embedding nor diffuser concept.")
    return {
        "name": path.stem,
        "vec": vec.float(),
        "step": data.get("step"),
        "sd_checkpoint_name": data.get("sd_checkpoint_name"),
    }


# ---------------------------------------------------------------------------------------------------------------
# A1111: which LoRA tensor names patch which module of an SD 1.x model (its original LDM backend)

# networks.py suffix_conversion: diffusers' resnet layer names -> LDM's, '_'-joined.
A1111_RESNET_SUFFIXES = {
    "conv1": "in_layers_2",
    "conv2": "out_layers_3",
    "norm1": "in_layers_0",
    "norm2": "out_layers_0",
    "time_emb_proj": "emb_layers_1",
    "conv_shortcut": "skip_connection",
}
# networks.py convert_diffusers_name_to_compvis, the SD 1.x rules (is_sd2 False). The block arithmetic is SD 1.x's
# UNet (two layers per level, four levels), written into A1111's rules: only an SD 1.x-shaped model can be checked.
_A1111_RULES: list[tuple[re.Pattern, Any]] = [
    (re.compile(r"lora_unet_conv_in(.*)"), lambda m: f"diffusion_model_input_blocks_0_0{m[0]}"),
    (re.compile(r"lora_unet_conv_out(.*)"), lambda m: f"diffusion_model_out_2{m[0]}"),
    (re.compile(r"lora_unet_time_embedding_linear_(\d+)(.*)"),
     lambda m: f"diffusion_model_time_embed_{m[0] * 2 - 2}{m[1]}"),
    (re.compile(r"lora_unet_down_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)"),
     lambda m: f"diffusion_model_input_blocks_{1 + m[0] * 3 + m[2]}_{1 if m[1] == 'attentions' else 0}_"
               f"{_a1111_suffix(m[1], m[3])}"),
    (re.compile(r"lora_unet_mid_block_(attentions|resnets)_(\d+)_(.+)"),
     lambda m: f"diffusion_model_middle_block_{1 if m[0] == 'attentions' else m[1] * 2}_{_a1111_suffix(m[0], m[2])}"),
    (re.compile(r"lora_unet_up_blocks_(\d+)_(attentions|resnets)_(\d+)_(.+)"),
     lambda m: f"diffusion_model_output_blocks_{m[0] * 3 + m[2]}_{1 if m[1] == 'attentions' else 0}_"
               f"{_a1111_suffix(m[1], m[3])}"),
    (re.compile(r"lora_unet_down_blocks_(\d+)_downsamplers_0_conv"),
     lambda m: f"diffusion_model_input_blocks_{3 + m[0] * 3}_0_op"),
    (re.compile(r"lora_unet_up_blocks_(\d+)_upsamplers_0_conv"),
     lambda m: f"diffusion_model_output_blocks_{2 + m[0] * 3}_{2 if m[0] > 0 else 1}_conv"),
    (re.compile(r"lora_te_text_model_encoder_layers_(\d+)_(.+)"),
     lambda m: f"transformer_text_model_encoder_layers_{m[0]}_{m[1]}"),
]


def _a1111_suffix(kind: str, name: str) -> str:
    return A1111_RESNET_SUFFIXES.get(name, name) if kind == "resnets" else name


def a1111_compvis_name(key: str) -> str:
    """convert_diffusers_name_to_compvis: a kohya module name -> the '_'-joined LDM module name A1111 looks up."""
    for pattern, build in _A1111_RULES:
        r = pattern.match(key)
        if r:
            return build([int(g) if re.match(r"\d+", g) else g for g in r.groups()])
    return key


def a1111_sd1_modules(unet, text_encoder) -> dict[str, tuple[str, str, torch.nn.Module]]:
    """assign_network_names_to_compvis_modules for SD 1.x: {'_'-joined LDM module name: (part, module path in our
    diffusers/transformers model, the module)}. A1111's UNet is LDM's, under `diffusion_model.`; its text encoder is
    `cond_stage_model.wrapped`, whose `transformer` is a transformers CLIPTextModel (4.x: `text_model.` layout)."""
    modules: dict[str, tuple[str, str, torch.nn.Module]] = {}
    for d_key, ldm_key in _diffusers_to_ldm_unet_keys(unet).items():
        if d_key.endswith(".weight"):
            path = d_key[: -len(".weight")]
            name = "diffusion_model_" + ldm_key[: -len(".weight")].replace(".", "_")
            modules[name] = ("unet", path, unet.get_submodule(path))
    for path, module in text_encoder.named_modules():
        if path:
            modules["transformer_" + clip_text_key(path).replace(".", "_")] = ("text_encoder", path, module)
    return modules


def a1111_load_lora(lora: Mapping[str, torch.Tensor], modules) -> tuple[dict[tuple[str, str], ComfyPatch], set]:
    """(patches by target weight, file keys not matched): what networks.py `load_network` and network_lora.py make of
    a LoRA file. A key left over is one A1111 lists as "Failed to match keys" (or drops as a part no LoRA module
    reads) and does not apply. Raises AssertionError where A1111 would (a module without up and down, a module type
    LoRA cannot patch, weights that do not fit the module)."""
    matched: dict[str, dict[str, torch.Tensor]] = {}
    failed: set[str] = set()
    for key, weight in lora.items():
        base, _, part = key.partition(".")
        name = a1111_compvis_name(base)
        found = modules.get(name)
        if found is None and "lora_unet" in base:  # LDM names under lora_unet_ (SDXL files)
            name = base.replace("lora_unet", "diffusion_model")
            found = modules.get(name)
        elif found is None and "lora_te1_text_model" in base:
            name = base.replace("lora_te1_text_model", "transformer_text_model")
            found = modules.get(name)
        if found is None:
            failed.add(key)
            continue
        matched.setdefault(name, {})[part] = weight
    patches: dict[tuple[str, str], ComfyPatch] = {}
    for name, w in matched.items():
        part, path, module = modules[name]
        if "lora_A.weight" in w and "lora_B.weight" in w:  # ModuleTypeLora renames peft's pair
            w["lora_up.weight"], w["lora_down.weight"] = w.pop("lora_B.weight"), w.pop("lora_A.weight")
        if not ("lora_up.weight" in w and "lora_down.weight" in w):
            raise AssertionError(f"Could not find a module type that would accept those keys: {', '.join(w)}")
        failed.update(f"{name}.{k}" for k in w if k not in ("lora_up.weight", "lora_down.weight", "alpha"))
        up, down = w["lora_up.weight"], w["lora_down.weight"]
        if type(module) is torch.nn.Linear:  # create_module: both reshaped to 2-D linear layers
            fits = (down.reshape(down.shape[0], -1).shape[1] == module.in_features
                    and up.reshape(up.shape[0], -1).shape == (module.out_features, down.shape[0]))
        elif type(module) is torch.nn.Conv2d:  # down: the module's kernel (or 1x1); up: 1x1
            kernel = tuple(down.shape[2:]) if down.ndim == 4 else (1, 1)
            fits = (down.shape[1] == module.in_channels and kernel in ((1, 1), tuple(module.kernel_size))
                    and up.shape[0] == module.out_channels and up.reshape(up.shape[0], -1).shape[1] == down.shape[0])
        else:
            raise AssertionError(f"Lora layer {name} matched a layer with unsupported type: {type(module).__name__}")
        if not fits:
            raise AssertionError(f"Lora layer {name}: up {tuple(up.shape)} / down {tuple(down.shape)} do not fit "
                                 f"{type(module).__name__} weight {tuple(module.weight.shape)}")
        # NetworkModule.calc_scale: alpha / dim, dim = down's first dimension; 1 without alpha (as ComfyPatch.scale).
        alpha = float(w["alpha"].item()) if "alpha" in w else None
        patches[(part, f"{path}.weight")] = ComfyPatch(up, down, alpha)
    return patches, failed


def lora_delta(patch: ComfyPatch, weight_shape) -> torch.Tensor:
    """What a loader adds to a weight at strength 1: scale * up @ down, in the weight's shape (lyco_helpers
    rebuild_conventional in A1111, calculate_weight in ComfyUI)."""
    diff = patch.up.flatten(start_dim=1).float() @ patch.down.flatten(start_dim=1).float()
    return patch.scale * diff.reshape(weight_shape)


# ---------------------------------------------------------------------------------------------------------------
# ComfyUI: Flux.1. Its Flux model is Black Forest Labs' own (comfy/ldm/flux), loaded from BFL's layout; a LoRA names
# its modules either by that layout (`lora_unet_` + the path, or `diffusion_model.` + the path: the generic names
# comfy/lora.py `model_lora_keys_unet` gives every key of the model at 41444b5236c6), or by diffusers' module names
# under `transformer.` / `lora_transformer_` / `lycoris_` (same function, its `comfy.model_base.Flux` branch), which
# comfy/utils.py `flux_to_diffusers` (the version that lora.py calls) maps onto the BFL weight, or onto a slice of a
# fused one. That table is re-expressed below, for a config of `depth` double blocks, `depth_single_blocks` single
# blocks and `hidden_size` (ComfyUI reads all three from the file).

def comfy_flux_to_diffusers(depth: int, depth_single: int, hidden: int) -> dict[str, tuple[str, Any, bool]]:
    """{diffusers weight key: (BFL weight key, (dim, start, size) or None, halves swapped)}: flux_to_diffusers."""
    out: dict[str, tuple[str, Any, bool]] = {}
    for i in range(depth):
        d, b = f"transformer_blocks.{i}.", f"double_blocks.{i}."
        for end in ("weight", "bias"):
            for j, p in enumerate("qkv"):
                out[f"{d}attn.to_{p}.{end}"] = (f"{b}img_attn.qkv.{end}", (0, j * hidden, hidden), False)
                out[f"{d}attn.add_{p}_proj.{end}"] = (f"{b}txt_attn.qkv.{end}", (0, j * hidden, hidden), False)
            for src, dst in (("attn.to_out.0", "img_attn.proj"), ("norm1.linear", "img_mod.lin"),
                             ("norm1_context.linear", "txt_mod.lin"), ("attn.to_add_out", "txt_attn.proj"),
                             ("ff.net.0.proj", "img_mlp.0"), ("ff.net.2", "img_mlp.2"),
                             ("ff_context.net.0.proj", "txt_mlp.0"), ("ff_context.net.2", "txt_mlp.2")):
                out[f"{d}{src}.{end}"] = (f"{b}{dst}.{end}", None, False)
        for src, dst in (("attn.norm_q", "img_attn.norm.query_norm"), ("attn.norm_k", "img_attn.norm.key_norm"),
                         ("attn.norm_added_q", "txt_attn.norm.query_norm"),
                         ("attn.norm_added_k", "txt_attn.norm.key_norm")):
            out[f"{d}{src}.weight"] = (f"{b}{dst}.scale", None, False)
    for i in range(depth_single):
        d, b = f"single_transformer_blocks.{i}.", f"single_blocks.{i}."
        for end in ("weight", "bias"):
            for j, p in enumerate("qkv"):
                out[f"{d}attn.to_{p}.{end}"] = (f"{b}linear1.{end}", (0, j * hidden, hidden), False)
            out[f"{d}proj_mlp.{end}"] = (f"{b}linear1.{end}", (0, 3 * hidden, 4 * hidden), False)
            out[f"{d}norm.linear.{end}"] = (f"{b}modulation.lin.{end}", None, False)
            out[f"{d}proj_out.{end}"] = (f"{b}linear2.{end}", None, False)
        out[f"{d}attn.norm_q.weight"] = (f"{b}norm.query_norm.scale", None, False)
        out[f"{d}attn.norm_k.weight"] = (f"{b}norm.key_norm.scale", None, False)
    for end in ("weight", "bias"):
        for src, dst in (("proj_out", "final_layer.linear"), ("x_embedder", "img_in"),
                         ("time_text_embed.timestep_embedder.linear_1", "time_in.in_layer"),
                         ("time_text_embed.timestep_embedder.linear_2", "time_in.out_layer"),
                         ("context_embedder", "txt_in"),
                         ("time_text_embed.text_embedder.linear_1", "vector_in.in_layer"),
                         ("time_text_embed.text_embedder.linear_2", "vector_in.out_layer"),
                         ("time_text_embed.guidance_embedder.linear_1", "guidance_in.in_layer"),
                         ("time_text_embed.guidance_embedder.linear_2", "guidance_in.out_layer")):
            out[f"{src}.{end}"] = (f"{dst}.{end}", None, False)
        out[f"norm_out.linear.{end}"] = (f"final_layer.adaLN_modulation.1.{end}", None, True)
    return out


def comfy_flux_config(bfl_keys, bfl_state) -> tuple[int, int, int]:
    """(depth, depth_single_blocks, hidden_size) as comfy/model_detection.py `detect_unet_config` reads a Flux file:
    the counts of `double_blocks.N.` and `single_blocks.N.`; the width of `img_in`. It knows a file as Flux by
    `double_blocks.0.img_attn.norm.key_norm.scale` (and `img_in.weight`)."""
    if "double_blocks.0.img_attn.norm.key_norm.scale" not in bfl_keys or "img_in.weight" not in bfl_keys:
        raise AssertionError("ComfyUI would not recognise this file as a Flux model")

    def count(prefix: str) -> int:
        return len({k.split(".")[1] for k in bfl_keys if k.startswith(prefix)})

    return count("double_blocks."), count("single_blocks."), int(bfl_state["img_in.weight"].shape[0])


def comfy_flux_key_map(bfl_state: Mapping[str, torch.Tensor], text_encoder) -> dict[str, tuple]:
    """{LoRA module name: target}: ("transformer", BFL weight key, slice or None) or ("text_encoder", key, None), the
    names ComfyUI gives a Flux model with CLIP-L (T5's never occur in our files)."""
    key_map: dict[str, tuple] = {}
    for k in bfl_state:
        if k.endswith(".weight"):
            base = k[: -len(".weight")]
            for name in ("lora_unet_" + base.replace(".", "_"), "lora_prior_unet_" + base.replace(".", "_"),
                         "diffusion_model." + base):
                key_map[name] = ("transformer", k, None)
    depth, single, hidden = comfy_flux_config(set(bfl_state), bfl_state)
    for d_key, (bfl_key, offset, swap) in comfy_flux_to_diffusers(depth, single, hidden).items():
        if d_key.endswith(".weight") and bfl_key in bfl_state:
            base = d_key[: -len(".weight")]
            for name in ("transformer." + base, "lycoris_" + base.replace(".", "_"),
                         "lora_transformer_" + base.replace(".", "_")):
                # The map's third element, swap_scale_shift, which calculate_weight applies to the change.
                key_map[name] = ("transformer", bfl_key, offset, *(("swap_scale_shift",) if swap else ()))
    for name, target in comfy_clip_l_key_map(text_encoder).items():
        key_map[name] = (*target, None)
    return key_map


def comfy_flux_patched(bfl_state: Mapping[str, torch.Tensor], patches) -> dict[str, torch.Tensor]:
    """The BFL weights with each transformer patch applied as calculate_weight does at strength 1: on the slice the
    key map names (`weight.narrow`), else on the whole weight, through the map's function where it names one."""
    out = {k: v.clone().float() for k, v in bfl_state.items()}
    for (part, key, offset, *function), patch in patches.items():
        if part != "transformer":
            continue
        w = out[key] if offset is None else out[key].narrow(offset[0], offset[1], offset[2])
        delta = lora_delta(patch, w.shape)
        if function:  # swap_scale_shift: the change's halves in BFL's order
            delta = torch.cat(delta.chunk(2, dim=0)[::-1], dim=0)
        w += delta
    return out
