"""Typed settings for every step (one place, used everywhere); the hyperparameter arithmetic is planning.py's.

One `RangefinderConfig` flows from the CLI, a YAML file or the KFP parameters into every step. Each section is a
pydantic model that rejects unknown keys and bad values with a message naming the field and the fix.
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import typing
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal, Optional, Union
from urllib.parse import parse_qsl, urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from rangefinder import redaction
from rangefinder.defaults import DIVERGENCE_FACTOR, MID_POSITION, MIDPOINT
from rangefinder.errors import ConfigError

# ---------------------------------------------------------------------------------------------------------------
# Errors


def format_validation_error(err: ValidationError, prefix: str = "") -> str:
    """One line per problem: `section.field: what is wrong (got VALUE)`."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e.get("loc", ()) if p != "__root__")
        where = f"{prefix}{loc}" if loc else (prefix.rstrip(".") or "config")
        msg = e.get("msg", "invalid value").removeprefix("Value error, ")
        fix = ""
        if e.get("type") == "extra_forbidden" and _sections().get(prefix.rstrip("."), object).__name__ == err.title:
            msg, fix = _unknown_setting(where)
        got = e.get("input")
        got_txt = ""
        if e.get("type") not in ("value_error", "missing") and not isinstance(got, (dict, list)):
            # A secret under a name the config does not have (hf_token, password) is named, never shown: the line
            # goes to the terminal, a step's log and the pipeline run's record.
            got_txt = f" (got {REDACTED})" if is_secret_key(where) else f" (got {got!r})"
        if e.get("type") == "list_type" and isinstance(got, (str, int, float)) and not isinstance(got, bool):
            # `prompts: "a red circle"`, `seeds: 0`: one value where a list of them belongs.
            fix = f"write it as a list, e.g. [{json.dumps(got, ensure_ascii=False)}]"
        if e.get("type") == "literal_error" and isinstance(got, str):
            fix = OTHER_TOOLS_VALUES.get(where, {}).get(got, fix)
        got_txt += f"; {fix}" if fix else ""
        # Cross-field checks already name their fields in the message.
        lines.append(f"{msg}{got_txt}" if msg.startswith(where) else f"{where}: {msg}{got_txt}")
    return "; ".join(lines)


# Other trainers' names for settings rangefinder names otherwise (kohya sd-scripts' and diffusers' example scripts'
# arguments), which no spelling distance finds: a config carried over from one of them is told where each goes.
OTHER_TOOLS_NAMES = {
    "learning_rate": "training.lr",
    "unet_lr": "training.lr",
    "max_train_steps": "training.steps",
    "max_train_epochs": "training.epochs",
    "num_train_epochs": "training.epochs",
    "train_batch_size": "training.batch_size",
    "gradient_accumulation_steps": "training.grad_accum",
    "lr_scheduler": "training.schedule",
    "lr_warmup_steps": "training.warmup_updates",
    "optimizer_type": "training.optimizer",
    "network_dim": "training.lora.rank",
    "network_alpha": "training.lora.alpha",
    "pretrained_model_name_or_path": "model.base_model",
    "train_data_dir": "data.dataset_dir",
    "instance_data_dir": "data.dataset_dir",
    # The flow-matching models' (sd-scripts' SD3 and Flux trainers): the constant shift, and logit-normal's spread.
    "discrete_flow_shift": "training.flow.shift",
    "training_shift": "training.flow.shift",
    "sigmoid_scale": "training.flow.logit_std",
}
# Other trainers' flow-matching settings that are no one setting here, and what stands for each
# (docs/model-families.md, "Where the reference trainers differ"): diffusers' weighting_scheme is two of ours, its Flux
# script's guidance_scale is training's (not the samples'), and T5's length and the preconditioned target are fixed.
OTHER_TOOLS_SAID = {
    "weighting_scheme": "diffusers' weighting_scheme is two settings here: training.flow.timestep_sampling "
                        "(logit_normal, mode, uniform) and training.flow.loss_weighting (sigma_sqrt, cosmap)",
    "guidance_scale": "the guidance Flux.1-dev trains with (diffusers' and sd-scripts' Flux guidance_scale) is "
                      "training.flow.guidance; the samples' is sampling.guidance_scale",
    "max_sequence_length": "T5's tokens per caption are no setting: 512 on Flux.1, 77 on SD3, the same in training, "
                           "validation and every sample (docs/model-families.md); remove it",
    "t5xxl_max_token_length": "T5's tokens per caption are no setting: 512 on Flux.1, 77 on SD3, the same in "
                              "training, validation and every sample (docs/model-families.md); remove it",
    "precondition_outputs": "SD3 and Flux train on the velocity noise - x0, not preconditioned (the same minimiser, "
                            "weighted sigma^2 there); training.flow.loss_weighting weights it; remove it",
    "model_prediction_type": "SD3 and Flux train on the velocity noise - x0 (sd-scripts' raw), not preconditioned; "
                             "training.flow.loss_weighting weights it; remove it",
}
# Values of another trainer's that a setting of the same name here spells otherwise: the setting, the value, and what
# stands for it (sd-scripts' timestep_sampling; diffusers' weighting_scheme values, which are split in two here).
OTHER_TOOLS_VALUES = {
    "training.flow.timestep_sampling": {
        "sigmoid": "sd-scripts' sigmoid is logit_normal unshifted (training.flow.shift 1.0), its sigmoid_scale "
                   "training.flow.logit_std",
        "shift": "sd-scripts' shift is logit_normal with training.flow.shift its discrete_flow_shift",
        "flux_shift": "sd-scripts' flux_shift is logit_normal with training.flow.shift unset (Flux's "
                      "resolution-dependent shift)",
        "sigma": "sd-scripts' sigma is its weighting_scheme's density (logit_normal, mode, uniform) shifted by its "
                 "discrete_flow_shift: that density here, training.flow.shift the shift",
        "sigma_sqrt": "sigma_sqrt weights the loss: training.flow.loss_weighting",
        "cosmap": "cosmap weights the loss: training.flow.loss_weighting",
    },
    "training.flow.loss_weighting": {
        "logit_normal": "logit_normal is how sigma is drawn: training.flow.timestep_sampling",
        "mode": "mode is how sigma is drawn: training.flow.timestep_sampling",
    },
}


@functools.cache
def _sections() -> dict[str, type[BaseModel]]:
    """Every section of RangefinderConfig by its dotted path ("" for the top level, "training.lora", ...; a list of
    sections, kubernetes.tolerations, by the list's path). Walked once: an error of several unknown keys asks for it
    for each."""
    out: dict[str, type[BaseModel]] = {}
    todo: list[tuple[str, type[BaseModel]]] = [("", RangefinderConfig)]
    while todo:
        path, model = todo.pop(0)  # breadth first, in the order the fields are declared
        out[path] = model
        for name, field in model.model_fields.items():
            todo.extend((f"{path}.{name}".lstrip("."), t) for t in _leaf_types(field.annotation)
                        if isinstance(t, type) and issubclass(t, BaseModel))
    return out


def _unknown_setting(where: str) -> tuple[str, str]:
    """What to say of `where` (a dotted path), a key no section of the config has: the section's setting spelled
    nearly alike, the rangefinder name of another trainer's setting (or of one spelled nearly alike), or the sections
    that hold a setting of that name (one put at the wrong level); else where the settings are listed. (The problem,
    the fix.)"""
    import difflib

    parent, _, key = where.rpartition(".")
    parent = re.sub(r"\.\d+(?=\.|$)", "", parent)  # kubernetes.tolerations.0 -> kubernetes.tolerations
    sections = _sections()
    names = list(sections[parent].model_fields) if parent in sections else []
    what = f"not a setting of {parent}" if parent else "not a setting or section of the config"
    if key in OTHER_TOOLS_SAID:
        return what, OTHER_TOOLS_SAID[key]
    # 0.75: `colour` is not `lora` (0.6), while `epoch`, `rnk` and `learnig_rate` are a letter off theirs.
    close = difflib.get_close_matches(key, [*names, *OTHER_TOOLS_NAMES], n=1, cutoff=0.75)
    if close and close[0] in OTHER_TOOLS_NAMES:
        return what, f"rangefinder's name for {close[0]} (kohya sd-scripts, diffusers) is {OTHER_TOOLS_NAMES[close[0]]}"
    if close:
        return what, f"did you mean {f'{parent}.' if parent else ''}{close[0]}?"
    homes = [path or "the top level" for path, model in sections.items() if key in model.model_fields]
    if homes:
        return what, f"{key} is a setting of {', '.join(homes)}: put it under the one meant"
    return what, "remove it (every setting is documented in src/rangefinder/config.py)"


def _leaf_types(annotation: Any) -> list[Any]:
    """The plain types a field of this type holds: through Optional, unions, lists and Annotated; a Literal's values'
    types."""
    leaves: list[Any] = []
    todo = [annotation]
    while todo:
        t = todo.pop()
        args = typing.get_args(t)
        if typing.get_origin(t) is Literal:
            leaves.extend(type(a) for a in args)
        elif args:
            todo.extend(args[:1] if typing.get_origin(t) is Annotated else args)
        else:
            leaves.append(t)
    return leaves


def _number_not_bool(annotation: Any) -> bool:
    """Whether a field of this type (or a list of them) takes numbers but not booleans."""
    leaves = _leaf_types(annotation)
    return bool({int, float} & set(leaves)) and bool not in leaves


# The settings that name a local path, which the code reads with `~` expanded (_PathSection's: the data's, the
# split's and the model's; training.cache_dir is left to expand_home where it is used, as a checkpoint written on
# another machine carries it and is read here without it).
PATH_SETTINGS = frozenset({"dataset_dir", "val_dir", "base_model", "cache_dir", "single_file_config", "resolved_dir"})


def home_of_no_user(path: str) -> Optional[str]:
    """Why `path` cannot be read where it begins with the home folder of a user this machine does not have (`~sd15`,
    the slash after ~ forgotten: pathlib's expanduser raises RuntimeError for it, wherever the path is read); None
    for any other path."""
    if not path.startswith("~") or os.path.expanduser(path) != path:  # os.path's leaves such a path as it is
        return None
    user = path[1:].split("/", 1)[0]
    if not user:  # HOME unset, and this process's user has no home folder either
        return f"{path} begins with ~, and this process has no home folder (HOME is unset); set HOME, or spell it out"
    return (f"{path} begins with ~{user}, the home folder of a user this machine does not have; write ~/ for your own "
            "home folder, or spell the path out")


def expand_home(path: str | os.PathLike, what: str) -> Path:
    """`path` with `~` expanded, as pathlib's expanduser does; ConfigError naming `what` (where the path was set: an
    environment variable such as $RANGEFINDER_CACHE, or a setting the config's validation leaves alone) where it
    begins with the home folder of a user this machine does not have, for which pathlib's raises RuntimeError."""
    problem = home_of_no_user(os.fspath(path))
    if problem is not None:
        raise ConfigError(f"{what}: {problem}")
    return Path(path).expanduser()


