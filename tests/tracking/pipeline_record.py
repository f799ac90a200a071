"""What a pipeline run must leave in MLflow, as one check that any test running the pipeline can call.

Running the pipeline is the expensive part (minutes on 2 CPU cores), so rather than run it again for tracking, a test
that already runs it (tests/pipelines/test_local_run.py) points it at a tracking target and calls
`check_pipeline_record` on the result: the shared run's default local sqlite store, read directly and through a real
`mlflow server` on it (tests/tracking/fixtures.py). Verified once standalone against a real server (all assertions
passed).
"""

from __future__ import annotations

import pytest


def check_pipeline_record(tracking_uri: str, experiment: str, summary: dict, *, model_name: str | None = None,
                          generate: bool = True) -> None:
    """Read back through MlflowClient: one parent run with its tags, the step child runs, the range test's metric
    histories with the update as step, the decisions on the step and the parent, the artifacts, and (model_name)
    the registered version behind @candidate, which loads and generates an image."""
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    from rangefinder.tracking import decode_image

    client = MlflowClient(tracking_uri=tracking_uri)
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None, f"no experiment {experiment!r} in {tracking_uri}"
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == 1, [r.info.run_name for r in parents]
    parent = parents[0]
    assert parent.data.tags["kfp.run_id"] and parent.data.tags["rangefinder.version"]
    assert parent.data.tags["rangefinder.dataset_digest"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert {"lr_range_test", "finetune"} <= set(children), sorted(children)
    assert all(r.info.status == "FINISHED" for r in children.values())

    rt = children["lr_range_test"]
    val = sorted(client.get_metric_history(rt.info.run_id, "validation/val_loss"), key=lambda m: m.step)
    lrs = sorted(client.get_metric_history(rt.info.run_id, "lr"), key=lambda m: m.step)
    assert len(val) >= 3 and val[0].step == 0  # the update-0 baseline, then one per validation
    assert [m.step for m in val] == sorted({m.step for m in val})
    assert lrs[-1].value > lrs[0].value  # the ramp climbs
    assert "training.batch_size" in rt.data.params

    # The bounds the run used: the zoomed range test's when the first asked for a zoom (lr_source zoom; the demo's
    # run), each run's stage tagged.
    used = rt
    if summary.get("lr_source") == "zoom":
        used = children["lr_range_test_zoom"]
        assert (rt.data.tags["stage"], rt.data.tags["needs_zoom"], used.data.tags["stage"]) == ("first", "true", "zoom")
    for key in ("lr_low", "lr_mid", "lr_high"):  # LRs as tags, in 4 digits
        assert float(used.data.tags[key]) == pytest.approx(summary[key], rel=1e-3)
        assert float(parent.data.tags[key]) == pytest.approx(summary[key], rel=1e-3)
    assert parent.data.metrics["recommended_epochs"] == summary["recommended_epochs"]
    # The LR the fine-tune kept (successive halving: lr_mid or lr_high): its run's param `lr`, the parent's row's tag.
    assert float(children["finetune"].data.params["lr"]) == pytest.approx(summary["lr_used"], rel=1e-5)
    assert "lr_used" not in children["finetune"].data.tags
    assert float(parent.data.tags["lr_used"]) == pytest.approx(summary["lr_used"], rel=1e-3)
    if "retrain_full" in children:  # the retrain's LR is the kept one, and its param says so by that name
        assert float(children["retrain_full"].data.params["lr"]) == pytest.approx(summary["lr_used"], rel=1e-5)
        assert "lr_mid" not in children["retrain_full"].data.params
    assert "status" in rt.data.tags

    assert {"curves", "report", "dataset"} <= {a.path for a in client.list_artifacts(rt.info.run_id)}
    assert client.list_artifacts(children["finetune"].info.run_id, "curves")
    # Samples during the fine-tune (sampling.every_validations, auto): the image series, its steps the updates, from
    # the update-0 baseline to the last validation.
    names = [a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(children["finetune"].info.run_id, "images")]
    steps = sorted(int(n.split("+step+")[1].split("+")[0]) for n in names
                   if n.startswith("samples_during_training+step+") and n.endswith(".png"))
    assert len(steps) >= 2 and steps[0] == 0 and len(set(steps)) == len(steps), names

    if model_name:
        mv = client.get_model_version_by_alias(model_name, "candidate")
        # Issue 35: the version's source run is the one that trained the weights, with their curves.
        assert mv.run_id in {children[s].info.run_id for s in ("finetune", "retrain_full") if s in children}
        # The pipeline run says which weights it delivered (not the recommended epochs beside them) and where.
        note = parent.data.tags["mlflow.note.content"]
        assert note.endswith(f" They are registered as {model_name} version {mv.version} (@candidate)."), note
        if "retrain_full" in children:
            assert note.startswith("Retrained on train + validation for "), note
        else:
            assert note.startswith("Delivered the fine-tune's ") and f"trained at lr {summary['lr_used']:.3g}." in note
        assert float(mv.tags["lr"]) == pytest.approx(summary["lr_used"], rel=1e-3)  # its LR, 4 digits (2.091e-04)
        if generate:
            mlflow.set_tracking_uri(tracking_uri)
            model = mlflow.pyfunc.load_model(f"models:/{model_name}@candidate")
            out = model.predict(pd.DataFrame({"prompt": ["a red circle"], "seed": [0]}))
            assert decode_image(out["image"][0]).size[0] > 0
