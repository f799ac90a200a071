"""What a finished local run must show about the model it registered, for the tests that run the whole pipeline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


def task_dir(summary: dict, prefix: str) -> Path:
    found = sorted(p for p in Path(summary["pipeline_root"]).iterdir() if p.name.startswith(prefix))
    assert found, f"no task {prefix}"
    return found[-1]


def check_registered_is_the_kept_checkpoint(summary: dict, out: Path, base_dir: Path, method: str) -> None:
    """The registered version's weights are the kept checkpoint's (the step window's pick); its
    tags name that update, epoch and validation loss, its description says why."""
    from mlflow import MlflowClient

    from rangefinder.formats import checkpoints

    ckpt, update, chosen = check_the_kept_checkpoint(summary)
    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name, version = summary["registered_model"].removeprefix("models:/").split("/")
    mv = client.get_model_version(name, version)
    assert mv.tags["update"] == str(update) and float(mv.tags["epoch"]) == pytest.approx(chosen["epoch"])
    assert float(mv.tags["val_loss"]) == pytest.approx(chosen["val_loss"], rel=1e-5)
    assert mv.tags["rangefinder.weights"] == f"finetune {ckpt.name}"
    assert mv.tags["rangefinder.chosen_rule"] == chosen["rule"] in ("window_lowest", "window_nearest", "run_lowest")
    assert f"update {update}" in mv.description and "recommended length" in mv.description
    check_registered_weights(summary, out, base_dir, method, checkpoints.read_weights(ckpt),
                             task_dir(summary, "finetune") / "model" / checkpoints.CHOSEN_DIR)


def check_registered_is_the_retrain(summary: dict, out: Path, base_dir: Path) -> None:
    """With the full-data retrain on (LoRA): the registered version's source run is retrain_full's, its tags say
    so, and its weights are the base model with the retrain's final LoRA file fused in (that file, as diffusers
    reads it: `formats/lora.py`'s names, alpha/rank folded into `up`); the grid has the retrained column."""
    from mlflow import MlflowClient
    from safetensors.torch import load_file

    from rangefinder.formats.lora import LORA_WEIGHTS_NAME

    uri = f"sqlite:///{out / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    name, version = summary["registered_model"].removeprefix("models:/").split("/")
    mv = client.get_model_version(name, version)
    (retrain_run,) = client.search_runs([client.get_run(mv.run_id).info.experiment_id],
                                        "attributes.run_name = 'retrain_full'")
    assert mv.run_id == retrain_run.info.run_id  # the version links to the run that trained its weights
    assert mv.tags["rangefinder.weights"] == "retrain_full final"
    assert "Retrained on train + validation" in mv.description
    # The retrain's LoRA file in the training state's names: module -> (lora_A = down, lora_B = up with the scale).
    final = load_file(str(task_dir(summary, "retrain-full") / "model" / "final" / LORA_WEIGHTS_NAME))
    trained = {}
    for key, down in final.items():
        if key.startswith("unet.") and key.endswith(("_lora.down.weight", ".lora.down.weight")):
            module = key.removesuffix("down.weight")[:-len(".lora.")].replace(".processor.to_", ".to_")
            module += ".0" if module.endswith(".to_out") else ""
            trained[f"{module}.lora_A.weight"] = down
            trained[f"{module}.lora_B.weight"] = final[key.replace("down.weight", "up.weight")]
    check_registered_weights(summary, out, base_dir, "lora", trained,
                             task_dir(summary, "retrain-full") / "model" / "final")
    grid = json.loads((task_dir(summary, "sample-images") / "images" / "grid.json").read_text())
    assert any(c["label"] == "retrained" and "retrain-full" in c["path"] for c in grid["columns"]), grid["columns"]


def check_the_kept_checkpoint(summary: dict) -> tuple[Path, int, dict]:
    """(checkpoint, update, chosen.json): the fine-tune kept one checkpoint, the step window's pick, and says so."""
    from rangefinder.formats import checkpoints

    ft_model = task_dir(summary, "finetune") / "model"
    kept = checkpoints.list_checkpoints(ft_model / "checkpoints")
    assert len(kept) == 1, kept  # every other checkpoint was removed once the window was known
    (ckpt,) = kept
    update = checkpoints.checkpoint_update(ckpt)
    chosen = checkpoints.read_chosen(ft_model)
    assert chosen["update"] == update == summary["chosen_update"]
    assert chosen["rule"] == summary["chosen_rule"]  # the finetune component's output, as the run's summary says it
    assert chosen["rule"] in ("window_lowest", "window_nearest", "run_lowest"), chosen["rule"]
    # The window's lowest-loss checkpoint (analysis.delivered_checkpoint): inside the window, or, where none inside
    # was validated, the one nearest the recommended update (checkpoints every epoch = 4 updates apart).
    lo, hi = chosen["window_start_update"], chosen["window_end_update"]
    assert lo <= update <= hi or abs(update - summary["recommended_updates"]) <= 2, (update, lo, hi)
    assert summary["mixed_precision"] == "no"  # auto, on this CPU
    return ckpt, update, chosen


def check_registered_weights(summary: dict, out: Path, base_dir: Path, method: str, trained: dict,
                             delivered: Path) -> None:
    """The registered version, downloaded from the run's SQLite store, holds `trained` (the method's tensors, as a
    checkpoint stores them) on `base_dir`'s model, and the files the step delivered (`delivered`): a full
    fine-tune's are the pipeline folder with its single file, a LoRA's or an embedding's are beside the pipeline
    they were fused into, byte for byte, for the tools that load them. The grid's base column is `base_dir`, and it
    has a chosen column."""
    import mlflow
    from safetensors.torch import load_file

    uri = f"sqlite:///{out / 'mlflow.db'}"
    name, version = summary["registered_model"].removeprefix("models:/").split("/")
    mlflow.set_tracking_uri(uri)
    local = Path(mlflow.artifacts.download_artifacts(f"models:/{name}/{version}", dst_path=str(out / "registered")))
    (pipe_dir,) = {p.parent for p in local.rglob("model_index.json")}
    beside = local / "artifacts" / "delivered"
    if method == "full":
        assert (pipe_dir / "model.safetensors").read_bytes() == (delivered / "model.safetensors").read_bytes()
        assert not beside.exists()
    else:
        files = sorted(p.relative_to(delivered) for p in delivered.rglob("*") if p.is_file())
        assert files and sorted(p.relative_to(beside) for p in beside.rglob("*") if p.is_file()) == files
        for f in files:
            assert (beside / f).read_bytes() == (delivered / f).read_bytes(), f
    unet = load_file(str(pipe_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    base_unet = load_file(str(base_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    if method == "full":
        assert {k for k in trained if k.startswith("unet.")} == {f"unet.{k}" for k in unet}
        for k, v in unet.items():
            assert torch.equal(v, trained[f"unet.{k}"]), k
    elif method == "lora":
        # Fused: W + (alpha / rank) * B @ A on every adapted projection; every other weight is the base model's.
        scale = 4.0 / 4  # demo_config's lora: alpha 4, rank 4
        adapted = set()
        for key in (k for k in trained if ".lora_A." in k):
            module = key.removeprefix("unet.").split(".lora_A.")[0]
            a, b = trained[key], trained[key.replace(".lora_A.", ".lora_B.")]
            expected = base_unet[f"{module}.weight"] + scale * (b @ a)
            assert torch.allclose(unet[f"{module}.weight"], expected, atol=1e-6), module
            assert not torch.equal(unet[f"{module}.weight"], base_unet[f"{module}.weight"]), module
            adapted.add(f"{module}.weight")
        assert adapted
        for k in unet.keys() - adapted:
            assert torch.equal(unet[k], base_unet[k]), k
    else:  # textual inversion: the embedding rows of the new tokens are the checkpoint's
        from transformers import CLIPTextModel, CLIPTokenizer

        tok = CLIPTokenizer.from_pretrained(str(pipe_dir / "tokenizer"))
        emb = CLIPTextModel.from_pretrained(str(pipe_dir / "text_encoder")).get_input_embeddings().weight
        ids = tok.convert_tokens_to_ids(["<rf-concept>"])
        assert torch.equal(emb[ids].detach(), trained["text_encoder.learned_embeds"])
        for k, v in unet.items():
            assert torch.equal(v, base_unet[k]), k

    # The grid's base column is the same resolved folder the runs trained from; the chosen model has its column.
    grid = json.loads((task_dir(summary, "sample-images") / "images" / "grid.json").read_text())
    assert grid["columns"][0]["label"] == "base" and Path(grid["columns"][0]["path"]) == base_dir
    assert any(c["label"].startswith("chosen (") and "/chosen" in c["path"] for c in grid["columns"])
