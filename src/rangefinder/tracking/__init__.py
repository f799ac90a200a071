"""MLflow tracking: every pipeline run, curve, decision and model browsable in MLflow.

Where runs go
    tracking URI: `tracking.tracking_uri`, else $MLFLOW_TRACKING_URI, else `sqlite:///mlflow.db` (working folder).
    experiment: $MLFLOW_EXPERIMENT_ID, else $MLFLOW_EXPERIMENT_NAME, else `tracking.experiment_name`.
    credentials: only from the environment (MLFLOW_TRACKING_USERNAME/PASSWORD, or MLFLOW_TRACKING_TOKEN), never
    from the config, and never logged. Every run-opening call first checks that an http(s) server answers and takes
    the credentials (a few seconds at most), raising TrackingError with one sentence saying what to fix.

The run tree
    one parent run per pipeline run, one child run per step. Steps are separate processes, so a step finds its
    parent by id: `ensure_parent_run(cfg, name=..., kfp_run_id=...)` returns it, creating it on first use; pass the
    id on as a string (a KFP output/parameter), or let each step call `step_run(..., pipeline_run_name=...)`,
    which finds the same parent by the same name. Under KFP's MLflow integration ($MLFLOW_RUN_ID names the nested
    run KFP made for the task), KFP's pipeline run is the parent and the step logs into KFP's task run.

In a step::

    from rangefinder import tracking

    with tracking.step_run(cfg, "lr_range_test", parent_run_id=parent_run_id) as run:
        run.log_config(cfg, plan=plan)                      # params: training.batch_size, plan.effective_batch, ...
        result = train(..., metric_sink=run)                # run.log_metrics(metrics, step=update), batched
        run.log_artifact(out_dir / "metrics.csv", "curves")
        run.log_artifact(report_dir, "report")              # a folder: plots, report.html, report.md
        run.log_decisions({"lr_low": 1e-5, "lr_high": 1e-3, "lr_mid": 1e-4, "quality": 0.8,
                           "status": "ok", "flags": ["censored_right"]})
        run.log_image(grid, key="sample_grid", step=update)  # or artifact_file="samples/grid.png"
        version = run.log_diffusers_model(pipeline_dir, metrics={"val_loss": best})  # registered, @candidate

    tracking.finish_pipeline_run(cfg, parent_run_id)        # at the end of the pipeline (the last step)

A server that stops answering mid-step: tracking/outbox.py (the one policy). Registering a model waits for it up to
`tracking.server_wait_seconds` (`retry_while_server_away`), then names the `rangefinder register` command.

Promotion to `champion` is explicit: `tracking.promote(name, version)` or `rangefinder promote`.
"""

from __future__ import annotations

from rangefinder.tracking.metrics import BatchedMetricLogger
from rangefinder.tracking.redaction import redact, safe_uri
from rangefinder.tracking.registry import (
    CANDIDATE,
    CHAMPION,
    RegisteredVersion,
    decode_image,
    promote,
    retry_while_server_away,
)
from rangefinder.tracking.runs import (
    CURVES_ARTIFACT,
    StepRun,
    child_run,
    common_tags,
    ensure_parent_run,
    finish_pipeline_run,
    flatten_params,
    folder_digest,
    log_resolved_config,
    logged_curve,
    logged_curve_path,
    step_run,
    tracking_client,
)
from rangefinder.tracking.target import (
    DEFAULT_TRACKING_URI,
    check_tracking_server,
    resolve_experiment_name,
    resolve_tracking_uri,
)

__all__ = [
    "BatchedMetricLogger",
    "CANDIDATE",
    "CHAMPION",
    "CURVES_ARTIFACT",
    "DEFAULT_TRACKING_URI",
    "RegisteredVersion",
    "StepRun",
    "check_tracking_server",
    "child_run",
    "common_tags",
    "decode_image",
    "ensure_parent_run",
    "finish_pipeline_run",
    "flatten_params",
    "folder_digest",
    "log_resolved_config",
    "logged_curve",
    "logged_curve_path",
    "promote",
    "redact",
    "resolve_experiment_name",
    "resolve_tracking_uri",
    "retry_while_server_away",
    "safe_uri",
    "step_run",
    "tracking_client",
]
