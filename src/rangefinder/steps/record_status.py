"""Step `record_status` (the pipeline's exit handler): the run's final state on its MLflow parent run.

It runs whatever happened inside the pipeline, so a failed run shows as FAILED in MLflow with the step that failed
and its error, instead of a parent run left "running" forever.
"""

from __future__ import annotations

from rangefinder.config import RangefinderConfig
from rangefinder.steps.kept_settings import keeps_mlflow_settings

# KFP's final task states -> MLflow run states.
STATES = {"SUCCEEDED": "FINISHED", "FAILED": "FAILED", "CANCELED": "KILLED", "CANCELLED": "KILLED"}


@keeps_mlflow_settings
def run_record_status(*, state: str, error_message: str = "", failed_task: str = "", mlflow_experiment: str = "",
                      pipeline_job_id: str = "", pipeline_job_name: str = "") -> str:
    """The parent run is found by the KFP run's id and, where given, its name, as resolve-config made it: kfp.local's
    ids can repeat in one experiment (tracking.runs._find_parent)."""
    from rangefinder import tracking

    cfg = RangefinderConfig.model_validate({"tracking": {"experiment_name": mlflow_experiment or "rangefinder"}})
    status = STATES.get((state or "").upper(), "FAILED")
    parent = tracking.ensure_parent_run(cfg, kfp_run_id=pipeline_job_id or None, name=pipeline_job_id or None,
                                        kfp_run_name=pipeline_job_name or None, log_config=False)
    client = tracking.tracking_client(cfg)
    client.set_tag(parent, "rangefinder.final_state", state or "UNKNOWN")
    # KFP fills failed_task (with the exit handler's own group) even when nothing failed: only a failure names it.
    if status != "FINISHED":
        if error_message:
            client.set_tag(parent, "rangefinder.error", tracking.redact(error_message)[:4000])
        if failed_task:
            client.set_tag(parent, "rangefinder.failed_task", failed_task)
    tracking.finish_pipeline_run(cfg, parent, status=status)
    print(f"pipeline run {pipeline_job_id}: {state} -> MLflow run {parent} {status}")
    if status == "FINISHED":  # a failed run's work stays: a retry of the run resumes its training steps from there
        from rangefinder.steps.workdir import remove_run_work

        removed = remove_run_work(parent)
        if removed is not None:
            print(f"removed the run's work folder {removed} (its steps' outputs are in their artifacts)")
    return status
