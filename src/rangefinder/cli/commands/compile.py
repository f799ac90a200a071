"""`rangefinder compile`: the pipeline as KFP IR YAML, with defaults and pod settings from a config file."""

from __future__ import annotations

import argparse
from pathlib import Path

from rangefinder.cli.args import refuse_writing_over
from rangefinder.cli.ignored import (
    ignored_by_pipeline,
    off_the_data_volume,
    tracking_off_the_cluster,
    warn_conflicts,
    warn_ignored,
)
from rangefinder.cli.output import add_json_flag
from rangefinder.formats.text import warn


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="write the Kubeflow pipeline as IR YAML",
        description="Compile the pipeline. A --config file sets the parameters' defaults (shown in the KFP UI) and "
        "the pod settings of its kubernetes: section (GPU, node pool, volumes, secrets, retries).",
    )
    p.add_argument("--out", default="rangefinder-pipeline.yaml",
                   help="output YAML, named .yaml or .yml, as KFP uploads it (default rangefinder-pipeline.yaml)")
    p.add_argument("--config", help="a rangefinder config YAML (default: the built-in defaults)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from rangefinder.config import load_config
    from rangefinder.errors import ConfigError
    from rangefinder.pipelines.pipeline import PIPELINE_NAME, compile_pipeline

    out = Path(args.out)
    if out.is_dir():
        raise ConfigError(f"--out {args.out} is a folder; name the package in it, e.g. "
                          f"{out / 'rangefinder-pipeline.yaml'}")
    if out.suffix not in (".yaml", ".yml"):
        # KFP's own compiler refuses such a name, or writes JSON for .json; the package here was YAML under any name,
        # which KFP's upload (UI or API) then refused for its name, or read as another format.
        named = out.with_suffix(".yaml") if out.suffix.lower() in (".json", ".yaml", ".yml") else f"{out}.yaml"
        raise ConfigError(f"--out {args.out}: the package is YAML, which KFP's upload knows by a name ending in .yaml "
                          f"or .yml; name it {named}")
    refuse_writing_over(args.out, "--out", args.config, "--config",
                        f"name the package apart, e.g. {out.with_name(out.stem + '-pipeline.yaml')}")
    cfg = load_config(args.config)
    warn_ignored("compile", ignored_by_pipeline(cfg, local=False))
    warn_conflicts(cfg)
    # Written beside and renamed when whole (never a half-written package), after what a killed compile left there.
    compile_pipeline(cfg, str(out))
    warn(off_the_data_volume(cfg) + tracking_off_the_cluster(cfg))  # of a package written: one refused says only why
    k8s = cfg.kubernetes
    return {
        "pipeline": PIPELINE_NAME,
        "package": str(out),
        "config": args.config or "(defaults)",
        "trainer_gpus": f"{k8s.gpu_count} x {k8s.accelerator_type}" if k8s.gpu_count else "none",
    }
