"""The loading rules of consumers that cannot be installed here (ComfyUI, AUTOMATIC1111), re-expressed from their
source so tests can hold our files to them. Each rule cites the file and commit it was read from; none of their
code is copied.

ComfyUI: comfy/lora.py (`model_lora_keys_unet`, `model_lora_keys_clip`, `load_lora`) at 41444b5236c6 and its later
form that hands the tensors to comfy/weight_adapter (same SD 1.x key map), and comfy/weight_adapter/lora.py
(`LoRAAdapter.load`, `calculate_weight`) at 6fd406fb14ca.
A1111: modules/safe.py (`check_zip_filenames`, `RestrictedUnpickler`, `check_pt`) at 05933840f067, and
modules/textual_inversion/textual_inversion.py (`EmbeddingDatabase.load_from_file`) at 22ecb78b51f7.
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

from rangefinder.formats.export import _map_keys, _top_level_tables, _unet_prefix_table, clip_text_key

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
    unet_top, _ = _top_level_tables()
    return {d: ldm for ldm, d in _map_keys(names, _unet_prefix_table(unet.config), unet_top, "UNet").items()}


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
