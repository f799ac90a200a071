"""What each model family refuses or requires, told from the settings and the model's small configs alone: each
family's rules, without torch, diffusers or transformers.

Each rule is written once, here, and applied twice: by the engine, whose family classes (family.py, family_sdxl.py,
family_sd3.py, family_flux.py) inherit them and apply them to the loaded model's `.config` (`for_model`), and by the
checks made before a run (families.check_family_settings: resolve-config's preflight, and `compile`, `run --local`
and `train` where the base model is here to read) to the config.json files of its folder. So `rangefinder compile`
on a local or embedded model reads JSON and imports none of the libraries that load models (seconds each).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Optional

from rangefinder.config import FAMILY_NAMES, FlowSettings
from rangefinder.errors import ConfigError
from rangefinder.training.geometry import vae_downscale

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig

PREDICTION_TYPES = ("epsilon", "v_prediction")
TI_FAMILIES = ("sd1", "sdxl")  # the families whose textual-inversion embedding files consumers load
# What a scheduler config without `prediction_type` (SD 1.4's, written before diffusers had the field) predicts:
# DDPMScheduler's default, which the engine's training scheduler, loaded from that config, has filled in.
DDPM_DEFAULT_PREDICTION = "epsilon"
# The guidance Flux.1-dev trains with when training.flow.guidance is unset: diffusers' train_dreambooth_lora_flux.py
# --guidance_scale, sd-scripts' --guidance_scale.
DEFAULT_GUIDANCE = 3.5
# The keys of a FlowMatchEulerDiscreteScheduler config that its resolution-dependent shift reads.
DYNAMIC_SHIFT_KEYS = ("base_image_seq_len", "max_image_seq_len", "base_shift", "max_shift")
# The resolution-dependent shift sd-scripts' `flux_shift` applies (flux_train_utils.py: mu on the line through
# (256 tokens, 0.5) and (4096, 1.15)), in the scheduler config's keys: FLUX.1's own scheduler's.
_SD_SCRIPTS_FLUX_SHIFT = {"base_image_seq_len": 256.0, "max_image_seq_len": 4096.0, "base_shift": 0.5,
                          "max_shift": 1.15}
# (training.flow.timestep_sampling, loss_weighting) -> diffusers' one `weighting_scheme` that draws sigma from that
# density and weights the loss so (compute_density_for_timestep_sampling: logit_normal and mode draw their density,
# any other uniformly; compute_loss_weighting_for_sd3: sigma_sqrt and cosmap weight, any other not).
_DIFFUSERS_WEIGHTING_SCHEME = {("logit_normal", "none"): "logit_normal", ("mode", "none"): "mode",
                               ("uniform", "none"): "none", ("uniform", "sigma_sqrt"): "sigma_sqrt",
                               ("uniform", "cosmap"): "cosmap"}


def _density_keys(flow: FlowSettings) -> dict[str, str]:
    """sd-scripts' keys of the density's parameters, for the density that reads them (as `str` of the value)."""
    if flow.timestep_sampling == "logit_normal":
        return {"ss_logit_mean": str(float(flow.logit_mean)), "ss_logit_std": str(float(flow.logit_std))}
    if flow.timestep_sampling == "mode":
        return {"ss_mode_scale": str(float(flow.mode_scale))}
    return {}


def check_method_family(method: str, family: str) -> None:
    """ConfigError when training.method `method` cannot train a model of `family` ("sd1" | "sdxl" | "sd3" |
    "flux"), told from the names alone: the one rule a method's `setup` applies (methods.base.Method.check_family)
    and the checks before a run apply (families.check_family_settings). Every family, unless a method says
    otherwise here."""
    if method == "textual_inversion" and family not in TI_FAMILIES:
        # SD3 would need an embedding per CLIP and none for T5; no consumer (ComfyUI, A1111, diffusers' SD3
        # loader) reads such a file, so it is refused rather than built for nobody. (Flux's own refusal,
        # refuse_unsupported, says why for Flux, and comes first.)
        raise ConfigError(f"training.method: textual inversion is not supported on {FAMILY_NAMES[family]} models "
                          f"(only on {' and '.join(FAMILY_NAMES[f] for f in TI_FAMILIES)}); use method lora or "
                          "full")


class Sd1Rules:
    """Stable Diffusion 1.x / 2.x (family.Sd1Family)."""

    name: ClassVar[str] = "sd1"
    # The `training` settings this family's objective has no use for, which check_settings refuses unless left at
    # their defaults: runs leave them out of their MLflow params (tracking.runs.applicable_params).
    unused_training: ClassVar[tuple[str, ...]] = ("flow",)
    # True for a transformer that cuts the latents into patches (every image side must be a multiple of
    # side_multiple); False for a UNet, which pads its upsampling for other square sizes.
    patchified: ClassVar[bool] = False

    @classmethod
    def settings_used(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                      denoiser_config: Mapping[str, Any]) -> dict[str, Any]:
        """No flow-matching settings apply (FlowRules.settings_used)."""
        return {}

    @classmethod
    def kohya_training_metadata(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                                denoiser_config: Mapping[str, Any]) -> dict[str, str]:
        """No flow-matching keys (FlowRules.kohya_training_metadata)."""
        return {}

    @classmethod
    def check_settings(cls, cfg: TrainingConfig, scheduler_config: Mapping[str, Any],
                       denoiser_config: Mapping[str, Any]) -> None:
        """ConfigError for a training setting this family refuses, judged from the settings, the training
        scheduler's config and the denoiser's config alone (no weights): the one rule that `for_model` applies to a
        loaded model and resolve-config's preflight (families.check_family_settings) to the resolved folder, before
        any GPU is asked for. Each family has one. SD 1.x/SDXL: the flow objective's settings are refused (they
        would be ignored), and so is a model predicting what the DDPM objective does not train, unless
        training.prediction_type overrides it."""
        if cfg.flow != FlowSettings():
            # The fields that differ from the defaults, not model_fields_set: a config that went through JSON
            # (base_config, config_json) has every field set.
            default = FlowSettings()
            changed = ", ".join(sorted(k for k in FlowSettings.model_fields
                                       if getattr(cfg.flow, k) != getattr(default, k)))
            raise ConfigError(f"training.flow ({changed}): the base model is a DDPM model ({FAMILY_NAMES[cls.name]}), "
                              "not a flow-matching one (SD3, Flux); remove training.flow")
        predicts = cfg.prediction_type or str(scheduler_config.get("prediction_type", DDPM_DEFAULT_PREDICTION))
        if predicts not in PREDICTION_TYPES:
            raise ConfigError(
                f"training.prediction_type: the base model predicts {predicts!r}; set epsilon or v_prediction"
            )

    @classmethod
    def min_resolution(cls, native: int) -> int:
        """The smallest training resolution (pixels) the family supports for a model of `native` resolution: SD
        1.x/2.x train at any size their VAE and UNet divide (data.resolution's own checks). A classmethod, like
        side_multiple_of, so that resolve-config's preflight judges sizes from the configs (geometry.py)."""
        return 8

    @classmethod
    def side_multiple_of(cls, vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> int:
        """Pixels each image side must be a multiple of for every latent to pass the UNet's down- and upsampling
        evenly (aspect-ratio buckets): the VAE's downscale times the UNet's, read from their configs (the loaded
        modules' or their config.json)."""
        return vae_downscale(vae_config) * 2 ** (len(denoiser_config["down_block_types"]) - 1)


class SdxlRules(Sd1Rules):
    """Stable Diffusion XL (family_sdxl.SdxlFamily): SD's rules, but for its floor."""

    name: ClassVar[str] = "sdxl"

    @classmethod
    def min_resolution(cls, native: int) -> int:
        """SDXL was trained down to half its native size (512 px for the 1024 px base, through its size
        conditioning); below that it does not produce the images it was trained on."""
        return max(8, native // 2)


def refuse_ddpm_settings(cfg: TrainingConfig, family: str) -> None:
    """One ConfigError line for a DDPM setting on a flow-matching model of `family` (never ignored silently)."""
    model = FAMILY_NAMES[family]
    if cfg.min_snr_gamma is not None:
        raise ConfigError(f"training.min_snr_gamma: min-SNR weighting is defined through the DDPM noise schedule; "
                          f"{model} is a flow-matching model; remove it (training.flow.loss_weighting sets the "
                          "flow weighting: none, sigma_sqrt, cosmap)")
    if cfg.prediction_type is not None:
        raise ConfigError(f"training.prediction_type: {model} is a flow-matching model, trained on the velocity "
                          f"noise - x0, not {cfg.prediction_type}; remove training.prediction_type")
    if cfg.noise_offset:
        raise ConfigError(f"training.noise_offset: the offset noise is DDPM's; {model} is a flow-matching model; "
                          "set training.noise_offset to 0")


def check_flow_scheduler(model_scheduler: str, wanted: str) -> None:
    """ConfigError for a DDPM-family sampling scheduler on a flow-matching model (whose own scheduler is a
    FlowMatch* one): it would step a velocity as if it were noise."""
    if model_scheduler.startswith("FlowMatch") and not wanted.startswith("FlowMatch"):
        raise ConfigError(f"sampling.scheduler: {wanted} samples DDPM models; this base model is a flow-matching "
                          f"model (it samples with {model_scheduler}); set a FlowMatch* scheduler or leave "
                          "sampling.scheduler unset")


class FlowRules:
    """The rectified-flow families' (family_flow.FlowFamily)."""

    name: ClassVar[str] = "flow"
    patchified: ClassVar[bool] = True
    unused_training: ClassVar[tuple[str, ...]] = ("min_snr_gamma", "prediction_type", "noise_offset")  # DDPM's

    @classmethod
    def side_multiple_of(cls, vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> int:
        """The VAE's downscale times the transformer's patch size (SD3, Flux: 8 x 2 = 16 px), read from their
        configs (the loaded modules' or their config.json)."""
        return vae_downscale(vae_config) * int(denoiser_config["patch_size"])

    @classmethod
    def constant_shift(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any]) -> float:
        """training.flow.shift, else the base model's scheduler config's `shift` (1.0 when it has none)."""
        if flow.shift is not None:
            return float(flow.shift)
        return float(scheduler_config.get("shift", 1.0) or 1.0)

    @classmethod
    def settings_used(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                      denoiser_config: Mapping[str, Any]) -> dict[str, Any]:
        """What training.flow's settings resolve to on this model, as the engine resolves them (the family's
        `for_model`), for the MLflow params beside the settings: `training.flow.shift` unset read `None` there, where
        SD3 trains at its scheduler's 3.0."""
        return {"training.flow.shift_used": cls.constant_shift(flow, scheduler_config)}


class Sd3Rules(FlowRules):
    """Stable Diffusion 3 / 3.5 (family_sd3.Sd3Family)."""

    name: ClassVar[str] = "sd3"

    @classmethod
    def check_settings(cls, cfg: TrainingConfig, scheduler_config: Mapping[str, Any],
                       denoiser_config: Mapping[str, Any]) -> None:
        """What SD3 refuses from the settings alone (Sd1Rules.check_settings says who calls it): DDPM's
        settings, and Flux's distilled guidance."""
        refuse_ddpm_settings(cfg, cls.name)
        if cfg.flow.guidance is not None:
            raise ConfigError("training.flow.guidance: SD3 has no guidance embedding (only Flux.1-dev is "
                              "guidance-distilled; SD3 samples with classifier-free guidance, "
                              "sampling.guidance_scale); remove training.flow.guidance")

    @classmethod
    def kohya_training_metadata(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                                denoiser_config: Mapping[str, Any]) -> dict[str, str]:
        """sd-scripts' `ss_*` keys of an SD3 LoRA's objective (sd3_train_network.py's `update_metadata`), those whose
        value this run has, as sd-scripts writes them (`str` of the value): no attention mask on CLIP's or T5's
        tokens (the text encoders are called without one, as diffusers' StableDiffusion3Pipeline calls them), and the
        density and weighting as its one `weighting_scheme` (diffusers' compute_density_for_timestep_sampling and
        compute_loss_weighting_for_sd3) with the density's own parameters. A density and a weighting that one scheme
        does not name together (logit-normal and cosmap) leave the scheme out. The shift, which sd-scripts' SD3
        metadata does not hold, is the run's MLflow param training.flow.shift_used."""
        out = {"ss_apply_lg_attn_mask": "False", "ss_apply_t5_attn_mask": "False"}
        scheme = _DIFFUSERS_WEIGHTING_SCHEME.get((flow.timestep_sampling, flow.loss_weighting))
        if scheme is not None:
            out["ss_weighting_scheme"] = scheme
            out |= _density_keys(flow)
        return out

    @classmethod
    def min_resolution(cls, native: int) -> int:
        return max(8, native // 4)  # SD3 was pre-trained from 256 px up (paper sec. 5.3) for its 1024 px native


def refuse_unsupported(cfg: TrainingConfig) -> None:
    """One line for each setting that asks Flux for what a guidance-distilled model with a frozen T5 does not do."""
    if cfg.method == "textual_inversion":
        raise ConfigError("training.method: textual inversion is not supported on Flux (its prompt reaches the "
                          "transformer through T5, which has no standard embedding format to train; kohya and "
                          "diffusers train Flux concepts with LoRA); use method lora")
    if cfg.cond_dropout > 0:
        raise ConfigError("training.cond_dropout: Flux.1-dev is guidance-distilled (the guidance scale is an input of "
                          "its transformer, training.flow.guidance) and has no unconditional branch to train; set "
                          "training.cond_dropout to 0")
    if cfg.train_text_encoder or cfg.lora.train_text_encoder:
        raise ConfigError("training.train_text_encoder: Flux's text encoders are not trained here (T5 never is; "
                          "CLIP-L conditions only through its pooled vector); remove train_text_encoder")


def guidance_embedded(denoiser_config: Mapping[str, Any]) -> bool:
    """Whether the transformer takes the guidance scale as an input (Flux.1-dev; not schnell): its config's
    `guidance_embeds`, whose absence (a config.json written without it) means diffusers' default, off."""
    return bool(denoiser_config.get("guidance_embeds", False))


class FluxRules(FlowRules):
    """Flux.1 (family_flux.FluxFamily)."""

    name: ClassVar[str] = "flux"

    @classmethod
    def check_settings(cls, cfg: TrainingConfig, scheduler_config: Mapping[str, Any],
                       denoiser_config: Mapping[str, Any]) -> None:
        """What Flux refuses from the settings and its transformer's config (Sd1Rules.check_settings says who
        calls it): DDPM's settings, what a guidance-distilled model with a frozen T5 does not do, and a training
        guidance for a model without the guidance embedding."""
        refuse_ddpm_settings(cfg, cls.name)
        refuse_unsupported(cfg)
        if cfg.flow.guidance is not None and not guidance_embedded(denoiser_config):
            raise ConfigError("training.flow.guidance: this Flux model has no guidance embedding (FLUX.1-schnell is "
                              "not guidance-distilled); remove training.flow.guidance")

    @classmethod
    def training_guidance(cls, flow: FlowSettings, denoiser_config: Mapping[str, Any]) -> Optional[float]:
        """The guidance the transformer is fed in training: training.flow.guidance, else DEFAULT_GUIDANCE; None for
        a model without the guidance embedding (schnell)."""
        if not guidance_embedded(denoiser_config):
            return None
        return float(flow.guidance) if flow.guidance is not None else DEFAULT_GUIDANCE

    @classmethod
    def dynamic_shift_of(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any]) -> Optional[dict[str, float]]:
        """The scheduler's resolution-dependent shift's constants, unless training.flow.shift sets a constant shift
        or the scheduler has none (None)."""
        if flow.shift is not None or not scheduler_config.get("use_dynamic_shifting", False):
            return None
        return {k: float(scheduler_config[k]) for k in DYNAMIC_SHIFT_KEYS}

    @classmethod
    def settings_used(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                      denoiser_config: Mapping[str, Any]) -> dict[str, Any]:
        """FlowRules' and the guidance fed (`training.flow.guidance` unset read `None`, where Flux.1-dev trains at
        3.5); the shift of a scheduler that shifts by resolution is "resolution-dependent" (its mu per image size is
        in run_summary.json's validation_weighting), not its config's constant `shift`, which it does not apply."""
        guidance = cls.training_guidance(flow, denoiser_config)
        used = super().settings_used(flow, scheduler_config, denoiser_config)
        if cls.dynamic_shift_of(flow, scheduler_config) is not None:
            used["training.flow.shift_used"] = "resolution-dependent"
        return used | {"training.flow.guidance_used": "none (no guidance input)" if guidance is None else guidance}

    @classmethod
    def kohya_training_metadata(cls, flow: FlowSettings, scheduler_config: Mapping[str, Any],
                                denoiser_config: Mapping[str, Any]) -> dict[str, str]:
        """sd-scripts' `ss_*` keys of a Flux LoRA's objective (flux_train_network.py's `update_metadata`), those whose
        value this run has, as sd-scripts writes them (`str` of the value): the model type (`flux`, sd-scripts'
        `--model_type` for Flux.1 dev and schnell alike, where `chroma` is another model); no T5 attention mask; the
        model's raw output taken as the velocity (`raw`, where sd-scripts' default `sigma_scaled` rescales it); the
        guidance fed to Flux.1-dev; the loss weighting where unweighted (`none`); and sigma's density and shift as the
        `timestep_sampling` of flux_train_utils.py that draws the same: a logit-normal of mean 0 and scale s is
        `flux_shift` under the resolution-dependent shift of Flux.1's scheduler (mu from 0.5 at 256 image tokens to
        1.15 at 4096, the line sd-scripts fixes), `shift` under a constant one, and uniform unshifted is `uniform`.
        Another density or shift draws as none of them do, and leaves `ss_timestep_sampling` and the weighting (which
        its default `sigma` reads as the density too) out.
        Two keys sd-scripts always writes (flux_train_network.py update_metadata at 48d368fa, lines 446-457, from its
        arguments) are left out where its value would not say what this run did: the guidance of schnell, which has
        no guidance input (sd-scripts writes its --guidance_scale, 3.5, all the same), and a sigma_sqrt or cosmap
        weighting, which sd-scripts applies only under `sigma_scaled` (flux_train_utils.py
        apply_model_prediction_type, lines 532-547): beside `raw` the key names a weighting sd-scripts' run of
        these keys does not apply, and no sd-scripts run weights a raw velocity's loss."""
        out = {"ss_model_type": "flux", "ss_apply_t5_attn_mask": "False", "ss_model_prediction_type": "raw"}
        guidance = cls.training_guidance(flow, denoiser_config)
        if guidance is not None:
            out["ss_guidance_scale"] = str(guidance)
        dynamic, shift = cls.dynamic_shift_of(flow, scheduler_config), cls.constant_shift(flow, scheduler_config)
        if flow.timestep_sampling == "logit_normal" and flow.logit_mean == 0:
            if dynamic is None:
                out |= {"ss_timestep_sampling": "shift", "ss_sigmoid_scale": str(float(flow.logit_std)),
                        "ss_discrete_flow_shift": str(shift)}
            elif dynamic == _SD_SCRIPTS_FLUX_SHIFT:
                out |= {"ss_timestep_sampling": "flux_shift", "ss_sigmoid_scale": str(float(flow.logit_std))}
        elif flow.timestep_sampling == "uniform" and dynamic is None and shift == 1.0:
            out["ss_timestep_sampling"] = "uniform"
        # Under its default `sigma` the scheme would name the density too; under `raw` a weighting goes unapplied.
        if "ss_timestep_sampling" in out and flow.loss_weighting == "none":
            out["ss_weighting_scheme"] = flow.loss_weighting
        return out

    @classmethod
    def min_resolution(cls, native: int) -> int:
        return 8

    @classmethod
    def side_multiple_of(cls, vae_config: Mapping[str, Any], denoiser_config: Mapping[str, Any]) -> int:
        """The VAE's downscale times 2: the latents are packed in 2x2 patches (the transformer's own patch_size is
        1, on the packed tokens)."""
        return vae_downscale(vae_config) * 2
