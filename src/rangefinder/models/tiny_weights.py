"""Regenerate the shipped tiny models (`rangefinder make-base-model --rebuild`, `make tiny-weights`).

Runs the builders with their default settings, the SD model first since the SDXL and SD3 ones take its VAE and
tokenizer,
and writes their folders and digest lists as package data (models/shipped.py). The weights then come from this
machine's CPU: commit them together with the README's demo output, which they decide.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Optional

from rangefinder.models import shipped, tiny, tiny_flux, tiny_sd3, tiny_sdxl


def rebuild_shipped_weights(
    weights_dir: Path = shipped.SHIPPED_DIR,
    log: Optional[Callable[[str], None]] = None,
    settings: Optional[tiny.TinyModelSettings] = None,
    sdxl_settings: Optional[tiny_sdxl.TinySdxlSettings] = None,
    sd3_settings: Optional[tiny_sd3.TinySd3Settings] = None,
    flux_settings: Optional[tiny_flux.TinyFluxSettings] = None,
) -> dict[str, Path]:
    """Build the tiny SD, SDXL, SD3 and Flux models from scratch and ship them into `weights_dir`; {name: shipped
    folder}.
    Other settings than the defaults are for tests: `ensure_tiny_*` install only the defaults' weights."""
    log = log or tiny._log_stderr
    with tempfile.TemporaryDirectory(prefix="rangefinder-tiny-weights-") as work:
        sd = tiny.build_tiny_base_model(Path(work) / tiny.SHIPPED_NAME, settings or tiny.TinyModelSettings(), log=log)
        sdxl = tiny_sdxl.build_tiny_sdxl_model(Path(work) / tiny_sdxl.SHIPPED_NAME, sd,
                                               sdxl_settings or tiny_sdxl.TinySdxlSettings(), log=log)
        sd3 = tiny_sd3.build_tiny_sd3_model(Path(work) / tiny_sd3.SHIPPED_NAME, sd,
                                            sd3_settings or tiny_sd3.TinySd3Settings(), log=log)
        flux = tiny_flux.build_tiny_flux_model(Path(work) / tiny_flux.SHIPPED_NAME,
                                               flux_settings or tiny_flux.TinyFluxSettings(), log=log)
        return {name: shipped.write_shipped(name, built, weights_dir)
                for name, built in ((tiny.SHIPPED_NAME, sd), (tiny_sdxl.SHIPPED_NAME, sdxl),
                                    (tiny_sd3.SHIPPED_NAME, sd3), (tiny_flux.SHIPPED_NAME, flux))}
