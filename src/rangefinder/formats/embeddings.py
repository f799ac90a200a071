"""`textual_inversion`'s files: diffusers' learned_embeds and A1111's embedding files.

`learned_embeds.safetensors` (diffusers: `{token: (vectors, dim)}`) and, under `a1111/`, an embedding named after
its trigger word (A1111 names an embedding after its file) as `.safetensors` and as a `.pt` that A1111's restricted
unpickler accepts, with the update count and base model filled in. SDXL's embedding holds `clip_l` and `clip_g`.

The A1111 `.safetensors` is the file sd-scripts' textual inversion writes (train_textual_inversion.py and
sdxl_train_textual_inversion.py `save_weights`: `emb_params`, or `clip_l` and `clip_g`), and it carries the model
spec sd-scripts gives it (`train_util.get_sai_model_spec` with textual_inversion; formats/model_spec.py): the base
model's architecture + "/textual-inversion" and, for every embedding, Stability's codebase as the implementation
(sai_model_spec.py `determine_implementation`), with the run's title, resolution, date and the base model's
prediction type. `learned_embeds.safetensors` carries the same spec, in diffusers' implementation where it is
diffusers' `{token: vectors}` (SDXL's holds A1111's `clip_l`/`clip_g`). The loaders read tensors only (A1111's and
ComfyUI's embedding readers, diffusers' `load_textual_inversion`), so the header changes nothing for them.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from rangefinder.formats.atomic import atomic_path
from rangefinder.formats.model_spec import (
    ADAPTER_TEXTUAL_INVERSION,
    ARCH_SDXL,
    MODELSPEC_IMPL_DIFFUSERS,
    MODELSPEC_IMPL_SGM,
    SpecFacts,
    model_spec,
)
from rangefinder.formats.weights_file import (
    EMBEDDED_BASE_MODEL,
    FILE_REVISION_PREFIX,
    LOCAL_REVISION_PREFIXES,
    base_model_path,
    names_embedded_model,
    save_safetensors,
)

TI_WEIGHTS_NAME = "learned_embeds.safetensors"  # diffusers' default name for `load_textual_inversion`
TI_A1111_DIR = "a1111"  # `<trigger>.safetensors` and `<trigger>.pt`, for A1111's embeddings folder


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


def base_model_name(base_model: Optional[str], revision: Optional[str] = None) -> str:
    """What A1111 shows as an embedding's checkpoint: a file or folder's name, a hub id as is, the embedded tiny
    model's name without the cache folder a run on it names. A local file or folder is told by its `revision`
    (rangefinder.base_model_revision: "sha256:" for a file, "weights:" for a folder) where its path does not say
    so here: a pipeline's steps name it as model.base_model spelt it, `~/...` unexpanded or relative to another
    folder, which was written whole, as if a hub id; a checkpoint file is told by its suffix too, which no hub id
    has."""
    if not base_model or names_embedded_model(base_model):
        return EMBEDDED_BASE_MODEL
    p = base_model_path(base_model)
    if p.suffix.lower() in (".safetensors", ".ckpt"):
        return p.stem
    if p.is_absolute() or p.exists() or (revision or "").startswith(LOCAL_REVISION_PREFIXES):
        return p.name
    return base_model


def a1111_checkpoint_hash(revision: Optional[str]) -> Optional[str]:
    """A1111's short hash of the checkpoint an embedding was trained on (`sd_checkpoint`, which its training sets to
    `checkpoint.shorthash`: modules/sd_models.py CheckpointInfo, the file's sha256's first 10 hex digits), from the
    run's rangefinder.base_model_revision; None for a folder or a hub id, which A1111 has no checkpoint hash of."""
    if revision and revision.startswith(FILE_REVISION_PREFIX):
        return revision.removeprefix(FILE_REVISION_PREFIX)[:10]
    return None


def save_a1111_pt(path: Path, embeds, name: str, step: Optional[int], checkpoint_name: Optional[str],
                  checkpoint_hash: Optional[str] = None) -> Path:
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
        "sd_checkpoint": checkpoint_hash,  # A1111's short hash of the checkpoint file (a1111_checkpoint_hash)
        "sd_checkpoint_name": checkpoint_name,
    }
    with atomic_path(path) as tmp:
        torch.save(data, tmp, _use_new_zipfile_serialization=False)
    return Path(path)


