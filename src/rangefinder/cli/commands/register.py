"""`rangefinder register MODEL_DIR`: the pipeline's register-model step, by hand.

The step names this command when the tracking server did not answer while it registered the delivered weights (it
waits `tracking.server_wait_seconds` first): run it once the server answers, with the config the step kept.
"""

from __future__ import annotations

import argparse

from rangefinder.cli.output import add_json_flag


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "register",
        help="register a fine-tuned model folder in MLflow (what the register-model step does)",
        description="Log MODEL_DIR (a fine-tune's or retrain's model folder, which holds chosen/ or final/, or one of "
        "those two) to MLflow as a pyfunc model, register it as tracking.registered_model_name and point the "
        "candidate alias at it.",
    )
    p.add_argument("model_dir", help="the fine-tune's or retrain's model folder (or its chosen/ or final/)")
    p.add_argument("--config", required=True, help="the rangefinder config the pipeline ran with")
    p.add_argument("--lr", type=float, required=True, help="the learning rate the weights were trained at")
    p.add_argument("--epochs", type=int, required=True, help="the epochs they were trained for")
    p.add_argument("--parent-run-id", help="the pipeline run's MLflow parent run (the step's run nests under it)")
    add_json_flag(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> dict:
    from pathlib import Path

    from rangefinder.config import load_config
    from rangefinder.errors import ConfigError
    from rangefinder.sampling import undelivered
    from rangefinder.steps.register_model import run_register_model

    model_dir = Path(args.model_dir)
    if not model_dir.is_dir():
        raise ConfigError(undelivered(model_dir) or f"{model_dir} is not a folder; pass the fine-tune's or retrain's "
                          "model folder")
    r = run_register_model(load_config(args.config), model_dir=model_dir, lr=args.lr, epochs=args.epochs,
                           mlflow_parent_run_id=args.parent_run_id)
    return {"model_uri": r.model_uri, "version": r.version, "weights": str(r.weights)}