class _Section(BaseModel):
    # No NaN or infinity anywhere: no setting means "unbounded" by inf (None does), and a NaN LR trains nothing.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    def default_of(self, name: str) -> Any:
        """The default of field `name` (given_settings compares a given value with it)."""
        return type(self).model_fields[name].get_default(call_default_factory=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_numbers(cls, v: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 (PyYAML) reads yes/no/on/off/y/n as booleans, and pydantic takes a boolean for a number (True is
        # 1): `epochs: yes` trained one epoch. A number field (or list of numbers) refuses booleans here. Fields
        # with their own before-validator (compile: on/off, every_validations: off) run it first, so the words
        # they document still work.
        items = v if isinstance(v, list) else [v]
        field = cls.model_fields[info.field_name or ""]
        if any(isinstance(i, bool) for i in items) and _number_not_bool(field.annotation):
            raise ValueError(f"a YAML boolean (yes/no/on/off/true/false) is not a number (got {v!r}); write the "
                             "number itself")
        return v


class _PathSection(_Section):
    """A section with PATH_SETTINGS among its fields: one under the home folder of no user here is refused."""

    @field_validator(*PATH_SETTINGS, mode="after", check_fields=False)
    @classmethod
    def _a_home_that_is_here(cls, v: Any) -> Any:
        problem = home_of_no_user(v) if isinstance(v, str) else None
        if problem is not None:
            raise ValueError(problem)
        return v


# A random seed. numpy's global seeding (accelerate's set_seed, at the start of every run) takes 0..2**32-1 and
# raises on anything else; every other generator here takes that range too.
MAX_SEED = 2**32 - 1
Seed = Annotated[int, Field(ge=0, le=MAX_SEED)]


# ---------------------------------------------------------------------------------------------------------------
# Credentials: never in a setting (tracking/redaction.py keeps them out of what is logged, by the same rules)

# Where MLflow credentials belong instead of a URI (config messages and the tracking-URI check say it alike).
CREDENTIALS_FIX = (
    "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment, "
    "from a Kubernetes Secret on a cluster (kubernetes.mlflow_secret)"
)

# The last dotted segment of a param/tag key that marks it secret. `placeholder_token` (textual inversion) is a
# word of the prompt, not a credential, so only the bare word `token` or these compounds count. A pre-signed object
# store URL (a dataset's) carries its grant in its query: S3's X-Amz-Signature and X-Amz-Security-Token, GCS's
# X-Goog-Signature, Azure's SAS `sig`.
_SECRET_KEY = re.compile(
    r"(?:^|[._-])(?:password|passwd|pwd|secret|secret_key|api_?key|access_?key|private_?key|credentials?|"
    r"auth_?token|access_?token|bearer|hf_?token|client_?secret|signature|security[_-]?token)$|^(?:token|sig)$|"
    r"\.token$",
    re.IGNORECASE,
)


# Settings whose names look secret but whose values only say where a credential is kept: a Kubernetes Secret's
# name, or the key in it, which the pods read the credential from. Neither is a credential (RBAC guards the Secret's
# values, not its name), and the run's config.yaml must hold them to be read back (`run --local --config`), so they
# are logged as they are. Dotted paths: the same word elsewhere (a param `hub.secret`) is still hidden.
SECRET_REFERENCES = frozenset({"kubernetes.mlflow_secret", "kubernetes.hf_token_secret",
                               "kubernetes.hf_token_secret_key"})

# What stands in MLflow's copy of a config for a value it hid (tracking/runs.py config_text: a secret-named setting,
# or a string that held a secret, each hidden whole): a config read back with one is refused, naming the setting to
# fill in, as it would train on the mark. Only a whole value: a prompt may hold *** of its own ("a ***bold*** sign").
REDACTED = redaction.REDACTED


def is_secret_key(key: str) -> bool:
    """Whether the value under `key` (a dotted param, tag or setting name) is to be hidden as a secret."""
    return key not in SECRET_REFERENCES and bool(_SECRET_KEY.search(key))


def uri_credentials(uri: str) -> Optional[str]:
    """What secret `uri` carries in itself ("a user name and password", "a secret in its query (token=)"), or None.

    Only names what is there, never the value, so the answer can go into an error message.
    """
    try:
        parts = urlsplit(uri.strip())
    except ValueError:
        return None
    if "@" in parts.netloc:
        return "a user name and password" if ":" in parts.netloc.rsplit("@", 1)[0] else "a user name"
    keys = [k for k, _ in parse_qsl(parts.query, keep_blank_values=True) if is_secret_key(k)]
    if keys:
        return f"a secret in its query ({', '.join(f'{k}=' for k in keys)})"
    return None


def page_base_url(url: str) -> str:
    """A web UI's address as links are built on it: http:// where it names no scheme (as kfp.Client's links take a
    host), and a page of the UI copied from the browser (`.../#/experiments/1`) counted up to its `#`, which starts
    the UI's own routes (KFP's and MLflow's UIs both route there), without a trailing `/`."""
    url = url.strip()
    if not re.match(r"^https?://", url, re.IGNORECASE):
        url = "http://" + url
    return url.split("#", 1)[0].rstrip("/")


# The settings that name an MLflow server, whose credentials belong in MLflow's variables (CREDENTIALS_FIX).
MLFLOW_URI_SETTINGS = frozenset({"tracking.tracking_uri", "kubernetes.mlflow_tracking_uri"})
# Where another URI's credentials go: no setting reads a URL's own (a base model is a folder, a file or a hub id).
_MLFLOW_FIX = f" and {CREDENTIALS_FIX}"
_OTHER_FIX = (
    ": a config is compiled into the pipeline and shown with its parameters; a gated or private hub model reads "
    "HF_TOKEN from the environment (on a cluster from the Secret kubernetes.hf_token_secret)"
)
# A browser's address of the MLflow UI (tracking.ui_url) is no model's: the browser signs in itself.
_UI_FIX = ": every link the run shows would carry it; give the MLflow UI's URL alone (the browser signs in itself)"


def _refuse_uri_credentials(uri: Optional[str], fix: str = _MLFLOW_FIX) -> None:
    """A URI in a setting must not carry credentials: it is shown in tables and logs and compiled into the pipeline.
    `fix` follows "remove it": where the credentials go instead."""
    if uri:
        held = uri_credentials(uri)
        if held:
            raise ValueError(f"the URI holds {held}; remove it{fix}")


# ---------------------------------------------------------------------------------------------------------------
# Data, split, model

class DataConfig(_PathSection):
    # None means the embedded default dataset (synthetic shapes, made offline by `rangefinder make-dataset`).
    dataset_dir: Optional[str] = None
    # Training resolution in pixels: the side of the square bucket, whose area every bucket has about (bucketing
    # below; with it off, the side of the square crop). 512 suits SD 1.x; the embedded tiny model uses 32.
    resolution: int = Field(512, ge=8, le=8192)  # 8192: far above any SD model (SDXL: 1024)
    # Centre-crop to a square before resizing (False: resize the whole image, changing its aspect).
    center_crop: bool = True
    # Images smaller than this on their short side are reported and skipped; None means resolution // 2.
    min_image_size: Optional[int] = Field(None, ge=1)
    # Fewer usable images than this stops the run before training (1 train + 1 validation at the very least).
    min_images: int = Field(2, ge=2)
    # Aspect-ratio buckets, as kohya sd-scripts, EveryDream2 and OneTrainer train: each image goes to the bucket of
    # about resolution^2 pixels whose aspect ratio is nearest its own, resized and cropped minimally, and every batch
    # comes from one bucket (data/buckets.py). On by default because photo sets are mixed portrait and landscape and
    # a square crop cuts off heads and feet; a set of square images (the embedded demo) lands in the one square
    # bucket and trains exactly as with `false`, which centre-crops every image to a square.
    bucketing: bool = True
    # Bucket sides are multiples of this many pixels. It must be a multiple of the base model's own divisor, the VAE's
    # downscale times the UNet's (SD 1.x/2.x/SDXL: 8 x 8 = 64; the embedded tiny model: 4 x 2 = 8); resolve-config
    # refuses a step none of whose buckets fit, the engine the buckets a dataset's images land in. None: min(64,
    # resolution // 4) rounded down to a multiple of 8 (64 from 256 px up; 8 at the tiny model's 32 px, where 64
    # would leave one bucket).
    bucket_step: Optional[int] = Field(None, ge=8)
    # Largest long-side / short-side ratio of a bucket. 2.0 covers 16:9 and 2:3 photos; wider images are cropped to
    # 2:1. Fewer, fuller buckets than kohya's reach of 4:1 mean fewer partial batches and steadier per-bucket
    # validation losses on the small sets this tool is for.
    max_aspect: float = Field(2.0, ge=1.0, le=8.0)

    @field_validator("resolution")
    @classmethod
    def _multiple_of_8(cls, v: int) -> int:
        if v % 8:
            raise ValueError(f"must be a multiple of 8 (the VAE downsamples by 8); got {v}, try {v - v % 8 or 8}")
        return v

    @field_validator("bucket_step")
    @classmethod
    def _step_multiple_of_8(cls, v: Optional[int]) -> Optional[int]:
        if v is not None and v % 8:
            raise ValueError(f"must be a multiple of 8 px (the VAE downsamples by 8); got {v}, try {v - v % 8 or 8}")
        return v

    @model_validator(mode="after")
    def _step_fits(self) -> DataConfig:
        if self.bucketing and self.effective_bucket_step() > self.resolution:
            raise ValueError(
                f"data.bucket_step ({self.bucket_step}) is larger than data.resolution ({self.resolution}): no bucket "
                "fits; lower bucket_step or leave it unset"
            )
        return self

    def effective_min_image_size(self) -> int:
        return self.min_image_size if self.min_image_size is not None else max(1, self.resolution // 2)

    def effective_bucket_step(self) -> int:
        return default_bucket_step(self.resolution) if self.bucket_step is None else self.bucket_step


def default_bucket_step(resolution: int) -> int:
    """min(64, resolution // 4), rounded down to a multiple of 8 and at least 8 (see DataConfig.bucket_step)."""
    return max(8, min(64, resolution // 4) // 8 * 8)


class SplitConfig(_PathSection):
    # Share of images put into validation, rounded up (ceil(p*N)); 0 means no validation set (full-data retrain).
    val_split: float = Field(0.2, ge=0.0, lt=1.0)
    # Share of the *training* images drawn into the stabilize subset (a smooth, validation-style training loss).
    stabilize_split: float = Field(0.2, ge=0.0, le=1.0)
    # Seed of the shuffle; the same seed and files give the same split on any machine.
    seed: Seed = 555
    # A folder of validation images chosen by hand; when set, val_split is ignored.
    val_dir: Optional[str] = None

    def holds_out_validation(self) -> bool:
        """Whether the split sets images aside for validation: a val_dir, or a val_split above 0."""
        return self.val_dir is not None or self.val_split > 0


class ModelConfig(_PathSection):
    # A local diffusers folder, a single-file checkpoint (.safetensors; pickle formats are refused) or a Hugging Face
    # hub id (org/name). None means the embedded tiny model (`rangefinder make-base-model`). See models/loading.py.
    base_model: Optional[str] = None
    # A hub id's branch, tag or commit (None: main). Pin a commit for a run that can be repeated exactly.
    revision: Optional[str] = None
    variant: Optional[str] = None  # a hub or folder model's weights variant, e.g. "fp16" (smaller download)
    # Where the embedded model and converted single files are cached (None: $RANGEFINDER_CACHE or
    # ~/.cache/rangefinder) and, when set, where hub models are cached (None: the Hugging Face cache, $HF_HUB_CACHE
    # or $HF_HOME/hub).
    cache_dir: Optional[str] = None
    # A local diffusers folder with the architecture of a single-file base_model, so nothing is fetched to read it.
    # None: the base model named in the file's rangefinder metadata, else diffusers infers one (from the hub).
    single_file_config: Optional[str] = None
    # Set by the pipeline's first step, not by hand: the local diffusers folder base_model resolved to (downloaded
    # or converted once), which every later step loads. A step that cannot see it resolves base_model again; a
    # command that starts a run ignores it (a config copied from an earlier run holds that run's: unresolved).
    resolved_dir: Optional[str] = None
    # Set with resolved_dir, not by hand: the revision base_model resolved to, which no later change upstream moves (a
    # hub id's snapshot commit, where `revision: main` names whatever main is that day; a single file's
    # "sha256:<hex>", read anyway to find its conversion; a folder's and the embedded model's "weights:<hex>", a
    # fingerprint of its weights, which someone may replace under the same path: models/fingerprint.py). The MLflow
    # tag rangefinder.base_model_revision of every step's run and of the registered version.
    resolved_revision: Optional[str] = None

    @field_validator("revision")
    @classmethod
    def _a_hub_model_s(cls, v: Optional[str], info: ValidationInfo) -> Optional[str]:
        # A revision beside the embedded model, a folder or a single file was ignored without a word: a person who
        # typed a commit believed the run pinned to it. main is the default branch, no change (the example config
        # sets it). By the name's shape (models/loading.py's _looks_like_hub_id also asks the filesystem, which a
        # config's validation does not), so a path that reads as org/name is left to the loader.
        base = info.data.get("base_model")
        if v is not None and v != "main" and not _hub_id_shaped(base):
            what = "empty (the embedded tiny model)" if not base else f"{base!r}, a path"
            raise ValueError(f"{v!r} is a branch, tag or commit of a hub model, and model.base_model is {what}, which "
                             "has none: it would be ignored; clear it, or give model.base_model a hub id (org/name)")
        return v


def _hub_id_shaped(name: Optional[str]) -> bool:
    """Whether `name` can be a hub id (org/name or name) by its shape: not a path, file name or URL."""
    return bool(name) and not (
        str(name).startswith(("/", "./", "../", "~", ".")) or str(name).count("/") > 1 or "://" in str(name)
        or str(name).lower().endswith((".safetensors", ".ckpt", ".pt", ".pth", ".bin")))


# ---------------------------------------------------------------------------------------------------------------
# Methods


class LoraSettings(_Section):
    rank: int = Field(4, ge=1)  # adapter rank r
    alpha: float = Field(4.0, gt=0)  # scale = alpha / rank
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # The denoiser's attention projections, as in diffusers' SD 1.x LoRA example: diffusers' module paths or their ends
    # (peft's match; a name matching no layer is refused). On SD3 and Flux the image stream's only: their diffusers
    # scripts add attn.add_{q,k,v}_proj and attn.to_add_out (docs/model-families.md).
    target_modules: list[str] = Field(default_factory=lambda: ["to_k", "to_q", "to_v", "to_out.0"])
    train_text_encoder: bool = False

    @field_validator("target_modules")
    @classmethod
    def _some_layer(cls, v: list[str]) -> list[str]:
        # An empty list stopped the first training step in peft's traceback, once the model had loaded.
        if not v:
            raise ValueError("is empty, and LoRA adapts the layers it names; name at least one (diffusers' module "
                             "names, such as to_q) or leave it out for the default")
        return v


class FlowSettings(_Section):
    """The rectified-flow objective's settings (SD3, Flux: docs/model-families.md); refused on SD 1.x/SDXL when
    changed. Training draws sigma in [0, 1] from `timestep_sampling`'s density (Esser et al. 2024,
    arXiv:2403.03206, sec. 3.1: logit-normal and mode sampling), then shifts it towards noise: sigma' = shift *
    sigma / (1 + (shift - 1) * sigma) (the family's resolution-dependent shift for Flux)."""

    timestep_sampling: Literal["uniform", "logit_normal", "mode"] = "logit_normal"
    logit_mean: float = 0.0  # logit-normal: u ~ N(logit_mean, logit_std), sigma = sigmoid(u)
    logit_std: float = Field(1.0, gt=0)
    # mode sampling's s; 1.29 is the paper's (and diffusers'); the map is monotone for s in [-1, 2 / (pi - 2)]
    mode_scale: float = Field(1.29, ge=-1, le=1.75)
    shift: Optional[float] = Field(None, gt=0)  # None: the base model's scheduler config (SD3: 3.0)
    # The per-image loss weight (diffusers' compute_loss_weighting_for_sd3): none, sigma ** -2 (sigma_sqrt), or
    # 2 / (pi * (1 - 2 sigma + 2 sigma^2)) (cosmap). Validation is never weighted.
    loss_weighting: Literal["none", "sigma_sqrt", "cosmap"] = "none"
    # Flux.1-dev only: the guidance scale fed to its guidance-distilled transformer while training (None: 3.5, the
    # default of diffusers' and sd-scripts' Flux trainers).
    guidance: Optional[float] = Field(None, ge=0)

    @model_validator(mode="after")
    def _only_the_drawn_density_s_shape(self) -> FlowSettings:
        # logit_mean and logit_std shape logit_normal, mode_scale shapes mode; under another timestep_sampling one
        # changed from its default trained as if unset without a word (diffusers and sd-scripts read them so too).
        owner = {"logit_mean": "logit_normal", "logit_std": "logit_normal", "mode_scale": "mode"}
        for name, density in owner.items():
            if density != self.timestep_sampling and getattr(self, name) != self.default_of(name):
                raise ValueError(f"training.flow.{name} shapes timestep_sampling {density}, and timestep_sampling "
                                 f"is {self.timestep_sampling}, which does not read it; remove it, or set "
                                 f"timestep_sampling: {density}")
        return self


class TextualInversionSettings(_Section):
    placeholder_token: str = "<rf-concept>"
    # An existing single-token word whose embedding seeds the new one(s).
    initializer_token: str = "object"
    num_vectors: int = Field(1, ge=1)
    # Used to build captions from templates when a dataset has none.
    learnable_property: Literal["object", "style"] = "object"

    @field_validator("placeholder_token")
    @classmethod
    def _a_word(cls, v: str) -> str:
        # Empty, the tokenizer adds no token for it and gives it its unknown word's id (CLIP's end-of-text, which
        # every prompt holds), whose row was trained; and every caption holds "" already, so none had it added. Blank,
        # it is no word a caption or prompt is read into.
        if not v.strip():
            raise ValueError("is empty or only blank space, and textual inversion trains the word it names; give a "
                             "new word, e.g. '<my-concept>'")
        return v


Method = Literal["full", "lora", "textual_inversion"]
Schedule = Literal["constant", "linear-ramp", "exp-ramp", "cosine", "triangular", "triangular2", "exp_range", "wsd"]
RAMP_SCHEDULES = ("linear-ramp", "exp-ramp")
CYCLIC_SCHEDULES = ("triangular", "triangular2", "exp_range")
StepsUnit = Literal["update", "micro-batch"]
# training.optimizer (training/optimizers.py makes them). LR-free ones adapt their own step size (Prodigy's d; the LR
# is a multiplier, 1.0 by default): the pipeline skips the range test for them. Schedule-free ones replace the LR
# schedule by an average of the iterates: they train with a constant LR, and are measured and saved in eval mode.
Optimizer = Literal["adamw", "adamw8bit", "prodigy", "prodigy_schedule_free", "adamw_schedule_free", "adafactor"]
LR_FREE_OPTIMIZERS = ("prodigy", "prodigy_schedule_free")
SCHEDULE_FREE_OPTIMIZERS = ("adamw_schedule_free", "prodigy_schedule_free")
EMA_AUTO_OPTIMIZERS = ("adamw", "adamw8bit")  # training.use_ema auto keeps an EMA for LoRA with these only
# The base model families (training/family_detection.py's names, which it reads off a model's files) as users know
# them, for every message: "sdxl" is the code the tables here and the engine key on, not a word a user reads.
FAMILY_NAMES = {"sd1": "Stable Diffusion 1.x/2.x", "sdxl": "Stable Diffusion XL", "sd3": "Stable Diffusion 3/3.5",
                "flux": "Flux.1"}
# The base model families (training/family_detection.py's names) on which training.use_ema auto keeps an EMA for LoRA:
# SD 1.x/2.x, where bench/RESULTS.md measured it ("The EMA as LoRA's default"). Not SDXL, SD3 or Flux: the same rule
# failed on each ("The EMA on the flow families' LoRA": on SD3's 25 LoRA cases wins against Prodigy's best fell from
# 11 to 7 and against random search from 17 to 12, on Flux's 15 nothing moved; "The EMA on SDXL's LoRA": on 10 fresh
# cases 5 to 3 and 8 to 7, where the window average it replaces was delivered in 6).
EMA_AUTO_FAMILIES = ("sd1",)
LR_FREE_LR = 1.0  # the LR-free optimizers' documented lr: a multiplier of the step size they estimate
# How the pipeline measures the LR when none is fixed (RangefinderConfig.lr_finder): the LR range test, or the step
# size a Prodigy run of the fine-tune's length ends on (its d x lr); auto picks by the base model's family and the
# method (auto_lr_finder).
LRFinder = Literal["range_test", "prodigy_step", "auto"]
MeasuredBy = Literal["range_test", "prodigy_step"]
# The families (training/family_detection.py's names) and, for each, the methods auto measures with prodigy_step; the
# range test everywhere else. SD3 and Flux, full and lora: chosen by a rule written before its 40 fresh cases ran
# (bench/RESULTS.md, "`lr_finder: auto` by model family"): on the SD3 tiny model the range test read the LR 3.5-160x
# too low, and Prodigy's step size beat it in 15 of 20 (lost 1); on Flux the two tied in 18 of 20 (the prior won 2).
# SDXL, full only: by a rule written before its 10 fresh SDXL full cases ran (seeds 67-68; bench/RESULTS.md, "SDXL's
# full fine-tune at Prodigy's step size"), the prior beat the range test 4 / 4 / 2 and was better than Prodigy's best
# in 9 against the range test's 8; held narrowly. SDXL's LoRA and textual inversion were not tested, and keep the
# range test. On SD 1.x Prodigy's step size did not beat the range test (fresh seeds 33-34: 3 wins, 6 losses), so SD
# 1.x/2.x keeps the range test for every method.
LR_FINDER_AUTO_PRODIGY: dict[str, tuple[str, ...]] = {"sdxl": ("full",), "sd3": ("full", "lora"),
                                                      "flux": ("full", "lora")}


def auto_lr_finder(family: str, method: str) -> MeasuredBy:
    """What lr_finder auto measures the LR with for a base model of `family` trained by `method`."""
    return "prodigy_step" if method in LR_FINDER_AUTO_PRODIGY.get(family, ()) else "range_test"


# The multiple of the Prodigy run's final step size that the prodigy_step finder gives the fine-tune, by family and
# method (1 everywhere else). SDXL's full fine-tune, 4: by a rule written before its 10 fresh cases ran (seeds 71-72;
# bench/RESULTS.md, "SDXL's full fine-tune at four times the step size"), 4x the step size beat 1x in 8 cases and lost
# 2 (both `stripes`), was better than Prodigy's best in as many (8) and beat random search at equal updates in 9
# against 4. SD3's full fine-tune, 4: by a rule written before its 10 fresh cases ran (seeds 75-76; "SD3's full
# fine-tune at twice or four times the step size"), 2x and 4x both beat 1x, and the rule took the one that beat
# random search in more cases (4x: 3 against 2x's 1 and 1x's 0); 2x lost less on every other count. Flux (every arm
# ties there) and the LoRAs were not tested with a factor. On SD 1.x twice and four times the step size lost to the
# range test on the full fine-tune ("SD 1.x's full fine-tune at a multiple of the step size"). A run sets its own
# with the config's prodigy_step_factor (RangefinderConfig.prodigy_step_factor_for).
PRODIGY_STEP_FACTOR: dict[str, dict[str, float]] = {"sdxl": {"full": 4.0}, "sd3": {"full": 4.0}}


def prodigy_step_factor(family: Optional[str], method: str) -> float:
    """The multiple of its step size the prodigy_step finder trains a base model of `family` at with `method`."""
    return PRODIGY_STEP_FACTOR.get(family or "", {}).get(method, 1.0)


ScaleLR = Literal["none", "linear", "sqrt"]
ProcessesPerNode = Union[Literal["auto"], Annotated[int, Field(ge=1)]]


# ---------------------------------------------------------------------------------------------------------------
# One training run (the engine's settings)


class ProdigySettings(_Section):
    """prodigyopt's Prodigy arguments for training.optimizer: prodigy; each unset one (None) is the package's own
    default. The prodigy_step LR finder trains with diffusers' recipe (training.optimizers.PRODIGY_SETTINGS)."""

    betas: Optional[tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]]] = None
    weight_decay: Optional[float] = Field(None, ge=0)
    use_bias_correction: Optional[bool] = None
    safeguard_warmup: Optional[bool] = None

    def kwargs(self) -> dict[str, Any]:
        """The arguments given, as Prodigy takes them (the unset ones left to its defaults)."""
        return {k: getattr(self, k) for k in type(self).model_fields if getattr(self, k) is not None}


class TrainingConfig(_Section):
    method: Method = "full"
    lora: LoraSettings = Field(default_factory=LoraSettings)
    textual_inversion: TextualInversionSettings = Field(default_factory=TextualInversionSettings)

    # --- batch arithmetic
    batch_size: int = Field(1, ge=1)  # images per micro-batch per process
    grad_accum: int = Field(1, ge=1)  # micro-batches per update
    # Processes the launcher (accelerate) starts; the engine checks it against the real number. The pipeline's
    # training steps set it themselves: processes_per_node x distributed.num_nodes.
    world_size: int = Field(1, ge=1)
    # Processes the range test, fine-tune and retrain steps start on each node, one per accelerator (DDP):
    # auto = the GPUs the step's pod sees (kubernetes.gpu_count), 1 on CPU; an integer forces it (on CPU: gloo).
    processes_per_node: ProcessesPerNode = "auto"
    # The dtype DDP all-reduces gradients in, on several processes: fp32, or bf16 to halve what each update moves
    # (PyTorch's bf16_compress_hook: cast to bf16, summed, cast back); docs/scaling.md, section 2.
    allreduce_dtype: Literal["fp32", "bf16"] = "fp32"
    # Skip the trailing images of each epoch instead of letting micro-batches straddle epochs.
    drop_last: bool = False

    # --- budget: exactly one of epochs / steps
    epochs: Optional[int] = Field(None, ge=1)
    steps: Optional[int] = Field(None, ge=1)
    steps_unit: StepsUnit = "update"  # diffusers/EveryDream count updates; A1111 counts micro-batches

    # --- learning rate
    lr: float = Field(1e-5, gt=0)  # constant LR, or the peak of cosine; per effective batch if scale_lr != none
    scale_lr: ScaleLR = "none"  # multiply lr by effective_batch (linear) or its square root (sqrt)
    schedule: Schedule = "constant"
    lr_min: Optional[float] = Field(None, ge=0)  # lower end of a ramp or cycle
    lr_max: Optional[float] = Field(None, gt=0)  # upper end of a ramp or cycle
    warmup_updates: int = Field(0, ge=0)  # linear warmup for cosine and wsd
    # wsd (warmup, stable, decay): the last `decay_fraction` of the run's updates fall linearly from lr to lr_min
    # (default 0). The fine-tune's cooldown (finetune.cooldown) trains this shape.
    decay_fraction: float = Field(0.2, gt=0, lt=1)
    # Half-cycle length of the cyclical schedules in epochs; Smith 2017 suggests 2-10 epochs' worth of updates.
    cycle_epochs: float = Field(2.0, gt=0)
    exp_range_gamma: float = Field(0.999, gt=0, le=1)  # per-update amplitude decay of exp_range

    # --- optimizer
    # Which optimizer (Optimizer above; README "Optimizers"). adam_beta1/2, adam_epsilon and weight_decay are AdamW's
    # and AdamW8bit's; the others start from their packages' own documented defaults. `use_8bit_adam: true`, the old
    # switch, is read as `optimizer: adamw8bit` (migrate_training).
    optimizer: Optimizer = "adamw"
    adam_beta1: float = Field(0.9, ge=0, lt=1)
    adam_beta2: float = Field(0.999, ge=0, lt=1)
    adam_epsilon: float = Field(1e-8, gt=0)
    weight_decay: float = Field(1e-2, ge=0)
    # Prodigy's own arguments (optimizer prodigy only); unset: prodigyopt's defaults.
    prodigy: ProdigySettings = Field(default_factory=ProdigySettings)
    max_grad_norm: Optional[float] = Field(1.0, gt=0)  # None turns clipping off

    # --- loss and augmentation
    # None: the base model's scheduler config. Every model delivered predicts it (full: its folder's scheduler and
    # single file); a LoRA or embedding is sampled with its base model's scheduler, so changing it needs full.
    prediction_type: Optional[Literal["epsilon", "v_prediction"]] = None
    # Min-SNR weighting (Hang et al. 2023); 5.0 is usual. Off by default: on the SD 1.x bench it lowered the validation
    # loss on cases already read, then failed a rule on fresh full and LoRA cases: fewer wins against random search,
    # and worse on images no choice was made on (bench/RESULTS.md, "Min-SNR weighting in (a)").
    min_snr_gamma: Optional[float] = Field(None, gt=0)
    noise_offset: float = Field(0.0, ge=0)  # 0.05-0.1 helps very dark/bright images
    # Flow-matching families only (SD3, Flux): how sigma is drawn and the loss weighted. min_snr_gamma,
    # prediction_type and noise_offset are DDPM's and refused there.
    flow: FlowSettings = Field(default_factory=FlowSettings)
    cond_dropout: float = Field(0.0, ge=0, lt=1)  # share of captions replaced by "" (classifier-free guidance)
    random_flip: bool = False
    # Tag shuffle for comma-separated captions ("1girl, red hair, smiling"): each time an image is drawn its tags
    # take a new order, drawn from the run's seeded generator (so a resumed run draws the same orders), and the
    # first keep_tokens tags stay in place (kohya sd-scripts' shuffle_caption and keep_tokens). Validation captions
    # are never shuffled. The training captions are then encoded every micro-batch, not cached (docs/design.md).
    shuffle_tags: bool = False
    keep_tokens: int = Field(0, ge=0)

    # --- model and memory
    train_text_encoder: bool = False
    gradient_checkpointing: bool = False
    # The UNet's weights in channels_last (NHWC) memory format, so its convolutions run NHWC (PyTorch's channels_last
    # guide); the same numbers up to kernel rounding. Off by default: on CPU it seldom helps, and on an H200 at SD 1.5
    # size, 512 px, bf16 (bench/RESULTS.md, "GPU rows, third session") the UNet's training step was 8 % slower with
    # it at batch 32 and within 2 % at batch 4, the attention blocks' reshapes copying NHWC activations back to
    # contiguous. bench/speed_vs_reference still turns it on for its GPU rows, to compare with their earlier runs.
    channels_last: bool = False
    # auto: bf16 on a CUDA GPU that supports it (Ampere and newer), else fp16 on CUDA, else no (CPU, MPS); see
    # resolve_mixed_precision. Trainable weights stay fp32 either way (the methods keep fp32 master weights), unless
    # weights_dtype is bf16 (below).
    mixed_precision: Literal["auto", "no", "fp16", "bf16"] = "auto"
    # How the trained weights are held under bf16 mixed precision. fp32 (the default): fp32 weights, the forward under
    # bf16 autocast, as diffusers' example trainers run. bf16: the weights themselves in bf16 and the forward without
    # autocast (norms and softmax run in bf16, no casts at each use), while the optimizer steps an fp32 master copy
    # cast in once per update; checkpoints, the EMA and the saved model hold the fp32 master. On an H200 at SD 1.5
    # size the UNet's training step ran 11-13 % more images/s this way and held 9 GiB less at batch 32 (bench/
    # RESULTS.md, "GPU rows, third session"; measured on the step alone, not yet through the engine). Full
    # fine-tuning of the UNet alone (LoRA already keeps its frozen base in bf16), one process, an optimizer that is not
    # schedule-free, bf16 mixed precision; gradients accumulate in bf16 across an update's micro-batches.
    weights_dtype: Literal["fp32", "bf16"] = "fp32"
    # torch.compile of the denoiser (regional: the UNet's repeated transformer blocks, diffusers'
    # compile_repeated_blocks). auto: on for CUDA runs longer than training.setup.COMPILE_AUTO_MIN_UPDATES updates,
    # which is None (never) since an H100 measured a fully compiled UNet slower per update than eager; off on CPU.
    # `on` compiles. The same numbers up to kernel rounding.
    compile: Literal["off", "on", "auto"] = "auto"
    # Keep an exponential moving average of the trained weights and save it; validation then measures the average
    # (what is saved), except on the range test's ramps, where it would lag behind the LR. auto (`keeps_ema`): on for
    # LoRA trained by AdamW (or AdamW8bit) at a constant or decaying LR on SD 1.x/2.x (EMA_AUTO_FAMILIES), where
    # bench/RESULTS.md measured it ("The EMA as LoRA's default": lower loss on unseen images; on the validation
    # images as many wins against the other arms, with some ties turned losses), and where the copy is only the
    # adapter's weights; off on SDXL, SD3 and Flux (its rule failed there), for full fine-tuning (the copy is the
    # whole UNet in fp32, 3.4 GB on SD 1.5, for a smaller measured gain), textual inversion (it moved nothing), the
    # LR-free and schedule-free optimizers, which were not measured with it, and the range test's ramps. true and
    # false keep or drop it always.
    use_ema: Union[bool, Literal["auto"]] = "auto"
    # diffusers' EMAModel: at the n-th update the decay is min(ema_decay, n / (n + 9)) (docs/design.md, "EMA").
    ema_decay: float = Field(0.9999, gt=0, lt=1)
    cache_latents: bool = True  # encode every image once; reused across runs of the same data and base model
    latent_sampling: Literal["mode", "sample"] = "mode"  # a random-init VAE's sample drowns the signal: use mode
    # Where encoded latents and text embeddings are cached (keyed by content); None: $RANGEFINDER_CACHE or
    # ~/.cache/rangefinder. On a cluster, a path on the shared volume lets the pipeline's runs share one cache.
    cache_dir: Optional[str] = None

    # --- reproducibility and checkpoints
    seed: Seed = 1234
    checkpoint_every_updates: Optional[int] = Field(None, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume: bool = False  # resume from the newest whole checkpoint under the output folder

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        return migrate_training(data) if isinstance(data, dict) else data

    @field_validator("processes_per_node", mode="before")
    @classmethod
    def _auto_or_count(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        if isinstance(v, str) and v.strip().isdigit() and int(v) >= 1:
            return int(v)
        raise ValueError(f"must be auto (one process per GPU) or a whole number of processes >= 1 (got {v!r})")

    @field_validator("use_ema", mode="before")
    @classmethod
    def _auto_or_bool(cls, v: Any) -> Any:
        if isinstance(v, bool) or v == "auto":
            return v
        if isinstance(v, str) and v.strip().lower() in ("true", "false"):
            return v.strip().lower() == "true"
        raise ValueError(f"must be auto (an EMA for LoRA on SD 1.x/2.x), true or false (got {v!r})")

    @field_validator("compile", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare on/off as a boolean.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    @model_validator(mode="after")
    def _consistent(self) -> TrainingConfig:
        if self.epochs is not None and self.steps is not None:
            raise ValueError("set either training.epochs or training.steps, not both")
        if self.schedule in RAMP_SCHEDULES + CYCLIC_SCHEDULES:
            if self.lr_max is None:
                raise ValueError(f"training.lr_max: schedule {self.schedule!r} needs lr_max (the top of the range)")
            lo = self.lr_min if self.lr_min is not None else 0.0
            if self.lr_max <= lo:
                raise ValueError(
                    f"training.lr_max ({self.lr_max:g}) must be above training.lr_min ({lo:g}); "
                    "swap them or widen the range"
                )
            if self.schedule == "exp-ramp" and not (self.lr_min and self.lr_min > 0):
                raise ValueError("training.lr_min: an exp-ramp needs lr_min > 0 (it climbs geometrically), e.g. 1e-7")
        if self.optimizer in LR_FREE_OPTIMIZERS and self.scale_lr != "none":
            raise ValueError(f"training.scale_lr: {self.optimizer} estimates its own step size and its lr is a "
                             f"multiplier of it (1.0), not an LR to scale with the batch; set scale_lr: none")
        # A ramp is the range test's measurement of the LR: an LR-free optimizer has none to measure (its lr multiplies
        # the step size it estimates), so the pipeline skips the range test for it and `train` refuses the ramp alike.
        if self.optimizer in LR_FREE_OPTIMIZERS and self.schedule in RAMP_SCHEDULES:
            raise ValueError(f"training.schedule: {self.schedule} is an LR range test, but {self.optimizer} is "
                             f"LR-free (it estimates its own step size; lr multiplies it, {LR_FREE_LR:g} by default), "
                             f"so it has no LR to measure; set training.schedule: constant, or choose "
                             f"training.optimizer: adamw")
        # For a schedule-free optimizer a ramp is the range test's measurement of the LR, not a training schedule: it
        # stays allowed.
        if self.optimizer in SCHEDULE_FREE_OPTIMIZERS and self.schedule not in ("constant", *RAMP_SCHEDULES):
            raise ValueError(f"training.schedule: {self.optimizer} is schedule-free (it averages its iterates instead "
                             f"of decaying the LR), so it trains with a constant LR; set training.schedule: constant "
                             f"(got {self.schedule}), or choose training.optimizer: adamw")
        if self.weights_dtype == "bf16":
            problem = ("method is " + self.method if self.method != "full"
                       else "the text encoder trains too" if self.train_text_encoder
                       else f"{self.optimizer} is schedule-free" if self.optimizer in SCHEDULE_FREE_OPTIMIZERS
                       else f"mixed_precision is {self.mixed_precision}" if self.mixed_precision in ("no", "fp16")
                       else None)
            if problem is not None:
                raise ValueError(f"training.weights_dtype: bf16 holds a full fine-tune's UNet in bf16 with an fp32 "
                                 f"master copy, under bf16 mixed precision with an optimizer that is not "
                                 f"schedule-free, but {problem}; set weights_dtype: fp32")
        return self

    def budget_given(self) -> bool:
        return self.epochs is not None or self.steps is not None

    def default_of(self, name: str) -> Any:
        """A field's default as this section reads it: an LR-free optimizer's unset lr is LR_FREE_LR
        (migrate_training), not the field's 1e-5, so given_settings does not count the lr the migration filled in."""
        if name == "lr" and self.optimizer in LR_FREE_OPTIMIZERS:
            return LR_FREE_LR
        return super().default_of(name)

    def keeps_ema(self, family: Optional[str]) -> bool:
        """training.use_ema resolved for a base model of `family` (training/family_detection.py's names): whether
        this run keeps, validates and saves an EMA of its trained weights. None: the family is not known yet (a hub
        id the CLI has not fetched); auto then reads as on SD 1.x/2.x."""
        if self.use_ema != "auto":
            return bool(self.use_ema)
        return (self.method == "lora" and self.optimizer in EMA_AUTO_OPTIMIZERS
                and self.schedule not in RAMP_SCHEDULES and (family is None or family in EMA_AUTO_FAMILIES))

    def used_params(self, family: Optional[str]) -> dict[str, Any]:
        """What this section's `auto` settings resolved to on this machine and base model family, as every training
        step logs them to MLflow beside the settings themselves."""
        return {"training.mixed_precision_used": resolve_mixed_precision(self.mixed_precision),
                "training.use_ema_used": self.keeps_ema(family)}

    def validates_averaged_weights(self, family: Optional[str]) -> bool:
        """Whether the run validates and saves an average of its weights (its EMA, or a schedule-free optimizer's
        averaged iterates) rather than its raw ones: then nothing averages them again."""
        return self.keeps_ema(family) or self.optimizer in SCHEDULE_FREE_OPTIMIZERS


def migrate_training(data: dict[str, Any]) -> dict[str, Any]:
    """A `training` section as written before training.optimizer: `use_8bit_adam: true` is `optimizer: adamw8bit`
    (false: the default, adamw); with an LR-free optimizer an unset lr is the optimizer's own, LR_FREE_LR. Used on
    every TrainingConfig and on the settings a checkpoint was written with (training/identity.py: check_same_run)."""
    data = dict(data)
    if "use_8bit_adam" in data:
        eight_bit = data.pop("use_8bit_adam")
        chosen = data.get("optimizer")
        if eight_bit is True and chosen not in (None, "adamw8bit"):
            raise ValueError(f"training.use_8bit_adam: true is training.optimizer: adamw8bit, but optimizer is "
                             f"{chosen!r}; keep one of them (use_8bit_adam is the old name)")
        if eight_bit is True:
            data["optimizer"] = "adamw8bit"
        elif eight_bit not in (False, None):
            raise ValueError(f"training.use_8bit_adam must be true or false (got {eight_bit!r}); "
                             "it is the old name of training.optimizer: adamw8bit")
    if data.get("optimizer") in LR_FREE_OPTIMIZERS and data.get("lr") is None:
        data["lr"] = LR_FREE_LR
    return data


def resolve_mixed_precision(setting: str, device: Optional[str] = None) -> Literal["no", "fp16", "bf16"]:
    """What `training.mixed_precision` means on this machine: `auto` is bf16 on a CUDA GPU that supports it
    (compute capability 8.0+: A100, L4, H100, RTX 30xx and newer), fp16 on an older CUDA GPU (T4, V100), and no
    mixed precision elsewhere (CPU, Apple MPS); any other value is kept. `device` ("cuda", "cpu", ...) defaults to
    CUDA when one is visible. bf16 first: its exponent range is fp32's, so it needs no loss scaling."""
    if setting != "auto":
        return setting  # type: ignore[return-value]
    import torch

    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if not str(device).startswith("cuda"):
        return "no"
    return "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"


def visible_gpus() -> int:
    """CUDA devices this process sees (a pod sees the GPUs of its limit); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_processes_per_node(setting: Union[str, int], gpus: Optional[int] = None) -> int:
    """`training.processes_per_node` as a number: auto = one process per visible GPU (1 without a GPU). On a GPU
    node a number above the visible GPUs is refused (two processes would share a device); without a GPU any number
    runs, on gloo (how the multi-process engine is tested on CPU). `gpus` defaults to what this process sees."""
    gpus = visible_gpus() if gpus is None else gpus
    if setting == "auto":
        return max(1, gpus)
    n = int(setting)
    if gpus > 0 and n > gpus:
        raise ConfigError(
            f"training.processes_per_node is {n} but this node sees only {gpus} GPU(s); set it to auto or at most "
            f"{gpus}, or request more GPUs per node (kubernetes.gpu_count)"
        )
    return n


# ---------------------------------------------------------------------------------------------------------------
# Validation and the three runs of the method


class ValidationConfig(_Section):
    # Validate every N epochs (0 turns validation off) or, when set, every N updates instead.
    every_epochs: float = Field(1.0, ge=0)
    every_updates: Optional[int] = Field(None, ge=1)
    # K fixed, stratified timesteps per item, one per 1/K of the noise schedule; on SD3 and Flux K fixed sigmas, the
    # (k + 1/2)/K quantiles of the training density, shifted (val_loss_b<k>: docs/model-families.md).
    timesteps: int = Field(4, ge=1)
    seed: Seed = 0  # noise for item i, bucket k comes from a generator seeded by (seed, i, k)
    # Ramps stop when smoothed validation loss exceeds this multiple of its best (or turns NaN/inf).
    divergence_factor: Optional[float] = Field(DIVERGENCE_FACTOR, gt=1)
    divergence_window: int = Field(3, ge=1)  # points in the centred median used for that check
    # (item, timestep) pairs per validation forward pass. No backward runs, so memory is small; bigger batches cut
    # the per-forward overhead (tiny model, CPU: 16 pairs per pass instead of 8 is ~30% faster). It changes the last
    # bits of the losses (up to ~3e-8 relative: kernels sum in another order), so it is part of what reproduces a
    # curve.
    batch_size: int = Field(32, ge=1)
    # Measure the stabilize subset at every Nth validation only (counted from the update-0 baseline; the last one of
    # a run always). It gives the smooth training loss of the plots and the overfitting gap (val - stabilize) at the
    # step window's best point, both read from the measured rows; 1 measures it with every validation. N > 1 cuts
    # the cost of a validation by up to the stabilize share (at splits 0.2 / 0.2: 4 of 9 forwards) for a sparser
    # stabilize curve (the step window needs 3 points of it for the gap). Without a val set (the train+val retrain)
    # the stabilize subset is the only measurement and is taken every time.
    stabilize_every: int = Field(1, ge=1)

    def enabled(self) -> bool:
        return self.every_updates is not None or self.every_epochs > 0


# The default sweep per method: from a value surely too low to learn to one surely too high. Adapters (LoRA) and
# new embeddings (textual inversion) learn at LRs about 100x those of full fine-tuning (measured on the tiny model:
# LoRA and TI midpoints near 4e-3 and 6e-3 against 4e-5 for full), so one range would cut off their curves.
DEFAULT_LR_RANGE: dict[str, tuple[float, float]] = {
    "full": (1e-7, 1e-2),
    "lora": (1e-6, 1.0),
    "textual_inversion": (1e-6, 1.0),
}


class LRRangeTestConfig(_Section):
    ramp: Literal["linear", "exp"] = "exp"
    # The sweep's ends; None: DEFAULT_LR_RANGE for training.method.
    lr_min: Optional[float] = Field(None, gt=0)
    lr_max: Optional[float] = Field(None, gt=0)
    epochs: int = Field(10, ge=1)
    # Validate every N updates during the test (None: every epoch, as in validation.every_epochs).
    validate_every_updates: Optional[int] = Field(None, ge=1)
    # Where the fine-tune trains between the bounds: the share of the way from lr_low to lr_high on the sweep's axis
    # (log LR on an exp ramp; 0.5 is the geometric mean). Why 0.75: see rangefinder/defaults.py.
    mid_position: float = Field(MID_POSITION, ge=0, le=1)
    # Which point between the bounds lr_mid is: "tuned", mid_position of the way (above); "geometric",
    # sqrt(lr_low * lr_high); "arithmetic", (lr_low + lr_high) / 2 (the EveryDream2 write-up's rule). The LR report
    # shows all three. "tuned" is the default: it is the one bench/discovery_quality measured (see defaults.py).
    midpoint: Literal["tuned", "geometric", "arithmetic"] = MIDPOINT
    # Re-test on a narrower range when the first curve is censored or has fewer points between its bounds.
    zoom: bool = True
    zoom_min_points: int = Field(5, ge=2)

    def range_for(self, method: str) -> tuple[float, float]:
        """(lr_min, lr_max) of the sweep: the values set here, else the method's default."""
        lo, hi = DEFAULT_LR_RANGE[method]
        return (self.lr_min if self.lr_min is not None else lo, self.lr_max if self.lr_max is not None else hi)


class FinetuneConfig(_Section):
    # Train at the midpoint for longer than needed; the step window is found on the way.
    epochs: int = Field(30, ge=1)
    schedule: Literal["constant", "triangular", "triangular2", "exp_range"] = "constant"
    # The step window: smoothed val loss within this relative distance of its minimum.
    tolerance: float = Field(0.02, gt=0, lt=1)
    # Save a checkpoint every N epochs. Every one is kept until the step window is known; then only the one nearest
    # the recommended length stays: it is the model delivered (registered) when retrain is off. 1 (every epoch)
    # makes the delivered model at most half an epoch from the recommendation. Disk: for LoRA and textual inversion
    # a checkpoint is small; for a full fine-tune it is the UNet and its Adam state, ~10 GB per epoch for SD 1.5.
    checkpoint_every_epochs: int = Field(1, ge=1)
    # Successive halving between the range test's lr_mid and lr_high (rangefinder.steps.halving): both train half the
    # epochs, the one with the lower validation loss by then goes on to the end; the fine-tune costs 1.5x its
    # updates, and until the halfway point both candidates' checkpoints are on disk. It picks lr_high where the data
    # are new to the base model and lr_mid where they are not (bench/RESULTS.md, discovery quality). Applies with a
    # constant schedule, validation, and bounds from the range test (a fixed LR has nothing to compare); off: lr_mid.
    successive_halving: bool = True
    # A third halving candidate below lr_mid (rangefinder.analysis.halving.fires_below): when lr_high's best validation
    # loss by the pause is more than this fraction above lr_mid's (or lr_high diverged), lr_below = lr_mid^2 / lr_high
    # trains to the same pause too, and the lower of lr_mid and lr_below goes on. It costs half the fine-tune's
    # updates more where it fires. Unset (the default): two candidates. Tested at 0.1 on 75 LoRA cases fixed
    # beforehand, it fired in 7 and lowered the delivered loss in 3 (median change 0.0 %), failing the rule written
    # before the run (bench/RESULTS.md, "A third halving candidate below lr_mid").
    halving_below_margin: Optional[float] = Field(None, gt=0, lt=10)
    # The cooldown (rangefinder.steps.cooldown): once the window is known, a branch of the run from its checkpoint
    # before the last `cooldown_fraction` of the recommended length trains that stretch again with the LR falling
    # linearly to 0 (a wsd schedule ending at the recommended length), and its weights are delivered when their
    # validation loss is below the window's pick. auto: full fine-tuning only (the decay probe helped there and not for
    # LoRA or textual inversion); on: every method; off (the default): never. Off by default because, measured as
    # shipped on fresh cases (full fine-tuning, seed 5), it was delivered in 1 of 5 and changed no verdict against
    # Prodigy's best, failing the rule written before that run (bench/RESULTS.md, "The cooldown, as shipped"). Costs
    # about cooldown_fraction x the recommended updates more; needs validation and a constant finetune.schedule.
    cooldown: Literal["auto", "on", "off"] = "off"
    cooldown_fraction: float = Field(0.2, gt=0, lt=1)
    # The window average (rangefinder.steps.average): once the window is known, the checkpoints inside it are
    # averaged uniformly and the average validated once; it is delivered when its validation loss is below the
    # window's pick. No training: it reads the window's checkpoints (every checkpoint_every_epochs) and validates
    # once. Needs validation, and does nothing with EMA or a schedule-free optimizer (they validate an average
    # already) or on a TrainJob of several nodes (the step's pod only submits it; the run's note says so). On by
    # default: on bench.versus's 70 saved cases it was delivered in 26 of the 47 where it applied
    # (15 of 19 full, 11 of 17 LoRA, 0 of 11 textual inversion), 2.1 % lower at the median, and met the rule written
    # before that run (bench/RESULTS.md, "The window average").
    average: Literal["on", "off"] = "on"
    # The greedy soup (Wortsman et al. 2022, "Model soups"), part of the window average: from the window's pick, the
    # window's other checkpoints are tried in order of their validation loss, each kept when adding it to the soup
    # (a uniform average of what is kept) lowers the validation loss, at most `soup_tries` tries, one validation
    # each; the lower of the uniform average and the soup is the one delivered when it beats the pick. 0 (the
    # default): no soup. Off because it failed the rule written before it ran: on bench.versus's 53 reproduced saved
    # cases it turned none of (a)'s non-wins into wins, 0.06 % below the uniform average at the median where it was
    # delivered (bench/RESULTS.md, "The greedy soup").
    soup_tries: int = Field(0, ge=0)
    # Which checkpoint is delivered (rangefinder.analysis.earliest_tied). lowest (the default): the lowest validation
    # loss inside the window (or the window average or the cooldown, when they measure lower). earliest_tied: the
    # earliest checkpoint whose validation loss is within 1 % of that lowest; the window average and the cooldown set
    # the band and are not delivered, and a retrain trains that checkpoint's length. Among weights the validation loss
    # cannot tell apart it delivers the one that moved least from the base. Measured for textual inversion on 12 fresh
    # `shapes` cases it followed held-out prompts as well as Prodigy's best, but on the tiny model that checkpoint is
    # almost the initializer (update 8 of 160), and re-counted it lowered the standings against Prodigy and random
    # search; so off by default (bench/RESULTS.md, "Textual inversion's earliest tied checkpoint"). For full
    # fine-tuning and LoRA it was not tested on held-out prompts; re-counted on their saved curves it only turns wins
    # against Prodigy's best into ties and losses (full 53 -> 47 of 100, LoRA 67 -> 63 of 115). Needs validation.
    deliver: Literal["lowest", "earliest_tied"] = "lowest"

    @field_validator("cooldown", "average", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        """YAML 1.1 reads a bare `on` / `off` as true / false: take them as the words they were written as."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


class RetrainConfig(_Section):
    # Off: the registered model is the fine-tune's checkpoint at the recommended length, whose validation loss was
    # measured. On: a second run on train+validation for the recommended epochs (about 1.25x the cost at val_split 0.2,
    # on top of the fine-tune), whose result nobody measured; worth it when the held-out images are a real share of
    # the little data there is. README.md, "Which model is registered".
    enabled: bool = False
    schedule: Literal["constant", "triangular"] = "constant"
    epochs: Optional[int] = Field(None, ge=1)  # None: the recommended epochs from the fine-tune


# sampling.every_validations: "auto", a count of validations, or None (no samples during training).
EveryValidations = Union[Literal["auto"], int, None]

# The pixels every pipeline's image sides are a multiple of: diffusers' SD and SDXL pipelines take multiples of 8 px;
# SD3's and Flux's ask for their patch grid on top (training/geometry.py, ModelGeometry.sampling_multiple).
SAMPLING_MULTIPLE = 8


def sampling_resolution_problem(resolution: int, multiple: int = SAMPLING_MULTIPLE) -> Optional[str]:
    """What is wrong with sampling at `resolution` px where the pipeline renders sides in multiples of `multiple` px;
    None: nothing. One rule and one sentence for both checks: the config's, which holds for every base model and so
    stops a run when its config is read (compile, submit), and the base model's own (geometry.check_sampling_resolution,
    with its family's multiple)."""
    if resolution % multiple == 0:
        return None
    return (f"the pipeline renders sides in multiples of {multiple} px, not {resolution}; set it to a multiple of "
            f"{multiple} (or leave it unset for data.resolution)")


class SamplingConfig(_Section):
    prompts: list[str] = Field(
        default_factory=lambda: ["a red circle on a blue background", "a yellow square on a green background"]
    )
    seeds: list[Seed] = Field(default_factory=lambda: [0, 1])
    num_inference_steps: int = Field(25, ge=1)
    # None: the base model's own, what its diffusers pipeline's __call__ defaults to (SD 1.x/2.x 7.5, SDXL 5.0, SD3 7.0,
    # Flux 3.5: Flux.1-dev's distilled guidance input, not classifier-free guidance; schnell ignores it), resolved
    # where the model's family is known (family_detection.guidance_scale_for). One value for every family would sample
    # some family at a scale its pipeline never uses: Flux.1-dev at 7.5 draws washed-out or burnt images.
    guidance_scale: Optional[float] = Field(None, ge=0)
    scheduler: Optional[str] = None  # a diffusers scheduler class name, e.g. "DDIMScheduler"; None keeps the model's
    resolution: Optional[int] = Field(None, ge=8, le=8192)  # None: data.resolution
    # Samples during the fine-tune (training/samples.py), to see a bad run early: `prompts` x the first
    # `seeds_during_training` of `seeds`, rendered from the current weights (these steps, guidance, scheduler and
    # resolution) at the update-0 baseline, at every Nth validation after it and at the last; saved under the run's
    # `samples/`, logged to MLflow (image key `samples_during_training`, step = update) and shown as the fine-tune
    # report's "samples over training" strip. Unit: validations (validation.every_epochs / every_updates say how
    # often those come). "auto": N such that a run renders about 10 grids after its baseline (the demo's 41
    # validations: every 4th, 11 grids), so the cost is bounded whatever the run's length; null (or off): none.
    # "auto" is on by default on CPU too, measured: on the demo its 11 grids take ~5 s, about 2% of the whole demo
    # and +11% on its fine-tune step (bench/RESULTS.md, "Samples during training"), far from doubling its time.
    every_validations: EveryValidations = "auto"
    # One seed by default: each grid then costs len(prompts) images, and one seed is enough to watch a run change.
    seeds_during_training: int = Field(1, ge=1)

    @field_validator("prompts", "seeds")
    @classmethod
    def _non_empty(cls, v: list) -> list:
        if not v:
            raise ValueError("must list at least one entry")
        return v

    @field_validator("resolution")
    @classmethod
    def _renderable(cls, v: Optional[int]) -> Optional[int]:
        problem = None if v is None else sampling_resolution_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @field_validator("every_validations", mode="before")
    @classmethod
    def _auto_count_or_off(cls, v: Any) -> Any:
        # YAML 1.1 (PyYAML) reads a bare off as False.
        if v is None or v is False or v == "off":
            return None
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        if isinstance(v, str) and v.strip().isdigit() and int(v) >= 1:
            return int(v)
        raise ValueError("must be auto (about 10 grids per run), a whole number of validations >= 1, or null (off) "
                         f"(got {v!r})")

    @model_validator(mode="after")
    def _enough_seeds(self) -> SamplingConfig:
        if self.seeds_during_training > len(self.seeds):
            raise ValueError(f"sampling.seeds_during_training: {self.seeds_during_training} is more than the "
                             f"{len(self.seeds)} seed(s) in sampling.seeds; lower it or list more seeds")
        return self

    def seeds_for_training(self) -> list[int]:
        """The seeds samples during training use: the first `seeds_during_training` of `seeds`."""
        return list(self.seeds[: self.seeds_during_training])


MLFLOW_EXPERIMENT_NAME_CHARS = 500  # mlflow.utils.validation.MAX_EXPERIMENT_NAME_LENGTH


def experiment_name_problem(name: str) -> Optional[str]:
    """Why MLflow refuses `name` as an experiment's (mlflow.utils.validation._validate_experiment_name), after "is",
    with the fix; None when it takes it. An empty name compiled, and stopped the run's first step with
    "MlflowException: Invalid experiment name: ''"."""
    if not name.strip():
        return "is empty or only blank space, which MLflow refuses as an experiment name; give a name"
    if len(name) > MLFLOW_EXPERIMENT_NAME_CHARS:
        return (f"is {len(name)} characters long; MLflow takes an experiment name of at most "
                f"{MLFLOW_EXPERIMENT_NAME_CHARS}")
    return None


class TrackingConfig(_Section):
    # None: $MLFLOW_TRACKING_URI, else sqlite:///mlflow.db in the working folder.
    tracking_uri: Optional[str] = None
    experiment_name: str = "rangefinder"  # $MLFLOW_EXPERIMENT_NAME wins when set
    registered_model_name: Optional[str] = "rangefinder-sd"  # None: log the model but do not register it
    log_every_updates: int = Field(1, ge=1)
    # Seconds a step waits at its end for an MLflow server that stopped answering, before it leaves what the server
    # did not take in its spool (`rangefinder relog`) and ends with a warning. A minute covers a server pod's restart.
    server_wait_seconds: float = Field(60.0, ge=0)
    # The MLflow UI's address as a person's browser opens it (an ingress, a port-forward's http://localhost:5000),
    # which the links a run shows point at: register-model's result, a local run's mlflow_link. None: the tracking
    # URI the steps log to, which on a cluster is often an in-cluster name (mlflow.mlflow.svc) no browser reaches.
    # A local run's `mlflow ui` command serves at this URL's port and path (--static-prefix): an SSH tunnel forwards
    # the same port at both ends.
    ui_url: Optional[str] = None

    @field_validator("tracking_uri")
    @classmethod
    def _no_credentials(cls, v: Optional[str]) -> Optional[str]:
        _refuse_uri_credentials(v)
        return v

    @field_validator("ui_url")
    @classmethod
    def _a_page_without_credentials(cls, v: Optional[str]) -> Optional[str]:
        if v is None or not v.strip():
            return None
        held = uri_credentials(v)
        if held:  # named, never shown: the URL goes into the run's result and its parameters
            raise ValueError(f"holds {held}, which every link the run shows would carry; give the MLflow UI's URL "
                             "alone (the browser signs in itself)")
        return page_base_url(v)

    @field_validator("experiment_name")
    @classmethod
    def _an_experiment_mlflow_takes(cls, v: str) -> str:
        problem = experiment_name_problem(v)
        if problem:
            raise ValueError(f"{problem}, or leave the setting out for rangefinder's own (rangefinder)"
                             if not v.strip() else problem)
        return v

    @field_validator("registered_model_name")
    @classmethod
    def _a_name_mlflow_takes(cls, v: Optional[str]) -> Optional[str]:
        # MLflow's rules (mlflow.utils.validation._validate_model_name), checked here so that a run stops before it
        # trains, not at its register step after hours of training. An empty name stays "do not register".
        if v:
            if not v.strip():
                raise ValueError("is only blank space; give a name, or null (empty) to not register the model")
            if "/" in v or ":" in v or v in (".", ".."):
                raise ValueError(f"MLflow refuses {v!r} as a registered model name: it may not contain '/' or ':' "
                                 "nor be '.' or '..'; use e.g. letters, digits, '-' and '_'")
        return v


# Kubernetes' name rules (k8s.io/apimachinery/pkg/util/validation): what the API server refuses, checked when the
# config is read so a bad name fails at `compile`, not when the pods are created.
_DNS1123_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS1123_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_K8S_SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
_LABEL_NAME = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
K8sNameRule = Literal["label", "subdomain", "secret key", "label key", "label value"]


# rule -> (pattern, most characters, what the name may hold)
_K8S_RULES: dict[str, tuple[re.Pattern[str], int, str]] = {
    "label": (_DNS1123_LABEL, 63, "lower-case letters, digits and '-', starting and ending with a letter or digit"),
    "subdomain": (_DNS1123_SUBDOMAIN, 253, "lower-case letters, digits, '-' and '.', starting and ending with a "
                                           "letter or digit"),
    "secret key": (_K8S_SECRET_KEY, 253, "letters, digits, '-', '_' and '.'"),
    "label value": (_LABEL_NAME, 63, "letters, digits, '-', '_' and '.', starting and ending with a letter or "
                                     "digit, or nothing"),
    "label key": (_LABEL_NAME, 63, "an optional DNS-subdomain prefix and '/', then letters, digits, '-', '_' and "
                                   "'.', starting and ending with a letter or digit"),
}


def kubernetes_name_problem(value: str, rule: K8sNameRule) -> Optional[str]:
    """Why `value` is not a valid Kubernetes name of that kind (RFC 1123 label or subdomain, Secret key, label
    key or value), or None."""
    if rule == "label value" and value == "":
        return None  # a label's value may be empty
    if rule == "label key":
        prefix, _, value = value.rpartition("/")
        if prefix and kubernetes_name_problem(prefix, "subdomain"):
            return f"the prefix {prefix!r} of label key {prefix}/{value} is not a DNS subdomain (RFC 1123)"
    pattern, limit, what = _K8S_RULES[rule]
    kind = {"label": "name (an RFC 1123 label)", "subdomain": "object name (an RFC 1123 subdomain)"}.get(rule, rule)
    if not pattern.fullmatch(value):
        return f"{value!r} is not a valid Kubernetes {kind}: use {what}"
    if len(value) > limit:
        return f"{value!r} is longer than the {limit} characters a Kubernetes {kind} may have"
    return None


def _k8s_name(value: Any, rule: K8sNameRule) -> Any:
    problem = kubernetes_name_problem(value, rule) if isinstance(value, str) else None
    if problem:
        raise ValueError(problem)
    return value


# The pods' resource values, checked when the config is read so a bad one fails at `compile`: on the cluster KFP's
# driver parses the CPU and memory limits as Kubernetes quantities (a bad one: the step's pod is never made) and the
# /dev/shm size with MustParse (a bad one crashes the driver of every training step), and a TrainJob sends all three
# to the API server. kfp's own set_cpu_limit / set_memory_limit refuse some quantities Kubernetes takes ("1.5Gi", the
# decimal-SI "k") and let one through that Kubernetes refuses ("48K"), so the limits take what both take; the size
# takes what ParseQuantity (k8s.io/apimachinery/pkg/api/resource) does, signs aside.
_CPU_LIMIT = re.compile(r"([0-9]*[.])?[0-9]+m?")
_MEMORY_LIMIT = re.compile(r"[0-9]+(Ei|Pi|Ti|Gi|Mi|Ki|E|P|T|G|M)?")
_K8S_QUANTITY = re.compile(r"([0-9]+[.]?[0-9]*|[.][0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE]|[eE][-+]?[0-9]+)?")


def _quantity(value: str, pattern: re.Pattern[str], what: str) -> str:
    if not pattern.fullmatch(value):
        raise ValueError(f"{value!r} is not {what}")
    return value


class Toleration(_Section):
    key: str
    operator: Literal["Equal", "Exists"] = "Equal"
    value: Optional[str] = None
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = None

    @field_validator("key")
    @classmethod
    def _label_key(cls, v: str) -> str:
        return _k8s_name(v, "label key")

    @field_validator("value")
    @classmethod
    def _label_value(cls, v: Optional[str]) -> Optional[str]:
        return _k8s_name(v, "label value")

    @model_validator(mode="after")
    def _exists_names_no_value(self) -> Toleration:
        # The API server's rule (ValidateTolerations): Exists matches the key whatever its value, so it names none; a
        # pod that does is refused when KFP's driver or a TrainJob's JobSet makes it.
        if self.operator == "Exists" and self.value:
            raise ValueError(f"operator Exists tolerates {self.key} whatever its value, so it takes no value (got "
                             f"{self.value!r}); remove the value, or use operator Equal")
        return self


# Argo and KFP keep TTLs and deadlines in int32 fields.
_INT32_MAX = 2**31 - 1


class KubernetesConfig(_Section):
    image: Optional[str] = None  # None: the trainer image tagged with the package version (images/)
    accelerator_type: str = "nvidia.com/gpu"
    gpu_count: int = Field(1, ge=0)
    cpu_limit: str = "8"
    memory_limit: str = "48Gi"
    # What each step on the CPU image (resolve-config, prepare-dataset, choose-lr, register-model, record-status)
    # requests. A namespace with a ResourceQuota on cpu or memory (a Kubeflow Profile's resourceQuotaSpec) refuses a
    # pod that requests none unless a LimitRange fills them in; the training steps request their limits. No limit is
    # set, so a step that needs more (a single file converted by resolve-config) is not killed for it.
    cpu_request: str = "500m"
    memory_request: str = "2Gi"
    node_selector: dict[str, str] = Field(default_factory=lambda: {"rangefinder.io/pool": "gpu"})
    tolerations: list[Toleration] = Field(
        default_factory=lambda: [Toleration(key="nvidia.com/gpu", operator="Exists", effect="NoSchedule")]
    )
    data_pvc: Optional[str] = "rangefinder-data"  # mounted at data_mount_path in every step
    data_mount_path: str = "/data"
    mlflow_secret: Optional[str] = "mlflow-credentials"  # its keys become environment variables
    # The keys of mlflow_secret, each exposed as the environment variable of the same name (manifests/pipeline-namespace
    # ships the template). USERNAME/PASSWORD may stay empty: MLflow sends basic auth only when both are set.
    mlflow_secret_keys: list[str] = Field(
        default_factory=lambda: ["MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"]
    )
    # The MLflow server of manifests/mlflow as seen from inside the cluster (Service `mlflow`, namespace `rangefinder`).
    mlflow_tracking_uri: str = "http://mlflow.rangefinder.svc.cluster.local:5000"
    # Labels every step's pod carries (an owner, a cost centre); none by default.
    pod_labels: dict[str, str] = Field(default_factory=dict)
    # Labels the pods that talk to MLflow carry (the steps that log to it, and a TrainJob's nodes): manifests/mlflow's
    # NetworkPolicy admits only pods with them. prepare-dataset and choose-lr never reach MLflow and go without.
    mlflow_client_labels: dict[str, str] = Field(default_factory=lambda: {"rangefinder.io/mlflow-client": "true"})
    # The runs' Kubernetes service account (manifests/pipeline-namespace grants it least-privilege RBAC).
    service_account: Optional[str] = "rangefinder-pipeline-runner"
    cpu_image: Optional[str] = None  # None: the CPU image for the cheap steps, tagged with the package version
    image_pull_secrets: list[str] = Field(default_factory=list)
    shm_size: str = "8Gi"  # /dev/shm for data loader workers
    retries: int = Field(2, ge=0)  # of the GPU steps: training resumes from its newest checkpoint, sampling reruns
    # A Secret whose key `hf_token_secret_key` becomes HF_TOKEN in the steps that load the base model, for gated or
    # private hub models (manifests/pipeline-namespace ships the template). Mounted as optional: a run on a public
    # model works without it. None: no token. Never logged.
    hf_token_secret: Optional[str] = "hf-token"
    hf_token_secret_key: str = "HF_TOKEN"
    # The pipeline run's lifetime on the cluster, compiled into the package as KFP 2.17's `dsl.PipelineConfig` (Argo's
    # ttlStrategy and activeDeadlineSeconds). A TTL deletes the run's Workflow and pods that many seconds after it
    # ends; KFP's run record, the artifacts and MLflow keep everything. None: no TTL / no deadline. A week by
    # default, so a failed run's pods can still be read. The success / failure TTLs win over the finished one.
    ttl_seconds_after_finished: Optional[int] = Field(7 * 24 * 3600, ge=0, le=_INT32_MAX)
    ttl_seconds_after_success: Optional[int] = Field(None, ge=0, le=_INT32_MAX)
    ttl_seconds_after_failure: Optional[int] = Field(None, ge=0, le=_INT32_MAX)
    # The longest a whole pipeline run may take before KFP stops it. None: no limit (a long SDXL fine-tune is not cut
    # off by a default; set one to cap a run's cost). The training steps' TrainJobs have distributed.timeout_hours.
    active_deadline_seconds: Optional[int] = Field(None, ge=1, le=_INT32_MAX)

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _no_credentials(cls, v: str) -> str:
        _refuse_uri_credentials(v)
        return v

    # Each value that becomes the name of a Kubernetes object, key or label in the pod specs.
    @field_validator("data_pvc", "mlflow_secret", "service_account", "hf_token_secret")
    @classmethod
    def _object_name(cls, v: Optional[str]) -> Optional[str]:
        return _k8s_name(v, "subdomain")

    @field_validator("image_pull_secrets")
    @classmethod
    def _secret_names(cls, v: list[str]) -> list[str]:
        return [_k8s_name(n, "subdomain") for n in v]

    @field_validator("mlflow_secret_keys")
    @classmethod
    def _secret_keys(cls, v: list[str]) -> list[str]:
        return [_k8s_name(k, "secret key") for k in v]

    @field_validator("hf_token_secret_key")
    @classmethod
    def _secret_key(cls, v: str) -> str:
        return _k8s_name(v, "secret key")

    @field_validator("cpu_limit", "cpu_request")
    @classmethod
    def _cpu_quantity(cls, v: str) -> str:
        return _quantity(v, _CPU_LIMIT, "a CPU count KFP takes: use cores (8, 0.5) or millicores (500m)")

    @field_validator("memory_limit", "memory_request")
    @classmethod
    def _memory_quantity(cls, v: str) -> str:
        return _quantity(v, _MEMORY_LIMIT, "a memory size KFP and Kubernetes take: use a whole number with Ki, Mi, Gi "
                                           "or Ti (powers of 1024) or M, G or T (of 1000), e.g. 48Gi")

    @field_validator("shm_size")
    @classmethod
    def _shm_size(cls, v: str) -> str:
        return _quantity(v, _K8S_QUANTITY, "a Kubernetes quantity: use a number with Ki, Mi, Gi (powers of 1024) or "
                                           "M, G (of 1000), e.g. 8Gi")

    @field_validator("accelerator_type")
    @classmethod
    def _extended_resource(cls, v: str) -> str:
        # KFP's driver puts it in the pod's limits as it is (so does a TrainJob's resourcesPerNode), where the API
        # server takes only a device plugin's fully qualified resource name (k8s.io/api/core/v1,
        # IsExtendedResourceName): no "gpu", no "NVIDIA_TESLA_T4".
        if "/" not in v or "kubernetes.io/" in v or kubernetes_name_problem(v, "label key"):
            raise ValueError(f"{v!r} is not a device plugin's resource name; use the fully qualified name the GPU "
                             "nodes list under Allocatable (kubectl describe node), e.g. nvidia.com/gpu or amd.com/gpu")
        return v

    @field_validator("data_mount_path")
    @classmethod
    def _mount_path(cls, v: str) -> str:
        # Every step mounts the data volume there, and the caches, the work folder and the spool are paths under it:
        # a relative path is no mount point (the container does not start), and / or /dev would hide the image's
        # files or the GPUs' device files and /dev/shm.
        path = PurePosixPath(v)
        if not path.is_absolute() or ".." in path.parts or path.parent == path or path.is_relative_to("/dev"):
            raise ValueError(f"{v!r} is not a place to mount the data volume; use an absolute path other than / and "
                             "not under /dev, e.g. /data")
        return v

    @field_validator("node_selector", "pod_labels", "mlflow_client_labels")
    @classmethod
    def _labels(cls, v: dict[str, str]) -> dict[str, str]:
        for key, value in v.items():
            _k8s_name(key, "label key")
            _k8s_name(value, "label value")
        return v


class DistributedConfig(_Section):
    """Training across nodes: with num_nodes > 1 the training steps submit a Kubeflow Trainer v2 TrainJob
    (docs/scaling.md); each node runs training.processes_per_node processes."""

    num_nodes: int = Field(1, ge=1)
    # The (Cluster)TrainingRuntime the TrainJob refers to; Trainer v2 ships `torch-distributed` (torchrun per node).
    runtime: str = "torch-distributed"
    # The TrainJob's namespace; None: the namespace the step's pod runs in.
    namespace: Optional[str] = None
    # How long the TrainJob may run (its activeDeadlineSeconds); the step then deletes it and fails.
    timeout_hours: float = Field(72.0, gt=0)
    # Seconds between two reads of the TrainJob's status while the step waits (each read is a few GETs).
    poll_seconds: float = Field(15.0, gt=0)

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: Optional[str]) -> Optional[str]:
        return _k8s_name(v, "label")

    @field_validator("runtime")
    @classmethod
    def _runtime(cls, v: str) -> str:
        return _k8s_name(v, "subdomain")


# ---------------------------------------------------------------------------------------------------------------
# The whole pipeline


class RangefinderConfig(_Section):
    data: DataConfig = Field(default_factory=DataConfig)
    split: SplitConfig = Field(default_factory=SplitConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    validation: ValidationConfig = Field(default_factory=ValidationConfig)
    lr_range_test: LRRangeTestConfig = Field(default_factory=LRRangeTestConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    retrain: RetrainConfig = Field(default_factory=RetrainConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    kubernetes: KubernetesConfig = Field(default_factory=KubernetesConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    # A learning rate chosen by hand skips discovery (range test and zoom); so does an LR-free training.optimizer,
    # which then trains at this lr, or at LR_FREE_LR when it is unset (pipeline_lr).
    lr: Optional[float] = Field(None, gt=0)
    # How discovery measures the LR (lr_finder_for): range_test (the LR range test, then a zoom when needed),
    # prodigy_step (a Prodigy run of finetune.epochs at lr 1.0 with diffusers' recipe; the fine-tune then trains at
    # the step size d x lr it ended on, times PRODIGY_STEP_FACTOR), or auto, the default (auto_lr_finder: by the base
    # model's family and the method, LR_FINDER_AUTO_PRODIGY: prodigy_step for full and lora on SD3 and Flux and for
    # full on SDXL, the range test everywhere else). Nothing to do with a fixed lr or an LR-free training.optimizer.
    lr_finder: LRFinder = "auto"
    # The multiple of Prodigy's final step size the prodigy_step finder's fine-tune trains at; None (the default):
    # PRODIGY_STEP_FACTOR's, by the base model's family and the method (4 on SDXL's and SD3's full fine-tune, else 1).
    # Those were measured on tiny models: 1 trains at the step size itself on any model.
    prodigy_step_factor: Optional[float] = Field(None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _cross(self) -> RangefinderConfig:
        lo, hi = self.lr_range_test.range_for(self.training.method)
        if hi <= lo:
            raise ValueError(
                f"lr_range_test.lr_max ({hi:g}) must be above lr_range_test.lr_min ({lo:g}) for method "
                f"{self.training.method}; set both, or leave them unset for the method's default range"
            )
        # Asked for by name, the Prodigy finder beside the range test's bounds is a contradiction; under auto (the
        # default) the bounds are a warning where it picks prodigy_step (auto_finder_conflicts), so no config turns
        # invalid on an SD3, Flux or SDXL model.
        bounds_set = self.range_test_bounds_given()
        if bounds_set and self.pipeline_lr() is None and self.lr_finder == "prodigy_step":
            raise ValueError(
                f"lr_finder: prodigy_step reads the LR off a Prodigy run, so {' and '.join(bounds_set)} (the range "
                "test's bounds) would not be used; remove them, or set lr_finder: range_test"
            )
        if self.prodigy_step_factor is not None and self.pipeline_lr() is None and self.lr_finder == "range_test":
            raise ValueError(
                f"prodigy_step_factor ({self.prodigy_step_factor:g}) multiplies the step size the prodigy_step finder "
                "reads, but lr_finder: range_test measures the LR with the range test; remove prodigy_step_factor, "
                "or set lr_finder: prodigy_step (or auto)"
            )
        optimizer = self.training.optimizer
        if optimizer in LR_FREE_OPTIMIZERS and bounds_set:
            raise ValueError(
                f"lr_range_test.lr_min/lr_max ask for a range test, but training.optimizer {optimizer} is LR-free (it "
                "estimates its own step size; the pipeline skips the range test for it); remove lr_range_test's "
                "bounds, or choose training.optimizer: adamw"
            )
        if optimizer in SCHEDULE_FREE_OPTIMIZERS:
            for where, schedule in (("finetune", self.finetune.schedule), ("retrain", self.retrain.schedule)):
                if schedule != "constant":
                    raise ValueError(f"{where}.schedule: {optimizer} is schedule-free, so it trains with a constant "
                                     f"LR; set {where}.schedule: constant (got {schedule})")
        if (not self.split.holds_out_validation() and self.lr is None
                and optimizer not in LR_FREE_OPTIMIZERS):
            raise ValueError(
                "split.val_split: discovery measures validation loss, so it needs val_split > 0 "
                "(or split.val_dir, or a fixed lr to skip discovery)"
            )
        return self

    def pipeline_lr(self) -> Optional[float]:
        """The LR the pipeline trains at without discovering one: the lr set by hand, else an LR-free optimizer's
        own; None: discover it (range test)."""
        if self.lr is not None:
            return self.lr
        return LR_FREE_LR if self.training.optimizer in LR_FREE_OPTIMIZERS else None

    def unresolved(self) -> RangefinderConfig:
        """This config as a new run starts from it: without model.resolved_dir and model.resolved_revision, which a
        run's first step sets for its base model (a config copied from an earlier run, its config.yaml, holds that
        run's), so that model.base_model is resolved afresh."""
        if self.model.resolved_dir is None and self.model.resolved_revision is None:
            return self  # as it is, the settings it was given (given_settings) too
        model = self.model.model_copy(update={"resolved_dir": None, "resolved_revision": None})
        return self.model_copy(update={"model": model})

    def range_test_bounds_given(self) -> list[str]:
        """The range test's bounds set in this config (lr_range_test.lr_min / lr_max), by name."""
        return [f"lr_range_test.{k}" for k in ("lr_min", "lr_max") if getattr(self.lr_range_test, k) is not None]

    def lr_finder_for(self, family: str) -> MeasuredBy:
        """How discovery measures the LR of training.method on a base model of `family` (resolve-config reads it off
        the resolved model): lr_finder, with auto resolved (auto_lr_finder). Only used when discovery runs
        (pipeline_lr() is None)."""
        if self.lr_finder == "auto":
            return auto_lr_finder(family, self.training.method)
        return self.lr_finder

    def prodigy_step_factor_for(self, family: Optional[str]) -> float:
        """The multiple of its step size the prodigy_step finder trains at, on a base model of `family`: the config's
        prodigy_step_factor where it is set, else PRODIGY_STEP_FACTOR's for the family and training.method."""
        if self.prodigy_step_factor is not None:
            return self.prodigy_step_factor
        return prodigy_step_factor(family, self.training.method)

    def prodigy_step_factor_source(self) -> str:
        """Where prodigy_step_factor_for's factor comes from, in words for a report (the table's start with
        analysis.prodigy_step.FACTOR_FROM_TABLE, which the report reads)."""
        return ("prodigy_step_factor, as set in the config" if self.prodigy_step_factor is not None
                else "config.PRODIGY_STEP_FACTOR, for this family and method")


# The demo's prompts: one per shape, each colour once, on the white background of the demo's data. 4 prompts x 3
# seeds = 12 images per column of the grid, enough for its prompt-following scores to stand above their noise.
DEMO_PROMPTS = ("a red circle on a white background", "a blue square on a white background",
                "a black triangle on a white background", "a green diamond on a white background")


def demo_config(**overrides: Any) -> RangefinderConfig:
    """Settings for the embedded default: the tiny model at 32 px, sized to finish on 2 CPU cores in minutes."""
    base: dict[str, Any] = {
        "data": {"resolution": 32},
        "training": {"batch_size": 4, "lr": 1e-4, "max_grad_norm": 1.0},
        "validation": {"every_epochs": 1.0, "timesteps": 4},
        # The tiny model's validation loss falls from ~2e-5 to its minimum near ~1e-3 and blows up past ~1e-2
        # (measured at batch 4). 3 epochs of 16 images validated every update: 13 points in 12 updates. Against 6
        # epochs validated every 2 (13 points in 24), the discovery bench found the better LR more often (11 vs 9
        # of 15 cases within 3 % of an 8-LR grid's best; bench/RESULTS.md).
        "lr_range_test": {"ramp": "exp", "lr_min": 1e-5, "lr_max": 1e-2, "epochs": 3, "validate_every_updates": 1},
        "finetune": {"epochs": 150},
        "sampling": {"prompts": list(DEMO_PROMPTS), "seeds": [0, 1, 2], "scheduler": "DDIMScheduler",
                     "num_inference_steps": 20, "guidance_scale": 5.0},
    }
    return parse_config(_deep_merge(base, overrides))


# What `rangefinder demo` (`make demo`) changes on top of demo_config, to finish in at most 3 minutes on 2 cores
# (issue 35). The fine-tune validates and checkpoints every 2nd epoch instead of every one (a validation is a forward
# pass over 8 images x 4 timesteps, about 2 updates' worth), and trains 80 epochs instead of 150: the 150-epoch run's
# window recommended 99, the 100-epoch one's 91 and this one's 73 (still_improving false each time), and its chosen
# model still draws the prompts' colours (colour 0.48 -> 0.76, shape 0.05 -> 0.19; docs/demo-learning.md). The
# fine-tune's updates are most of the demo's time (with successive halving, 1.5x the budget: 480 of 320 updates
# here). Kept apart from demo_config, whose every-epoch cadence the step tests and the benches count with.
DEMO_RUN: dict[str, Any] = {"validation": {"every_epochs": 2.0},
                            "finetune": {"epochs": 80, "checkpoint_every_epochs": 2}}


def demo_run_config(**overrides: Any) -> RangefinderConfig:
    """The settings `rangefinder demo` runs with: demo_config, DEMO_RUN, then `overrides`."""
    return demo_config(**_deep_merge(DEMO_RUN, overrides))


def _deep_merge(a: dict, b: dict) -> dict:
    out = dict(a)
    for k, v in b.items():
        out[k] = _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


# ---------------------------------------------------------------------------------------------------------------
# Reading a config: bounded, and strict about what YAML lets slip

# A config holds settings, not data. These bounds are far above any real config (the shipped ones are ~2 KiB with
# lists of a few entries) and keep a mistaken or hostile one from growing the compiled pipeline, which carries
# the whole config as a parameter default, into hundreds of MB.
MAX_CONFIG_BYTES = 1 << 20  # 1 MiB of YAML
MAX_STRING_CHARS = 4096  # one value: PATH_MAX on Linux; prompts are cut at 77 CLIP tokens anyway
MAX_LIST_ITEMS = 1000  # one list or mapping: prompts, seeds, LoRA target modules, node selector, ...
MAX_VALUES = 20_000  # values in the whole config; also bounds YAML aliases that repeat a list inside itself


class _ConfigLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *defaults` is meant to be overridden by the keys beside it
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    raise ConfigError(f"key {key!r} appears twice in one mapping, on lines {first_line[key]} and "
                                      f"{line} (YAML would silently keep the last); remove one")
                first_line[key] = line
            except TypeError:
                pass  # an unhashable key: SafeLoader itself says so below
        return super().construct_mapping(node, deep=deep)


def read_config_file(path: str | Path) -> dict:
    """The raw sections of a YAML config file; ConfigError naming the file for anything that is not a sane config."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {p} is a folder; pass the path of a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; pass the path of a YAML file")
    with open(p, "rb") as f:
        data = f.read(MAX_CONFIG_BYTES + 1)  # never more, whatever the file claims to be
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_BYTES // 1024} KiB; a config holds settings, "
                          "not data: keep prompts and file lists short and put data in the dataset folder")
    try:
        raw = yaml.load(data, Loader=_ConfigLoader) or {}
    except ConfigError as e:
        raise ConfigError(f"config file {p}: {e}") from None
    except yaml.YAMLError as e:
        _refuse_toml(p, data)
        raise ConfigError(f"config file {p} is not valid YAML: {_yaml_problem(e)}") from None
    except RecursionError:
        raise ConfigError(f"config file {p} nests too deeply to be a config; a config has sections of settings "
                          "(data:, training:, ...) one or two levels deep") from None
    if not isinstance(raw, dict):
        _refuse_toml(p, data)
        raise ConfigError(f"config file {p} must hold a mapping of sections (data:, training:, ...)")
    return raw


def _refuse_toml(p: Path, data: bytes) -> None:
    """ConfigError when a config that is no YAML mapping is TOML, as kohya sd-scripts' --config_file and
    --dataset_config are: it was told to check its brackets and quotes, or to hold a mapping of sections. Names
    where its keys that rangefinder knows by other names (OTHER_TOOLS_NAMES) go. Python 3.10 has no TOML reader:
    there the YAML line stands."""
    if sys.version_info >= (3, 11):  # the whole body under it, so that mypy's 3.10 skips it
        import tomllib

        try:
            toml = tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError):
            return
        if not toml:
            return
        known = [f"{key} -> {OTHER_TOOLS_NAMES[key]}" for key in toml if key in OTHER_TOOLS_NAMES]
        raise ConfigError(
            f"config file {p} is TOML (as kohya sd-scripts' configs are), and rangefinder reads YAML: sections of "
            "settings (data:, training:, ...) as in configs/example.yaml, every setting documented in "
            "src/rangefinder/config.py" + (f"; of this file's keys, {', '.join(known)}" if known else "")
        )


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's complaint on one line, where it is in the file (PyYAML's own text spans lines and calls the file
    "<byte string>"), and what usually fixes it."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:
        mark = e.problem_mark
        what = e.problem or "a syntax error"
        if e.context:
            what += f" ({e.context})"
        fix = ("indent with spaces, not tabs" if "'\\t'" in what
               else "check the brackets, quotes and indentation there (quote a value holding ': ' or ' #')")
        return f"line {mark.line + 1}, column {mark.column + 1}: {what}; {fix}"
    if isinstance(e, yaml.reader.ReaderError):
        return f"offset {e.position}: {e.reason}; save it as UTF-8 text without control characters"
    return " ".join(str(e).split())


def _check_raw(raw: Any) -> None:
    """ConfigError naming (by its dotted path) the first string, list or mapping over its bound, or string holding a
    URL with credentials; or a config with more values in all than MAX_VALUES; or, in one line, every value that is
    the mark of a hidden secret (a run's config.yaml read back from MLflow). Iterative, so a deep structure cannot
    exhaust the stack."""
    seen = 0
    masked: list[str] = []
    todo: list[tuple[str, Any]] = [("", raw)]
    while todo:
        where, value = todo.pop()
        seen += 1
        if seen > MAX_VALUES:
            raise ConfigError(f"the config holds more than {MAX_VALUES} values; a config holds settings, not data "
                              "(check for a list repeated through YAML aliases)")
        name = where or "config"
        if isinstance(value, str) and len(value) > MAX_STRING_CHARS:
            raise ConfigError(f"{name}: a string of {len(value)} characters, more than the {MAX_STRING_CHARS} a "
                              "setting may have; shorten it")
        if isinstance(value, str) and "://" in value:
            # Any URL, not only the tracking URIs: the whole config is a parameter of the compiled pipeline, printed
            # by kfp.local and kept in every step's executor output.
            try:
                # model.base_model's said to set MLFLOW_TRACKING_PASSWORD: only the MLflow URIs' fix is MLflow's.
                _refuse_uri_credentials(value, _MLFLOW_FIX if where in MLFLOW_URI_SETTINGS
                                        else _UI_FIX if where == "tracking.ui_url" else _OTHER_FIX)
            except ValueError as e:
                raise ConfigError(f"{name}: {e}") from None
        if value == REDACTED:
            masked.append(name)
        if isinstance(value, (dict, list)) and len(value) > MAX_LIST_ITEMS:
            raise ConfigError(f"{name}: {len(value)} entries, more than the {MAX_LIST_ITEMS} a setting may have; "
                              "shorten it")
        if isinstance(value, dict):
            for k, v in value.items():
                todo.append((f"{where}.{k}" if where else str(k), v))
                todo.append((f"{where}.{k} (the key)" if where else f"{k} (the key)", k))
        elif isinstance(value, list):
            todo.extend((f"{name}.{i}", v) for i, v in enumerate(value))
    if masked:
        raise ConfigError(f"{', '.join(sorted(masked))}: {REDACTED} stands where MLflow's copy of a run's config hid a "
                          "secret; write the setting's value in its place")


def load_config(path: str | Path | None = None, overrides: Optional[dict] = None) -> RangefinderConfig:
    """Read a YAML file (sections as in RangefinderConfig), apply overrides, validate; ConfigError on problems."""
    raw: dict = read_config_file(path) if path is not None else {}
    if overrides:
        for name, section in overrides.items():
            # The merge would put the flags' section in the place of a file's `training: 3` or empty `training:`,
            # dropping it without a word where the same file without flags is refused.
            if isinstance(section, dict) and name in raw and not isinstance(raw[name], dict):
                raise ConfigError(f"{name}: Input should be a section of settings (indented `key: value` lines "
                                  f"under {name}:) (got {raw[name]!r}); fix it or remove the line")
        raw = _deep_merge(raw, overrides)
    return parse_config(raw)


def parse_config(raw: dict) -> RangefinderConfig:
    """Validate raw sections (from YAML, JSON or the KFP parameters); ConfigError with one line per problem."""
    _check_raw(raw)
    try:
        return RangefinderConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e)) from None


# What a step's run_<step>(cfg, ...) takes: a RangefinderConfig, or its sections as a mapping (as_config).
ConfigLike = Union["RangefinderConfig", Mapping[str, Any]]


def as_config(cfg: ConfigLike) -> RangefinderConfig:
    """`cfg` as a RangefinderConfig: one already is returned as it is; a mapping of its sections (a dict written in a
    notebook, a config file read with yaml.safe_load) is validated as a config file is (parse_config: ConfigError
    naming each bad setting). Anything else is a TypeError naming what to pass, not an AttributeError from deep
    inside the step it was handed to."""
    if isinstance(cfg, RangefinderConfig):
        return cfg
    if isinstance(cfg, Mapping):
        return parse_config(dict(cfg))
    raise TypeError(f"cfg is a {type(cfg).__name__}; pass a RangefinderConfig (rangefinder.config.load_config(path) "
                    "reads a config file) or a dict of its sections, e.g. {'training': {'method': 'lora'}}")


def given_settings(section: BaseModel, prefix: str = "", *, defaults_too: bool = False) -> list[str]:
    """Dotted names of the settings `section` was given (pydantic's model_fields_set, section by section), in field
    order: only those given a value other than the default, unless `defaults_too` (a setting written out at its
    default still says the user meant it: setting_conflicts). Not in a section written out whole, though: each of its
    own settings given (its sub-sections aside), as in a config dumped with its defaults (the run's config.yaml in
    MLflow), says nothing of which ones a person meant, so there only the values other than the defaults count."""
    out: list[str] = []
    whole = all(name in section.model_fields_set for name in type(section).model_fields
                if not isinstance(getattr(section, name), BaseModel))
    for name, field in type(section).model_fields.items():
        if name not in section.model_fields_set:
            continue
        value = getattr(section, name)
        if isinstance(value, BaseModel):
            out += given_settings(value, f"{prefix}{name}.", defaults_too=defaults_too)
        elif (defaults_too and not whole) or value != (section.default_of(name) if isinstance(section, _Section)
                                                       else field.get_default(call_default_factory=True)):
            out.append(prefix + name)
    return out


def auto_finder_conflicts(cfg: RangefinderConfig, family: str) -> list[str]:
    """The setting auto's choice for this run leaves unused, as one line: the range test's bounds where lr_finder auto
    measures the LR with prodigy_step on a base model of `family`, or prodigy_step_factor where it measures it with
    the range test; none otherwise. A warning, not an error: auto is the default, and a config written for an SD 1.x
    model stays valid on an SD3 one, and the other way round."""
    if cfg.pipeline_lr() is not None or cfg.lr_finder != "auto":
        return []
    method, model = cfg.training.method, f"this {FAMILY_NAMES[family]} base model"
    if auto_lr_finder(family, method) != "prodigy_step":
        return [] if cfg.prodigy_step_factor is None else [
            f"prodigy_step_factor ({cfg.prodigy_step_factor:g}) is not used: on {model}, lr_finder auto measures the "
            f"LR of method {method} with the range test, not prodigy_step; set lr_finder: prodigy_step to use it, or "
            "remove it"]
    bounds = cfg.range_test_bounds_given()
    if not bounds:
        return []
    return [f"the range test's bounds ({', '.join(bounds)}) are not used: on {model}, lr_finder auto measures the LR "
            f"of method {method} with prodigy_step, not the range test; set lr_finder: range_test to use them, or "
            "remove them"]


def check_pipeline_config(cfg: RangefinderConfig, family: Optional[str] = None) -> None:
    """ConfigError for a config the pipeline cannot run though `rangefinder train` can: the LR range test reads the
    LR off its validation curve, so discovery by the range test needs validation on. Refused when the pipeline is
    compiled, run locally or resolved, not when its range-test step meets it after importing the data and resolving
    the base model. Not in RangefinderConfig's validators: `train --validate-every-epochs 0` is a plain run.
    `family`: the base model's where it is known (training.family_detection.family_of; resolve-config's resolved
    one); None: not yet (a hub id), and `lr_finder: auto` for full fine-tuning and LoRA may then measure with
    Prodigy's step size (SD3, Flux), so only a range test certain for every family is refused."""
    val, rt = cfg.validation, cfg.lr_range_test
    if family is not None:
        measured: Optional[str] = cfg.lr_finder_for(family)
    elif cfg.lr_finder != "auto":
        measured = cfg.lr_finder
    else:  # auto: the range test on every family for textual inversion only
        measured = "range_test" if cfg.training.method == "textual_inversion" else None
    if rt.validate_every_updates is not None or cfg.pipeline_lr() is not None or measured != "range_test":
        return
    if not val.enabled():
        raise ConfigError(
            "validation.every_epochs: 0 turns validation off, but the LR range test measures validation loss; set "
            "validation.every_epochs > 0 (or lr_range_test.validate_every_updates, or a fixed lr to skip discovery)"
        )
    # The sweep validates at its start, at each every_epochs boundary it crosses and at its end (planning.
    # planned_validations); analysis.lr_bounds reads no bounds off fewer than 3 points, after the whole sweep trained.
    if val.every_updates is None and val.every_epochs >= rt.epochs:
        raise ConfigError(
            f"validation.every_epochs ({val.every_epochs:g}) is not below lr_range_test.epochs ({rt.epochs}), so the "
            "range test validates only at its start and end, and its LR bounds need at least 3 points; set "
            f"validation.every_epochs below {rt.epochs} (or lr_range_test.validate_every_updates)"
        )


# AdamW's settings (training.optimizer adamw and adamw8bit); the other optimizers start from their packages' defaults.
ADAMW_SETTINGS = ("training.adam_beta1", "training.adam_beta2", "training.adam_epsilon", "training.weight_decay")


# An LR-free optimizer's lr at or below this is read as an LR meant for AdamW: its multiplier of the step size the
# optimizer estimates is 1.0 (0.5 or so to train more gently), and kohya's and diffusers' Prodigy recipes set 1.0.
LR_FREE_LR_SUSPECT = 0.01


def lr_free_lr_problem(optimizer: str, lr: Optional[float], name: str) -> Optional[str]:
    """A warning's line where `lr` (the setting `name`) beside an LR-free `optimizer` looks like an AdamW LR: Prodigy
    at lr 1e-4 trains at a ten-thousandth of the step size it estimates, and learns next to nothing, without a word.
    None otherwise. (The other way round, AdamW at Prodigy's 1.0, `train` refuses.)"""
    if optimizer not in LR_FREE_OPTIMIZERS or lr is None or lr > LR_FREE_LR_SUSPECT:
        return None
    return (f"{name}: {lr:g} beside the LR-free optimizer {optimizer} multiplies the step size it estimates "
            f"({LR_FREE_LR:.1f} trains at that step size), so this trains at {lr:g} x it: an AdamW LR does not carry "
            f"over; leave {name} out (or set {LR_FREE_LR:.1f}), or choose training.optimizer: adamw to train at {lr:g}")


def setting_conflicts(cfg: RangefinderConfig, family: Optional[str] = None) -> list[str]:
    """One line for each pair of settings in `cfg` where one cancels the other, so neither is silently dropped.

    Only settings the config itself gives count (given_settings, at their defaults too, but not in a section written
    out whole, as a dumped config is): a default that another setting switches off is the documented behaviour, not
    a conflict. A section or group of settings left unused is named only for values other than its defaults.
    `family` is the base model's when it is known without fetching anything (training.family_detection.family_of);
    None: it is not (a hub id not fetched yet), and the lines that depend on it are left to resolve-config, which
    knows it (auto_finder_conflicts).
    """
    given = given_settings(cfg, defaults_too=True)
    # A section (or group of settings) another setting leaves unused: only values other than the defaults count, as a
    # section at its defaults changes nothing whoever reads it.
    changed = given_settings(cfg)
    ft, rt, split, val = cfg.finetune, cfg.lr_range_test, cfg.split, cfg.validation
    lines = []
    lr_free = lr_free_lr_problem(cfg.training.optimizer, cfg.lr, "lr")  # the pipeline's: training.lr is train's
    if lr_free:
        lines.append(lr_free)
    range_test_given = [g.removeprefix("lr_range_test.") for g in changed if g.startswith("lr_range_test.")]
    if cfg.lr is not None and range_test_given:
        lines.append(f"lr: {cfg.lr:g} is fixed, so no range test runs and the lr_range_test section "
                     f"({', '.join(sorted(range_test_given))}) is not used; remove lr to discover the LR, or the "
                     "section")
    if cfg.pipeline_lr() is not None:  # no LR is discovered, so the finder's settings go unused
        why = (f"lr: {cfg.lr:g} is fixed" if cfg.lr is not None
               else f"training.optimizer {cfg.training.optimizer} is LR-free")
        if "lr_finder" in given:
            lines.append(f"lr_finder: {cfg.lr_finder} is not used: {why}, so no LR is discovered; remove lr_finder, "
                         "or the fixed lr")
        if cfg.prodigy_step_factor is not None:
            lines.append(f"prodigy_step_factor ({cfg.prodigy_step_factor:g}) is not used: {why}, so no LR is "
                         "discovered; remove prodigy_step_factor, or the fixed lr")
    if family is not None:
        lines += auto_finder_conflicts(cfg, family)
    tc = cfg.training
    # Another method's section (a config written out whole has both).
    for method, section in (("lora", "training.lora."), ("textual_inversion", "training.textual_inversion.")):
        named = [g.removeprefix(section) for g in changed if g.startswith(section)]
        if named and tc.method != method:
            lines.append(f"{section.rstrip('.')} ({', '.join(named)}) is not used: training.method is {tc.method}; "
                         f"set method {method}, or remove the {section.split('.')[1]} section")
    if "training.keep_tokens" in changed and not tc.shuffle_tags:
        lines.append(f"training.keep_tokens ({tc.keep_tokens}) is not used: it keeps the first tags in place when "
                     "training.shuffle_tags shuffles them, and shuffle_tags is false; set shuffle_tags true, or "
                     "remove keep_tokens")
    prodigy_given = [g for g in changed if g.startswith("training.prodigy.")]
    if prodigy_given and cfg.training.optimizer != "prodigy":
        lines.append(f"training.prodigy ({', '.join(g.removeprefix('training.prodigy.') for g in prodigy_given)}) is "
                     f"not used: training.optimizer is {cfg.training.optimizer}; set optimizer prodigy, or remove the "
                     "prodigy section")
    adamw_given = [g for g in changed if g in ADAMW_SETTINGS]
    if adamw_given and cfg.training.optimizer not in ("adamw", "adamw8bit"):
        own = " (its own: training.prodigy)" if cfg.training.optimizer == "prodigy" else ""
        one = len(adamw_given) == 1
        lines.append(f"{', '.join(adamw_given)} {'is not used: it is' if one else 'are not used: they are'} AdamW's, "
                     f"and training.optimizer {cfg.training.optimizer} starts from its package's defaults{own}; set "
                     f"optimizer adamw, or remove {'it' if one else 'them'}")
    halving_asked = "finetune.successive_halving" in given and ft.successive_halving
    if halving_asked and cfg.lr is not None:
        lines.append(f"finetune.successive_halving: true does nothing with a fixed lr ({cfg.lr:g}): halving races "
                     "the range test's lr_mid and lr_high; remove lr to discover the LR, or set halving false")
    elif halving_asked and ft.schedule != "constant":
        lines.append(f"finetune.successive_halving: true does nothing with finetune.schedule {ft.schedule}: "
                     "halving compares constant LRs; set the schedule to constant, or halving false")
    # One LR, no bounds (choose_lr: lr_low = lr_mid = lr_high): a cycle between them is that LR, constant, and
    # nothing races (TrainSpec.finetune / .retrain, steps.halving.halving_applies).
    collapsed = (f"a fixed lr ({cfg.lr:g})" if cfg.lr is not None
                 else f"the LR-free training.optimizer {cfg.training.optimizer}" if cfg.pipeline_lr() is not None
                 else "lr_finder: prodigy_step, which reads one LR" if cfg.lr_finder == "prodigy_step" else None)
    if collapsed is not None:
        cycling = [name for name, asked in (
            (f"finetune.schedule: {ft.schedule}", ft.schedule != "constant"),
            (f"retrain.schedule: {cfg.retrain.schedule}", cfg.retrain.enabled and cfg.retrain.schedule != "constant"),
            (f"finetune.halving_below_margin ({ft.halving_below_margin:g})" if ft.halving_below_margin else "",
             ft.halving_below_margin is not None and ft.successive_halving),
        ) if asked]
        if cycling:
            one = len(cycling) == 1
            lines.append(f"{', '.join(cycling)} {'does' if one else 'do'} nothing with {collapsed}: the LR bounds "
                         "collapse onto that one LR, so the runs train it constant and nothing races; remove "
                         f"{'it' if one else 'them'}, or let the range test discover the LR"
                         + (" (training.optimizer: adamw)" if cfg.lr is None and cfg.pipeline_lr() is not None
                            else ""))
    if ft.halving_below_margin is not None and not ft.successive_halving:
        lines.append(f"finetune.halving_below_margin ({ft.halving_below_margin:g}) does nothing with "
                     "finetune.successive_halving false: the third candidate joins the halving's race; set halving "
                     "true, or remove halving_below_margin")
    if "finetune.cooldown" in given and ft.cooldown == "on":
        if ft.schedule != "constant":
            lines.append(f"finetune.cooldown: on does nothing with finetune.schedule {ft.schedule}: the cooldown "
                         "branches a constant-LR run; set the schedule to constant, or cooldown off")
        elif cfg.training.optimizer in SCHEDULE_FREE_OPTIMIZERS:
            lines.append(f"finetune.cooldown: on does nothing with training.optimizer {cfg.training.optimizer}: a "
                         "schedule-free optimizer averages its iterates instead of decaying the LR; set cooldown off, "
                         "or choose training.optimizer: adamw")
    if "finetune.average" in given and ft.average == "on":
        tc, fix = cfg.training, "set average off"
        averaged_by: Optional[str] = None
        if tc.keeps_ema(family) and tc.use_ema == "auto":
            averaged_by, fix = ("training.use_ema auto, which keeps an EMA for LoRA on SD 1.x/2.x",
                                "set average off, or training.use_ema false to average the window's checkpoints "
                                "instead")
        elif tc.keeps_ema(family):
            averaged_by = "training.use_ema"
        elif tc.optimizer in SCHEDULE_FREE_OPTIMIZERS:
            averaged_by = f"training.optimizer {tc.optimizer}"
        if averaged_by:
            lines.append(f"finetune.average: on does nothing with {averaged_by}: the run already validates and "
                         f"delivers averaged weights; {fix}")
    # The engine saves every checkpoint_every_updates and at the end (TrainSpec.finetune): past the run's length, at
    # the end only. The window is still measured, but no checkpoint lies in it to deliver or average (analysis.
    # delivered_checkpoint then keeps the nearest: the final weights).
    if ft.checkpoint_every_epochs > 1 and ft.checkpoint_every_epochs >= ft.epochs:
        lines.append(f"finetune.checkpoint_every_epochs ({ft.checkpoint_every_epochs}) is not below finetune.epochs "
                     f"({ft.epochs}): the fine-tune saves only its final weights, trained past the step window it "
                     "measures, and delivers those (nor can it average the window's checkpoints); set "
                     "checkpoint_every_epochs below epochs, e.g. 1 (the default)")
    if "finetune.soup_tries" in given and ft.soup_tries > 0 and ft.average == "off":
        lines.append(f"finetune.soup_tries ({ft.soup_tries}) does nothing with finetune.average off: the soup is made "
                     "of the window's checkpoints the average reads; set average on, or remove soup_tries")
    no_validation = not split.holds_out_validation() or not val.enabled()
    # What the fine-tune step skips without validation (steps/finetune.py: halving_applies, cooldown_applies,
    # average_applies), each named once: a line above already names one another setting turns off.
    needs_validation = [
        name for name, asked in (
            ("finetune.successive_halving: true", halving_asked and cfg.lr is None and ft.schedule == "constant"),
            ("finetune.cooldown: on", "finetune.cooldown" in given and ft.cooldown == "on" and ft.schedule == "constant"
             and cfg.training.optimizer not in SCHEDULE_FREE_OPTIMIZERS),
            ("finetune.average: on", "finetune.average" in given and ft.average == "on"
             and not cfg.training.validates_averaged_weights(family)),
        ) if asked
    ]
    if needs_validation and no_validation:
        one = len(needs_validation) == 1
        lines.append(f"{', '.join(needs_validation)} {'does' if one else 'do'} nothing without validation: the "
                     "fine-tune compares validation losses to use "
                     f"{'it' if one else 'them'}; set split.val_split above 0 (or split.val_dir) and "
                     f"validation.every_epochs above 0, or remove {'it' if one else 'them'}")
    if "finetune.deliver" in given and ft.deliver == "earliest_tied" and no_validation:
        lines.append("finetune.deliver: earliest_tied does nothing without validation: it picks among the fine-tune's "
                     "checkpoints by their validation loss; set split.val_split above 0 (or split.val_dir) and "
                     "validation.every_epochs above 0, or remove deliver")
    # Samples during training are rendered at validations (training/samples.py), and the EMA's decay is read only
    # when an EMA is kept.
    if ("sampling.every_validations" in given and cfg.sampling.every_validations is not None
            and not val.enabled()):
        lines.append(f"sampling.every_validations ({cfg.sampling.every_validations}) does nothing with "
                     "validation.every_epochs 0: samples during training are rendered at validations; set "
                     "validation.every_epochs above 0, or every_validations null")
    if "training.ema_decay" in given and cfg.training.use_ema is False:
        lines.append(f"training.ema_decay ({cfg.training.ema_decay:g}) is not used: training.use_ema is false; set "
                     "use_ema true (or auto), or remove ema_decay")
    if split.val_dir is not None and "split.val_split" in given:
        lines.append(f"split.val_split ({split.val_split:g}) is not used: split.val_dir ({split.val_dir}) gives the "
                     "validation images; remove one of them")
    # Without validation images the fine-tune keeps its configured epochs (no window), and a fixed or LR-free lr
    # collapses the bounds a triangular retrain would cycle between: the retrain would train the same run again.
    if (cfg.retrain.enabled and not split.holds_out_validation()
            and cfg.retrain.epochs in (None, ft.epochs)):
        lines.append("retrain.enabled: true adds nothing with split.val_split 0: the retrain trains on train + "
                     "validation, and with no validation images that is the fine-tune's data, epochs and LR again, "
                     "so it repeats the fine-tune; set enabled false, or split.val_split above 0 (or split.val_dir)")
    if "retrain.epochs" in given and not cfg.retrain.enabled and cfg.retrain.epochs is not None:
        lines.append(f"retrain.epochs ({cfg.retrain.epochs}) is not used: retrain.enabled is false; set enabled true "
                     "to retrain on train+validation, or remove epochs")
    if not rt.zoom and "lr_range_test.zoom_min_points" in given:
        lines.append("lr_range_test.zoom_min_points is not used: lr_range_test.zoom is false; remove one of them")
    if val.every_updates is not None and "validation.every_epochs" in given:
        lines.append(f"validation.every_epochs ({val.every_epochs:g}) is not used: validation.every_updates "
                     f"({val.every_updates}) sets how often to validate; remove one of them")
    return lines