def save_textual_inversion(
    out_dir: Path, token: str, embeds, metadata: Optional[Mapping[str, str]] = None,
    architecture: Optional[str] = None, prediction_type: Optional[str] = None, facts: Optional[SpecFacts] = None,
) -> dict[str, Path]:
    """`embeds` is (num_vectors, dim). Writes diffusers' `learned_embeds.safetensors` and A1111's embedding.

    A1111 names an embedding after its file, so the A1111 files are `a1111/<trigger>.safetensors` (one tensor,
    `emb_params`: A1111 takes a single-tensor file as an embedding) and `a1111/<trigger>.pt` (which also carries the
    update count and the base model, shown in A1111's UI). `architecture`: the base model's model-spec id
    (model_spec.sd_base_model), which both `.safetensors` name as sd-scripts does, with what the base model
    predicts (`prediction_type`) and the run's `facts`; None claims none.
    """
    out_dir = Path(out_dir)
    meta = dict(metadata or {})
    meta.setdefault("rangefinder.placeholder_token", token)
    name = a1111_embedding_name(token)
    meta["rangefinder.a1111_trigger"] = name
    updates = meta.get("rangefinder.updates")
    a1111 = out_dir / TI_A1111_DIR
    diffusers_spec, a1111_spec = (_embedding_spec(architecture, implementation, prediction_type, facts)
                                  for implementation in (MODELSPEC_IMPL_DIFFUSERS, MODELSPEC_IMPL_SGM))
    return {
        "diffusers": save_safetensors({token: embeds}, out_dir / TI_WEIGHTS_NAME, {**meta, **diffusers_spec}),
        "a1111": save_safetensors({"emb_params": embeds}, a1111 / f"{name}.safetensors", {**meta, **a1111_spec}),
        "a1111_pt": save_a1111_pt(a1111 / f"{name}.pt", embeds, name, None if updates is None else int(updates),
                                  base_model_name(meta.get("rangefinder.base_model"),
                                                  meta.get("rangefinder.base_model_revision")),
                                  a1111_checkpoint_hash(meta.get("rangefinder.base_model_revision"))),
    }


def save_textual_inversion_sdxl(
    out_dir: Path, token: str, clip_l, clip_g, metadata: Optional[Mapping[str, str]] = None,
    prediction_type: Optional[str] = None, facts: Optional[SpecFacts] = None,
) -> dict[str, Path]:
    """SDXL's embedding format: one file holding `clip_l` (num_vectors, D1), the rows of the first encoder (CLIP
    ViT-L), and `clip_g` (num_vectors, D2), those of the second (OpenCLIP bigG); A1111 and ComfyUI load it as an
    SDXL embedding, and diffusers with `load_textual_inversion(state["clip_l"], text_encoder=pipe.text_encoder, ...)`
    and again for `clip_g` with text_encoder_2. Written as `learned_embeds.safetensors` and, under the trigger word
    A1111 knows it by, `a1111/<trigger>.safetensors`, both with the model spec of an SDXL embedding."""
    out_dir = Path(out_dir)
    meta = dict(metadata or {})
    meta.setdefault("rangefinder.placeholder_token", token)
    name = a1111_embedding_name(token)
    meta["rangefinder.a1111_trigger"] = name
    tensors = {"clip_l": clip_l, "clip_g": clip_g}
    meta.update(_embedding_spec(ARCH_SDXL, MODELSPEC_IMPL_SGM, prediction_type, facts))  # one layout, both files
    return {
        "diffusers": save_safetensors(tensors, out_dir / TI_WEIGHTS_NAME, meta),
        "a1111": save_safetensors(tensors, out_dir / TI_A1111_DIR / f"{name}.safetensors", meta),
    }


def _embedding_spec(architecture: Optional[str], implementation: str, prediction_type: Optional[str],
                    facts: Optional[SpecFacts]) -> dict[str, str]:
    """The model spec of an embedding on the base model `architecture` (none without it)."""
    if architecture is None:
        return {}
    return model_spec(architecture, implementation, facts, prediction_type, ADAPTER_TEXTUAL_INVERSION)
