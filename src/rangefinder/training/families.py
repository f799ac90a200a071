"""The model families the engine trains, by the name `family_detection.detect_family` reads from the base
model.

A new family is one module with a class providing family.Family's methods, one line here, and its
family_detection.FamilyLayout (what loading, sampling and the exports read of it).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rangefinder.errors import ConfigError
from rangefinder.training.family_detection import import_named

if TYPE_CHECKING:
    from rangefinder.config import TrainingConfig
    from rangefinder.models.loading import SDComponents
    from rangefinder.training.family import Family

# family name (family_detection.detect_family) -> "module:Class"; imported only when chosen.
FAMILIES = {
    "sd1": "rangefinder.training.family:Sd1Family",
    "sdxl": "rangefinder.training.family_sdxl:SdxlFamily",
    "flux": "rangefinder.training.family_flux:FluxFamily",
    "sd3": "rangefinder.training.family_sd3:Sd3Family",
}


def family_for(sd: SDComponents, cfg: TrainingConfig) -> Family:
    """The family object of a loaded model (sd.family, as detected from the base model), with the training settings
    of its objective (a setting that means nothing for the family is a ConfigError)."""
    target = FAMILIES.get(sd.family)
    if target is None:
        raise ConfigError(f"model.base_model: rangefinder cannot train the {sd.family!r} model family")
    family: Family = import_named(target).for_model(sd, cfg)
    return family
