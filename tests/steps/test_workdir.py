"""Training steps run on the shared volume when one is given, and publish the finished run into their artifact."""

from __future__ import annotations

from rangefinder.steps.workdir import publish, work_dir


def test_without_a_work_volume_the_artifact_is_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("RANGEFINDER_WORK", raising=False)
    assert work_dir(tmp_path / "model", "parent/finetune") == tmp_path / "model"
    monkeypatch.setenv("RANGEFINDER_WORK", str(tmp_path / "work"))
    assert work_dir(tmp_path / "model", None) == tmp_path / "model"  # no pipeline run to key it by


def test_work_volume_run_is_published(tmp_path, monkeypatch):
    monkeypatch.setenv("RANGEFINDER_WORK", str(tmp_path / "work"))
    work = work_dir(tmp_path / "model", "run123/finetune")
    assert work == tmp_path / "work" / "run123" / "finetune"
    (work / "final").mkdir(parents=True)
    (work / "final" / "weights.safetensors").write_bytes(b"w")
    (work / "metrics.csv").write_text("update,val_loss\n0,1.0\n")
    publish(work, tmp_path / "model")
    assert (tmp_path / "model" / "final" / "weights.safetensors").read_bytes() == b"w"
    assert (tmp_path / "model" / "metrics.csv").is_file()
    publish(tmp_path / "model", tmp_path / "model")  # the same folder: nothing to do


def test_a_run_is_published_into_an_artifact_folder_the_step_already_wrote_to(tmp_path, monkeypatch):
    """The fine-tune writes its report into its artifact folder (model/report) before the run is published there:
    publishing adds the run beside it."""
    monkeypatch.setenv("RANGEFINDER_WORK", str(tmp_path / "work"))
    work = work_dir(tmp_path / "model", "run123/finetune")
    (work / "final").mkdir(parents=True)
    (work / "final" / "weights.safetensors").write_bytes(b"w")
    (tmp_path / "model" / "report").mkdir(parents=True)
    (tmp_path / "model" / "report" / "decision.json").write_text("{}")
    publish(work, tmp_path / "model")
    assert (tmp_path / "model" / "final" / "weights.safetensors").read_bytes() == b"w"
    assert (tmp_path / "model" / "report" / "decision.json").read_text() == "{}"
