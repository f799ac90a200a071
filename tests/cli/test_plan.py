"""`rangefinder plan --json` reproduces the published recipes: the installed console script in a process of its own
(the first recipe and the bad input), the rest through the entry point it calls, in this process."""

import contextlib
import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


def _script() -> str:
    beside = Path(sys.executable).parent / "rangefinder"
    found = str(beside) if beside.exists() else shutil.which("rangefinder")
    assert found, "the rangefinder console script is not installed (pip install -e .)"
    return found


def plan(*args: str, script: bool = False) -> dict:
    """`rangefinder plan --json ARGS`: the installed console script in a process of its own (`script`), else the
    entry point it calls, `rangefinder.cli.main.main`, in this process (the same parser and output)."""
    if script:
        proc = subprocess.run([_script(), "plan", "--json", *args], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        return json.loads(proc.stdout)
    from rangefinder.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["plan", "--json", *args]) == 0
    return json.loads(out.getvalue())


def test_recipe_26_images_batch_13_accum_2_full_cycle():
    p = plan("--images", "26", "--batch-size", "13", "--grad-accum", "2", "--steps", "3000",
             "--steps-unit", "micro-batch", script=True)
    assert (p["total_updates"], p["epochs"], p["full_cycle"]) == (1500, 1500, True)
    assert p["effective_batch"] == 26 and p["steps_in_micro_batches"] == 3000 and p["val_images"] == 0


@pytest.mark.parametrize("steps,updates,epochs", [("3000", 176, 346), ("150", 8, 17)])
def test_recipe_26_images_batch_3_accum_17(steps, updates, epochs):
    p = plan("--images", "26", "--batch-size", "3", "--grad-accum", "17", "--steps", steps,
             "--steps-unit", "micro-batch")
    assert (p["total_updates"], p["epochs"]) == (updates, epochs)
    assert p["full_cycle"] is False
    assert any("larger than the 26 training images" in w for w in p["warnings"])  # effective batch 51


def test_recipe_20_images_val_split_batch_4_100_epochs():
    p = plan("--images", "20", "--val-split", "0.2", "--batch-size", "4", "--epochs", "100")
    assert (p["train_images"], p["val_images"]) == (16, 4)
    assert (p["updates_per_epoch"], p["total_updates"], p["images_seen"]) == (4, 400, 1600)


def test_recipe_textual_inversion_scale_lr():
    p = plan("--images", "5", "--batch-size", "1", "--grad-accum", "4", "--steps", "3000", "--lr", "5e-4",
             "--scale-lr", "linear")
    assert p["lr"] == pytest.approx(2e-3) and p["lr_scale_factor"] == 4 and p["effective_batch"] == 4


def test_warnings():
    partial = plan("--images", "10", "--batch-size", "4", "--epochs", "1")["warnings"]
    assert any(w.startswith("partial last micro-batch") for w in partial)
    tiny = plan("--images", "20", "--batch-size", "2", "--epochs", "3")["warnings"]
    assert any("not full-cycle" in w for w in tiny)
    big = plan("--images", "8", "--batch-size", "4", "--grad-accum", "4", "--epochs", "1")["warnings"]
    assert any("effective batch 16 is larger than the 8 training images" in w for w in big)
    scaled = plan("--images", "64", "--batch-size", "16", "--epochs", "1", "--lr", "1e-6", "--scale-lr", "linear")
    assert any("multiplies the LR by 16" in w for w in scaled["warnings"])
    quiet = plan("--images", "16", "--batch-size", "4", "--grad-accum", "4", "--epochs", "10")
    assert quiet["warnings"] == [] and quiet["full_cycle"] is True


def test_bad_input_is_one_line_and_exit_2():
    proc = subprocess.run([_script(), "plan", "--images", "2", "--val-split", "0.5", "--batch-size", "0",
                           "--epochs", "1"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "batch_size must be >= 1" in proc.stderr


def test_global_batch_across_processes_and_nodes():
    # 8 GPUs per node on 2 nodes, batch 4, accumulation 2: 128 images per update.
    p = plan("--images", "1000", "--batch-size", "4", "--grad-accum", "2", "--processes-per-node", "8",
             "--nodes", "2", "--epochs", "1")
    assert p["world_size"] == 16 and p["global_batch"] == p["effective_batch"] == 128
    assert p["total_updates"] == 8  # 1000 / 128, the last update partial


@pytest.mark.parametrize("counts,says", [
    ("-1,3", "a count of images is 0 or more"),  # was "needs at least one training image" (-1,1 likewise)
    ("1,,2", "one is empty"),  # was read as 1,2: every bucket after the gap moved up one
])
def test_bad_bucket_counts_are_refused_for_what_they_say(counts, says, capsys):
    from rangefinder.cli.main import main

    # With "=": argparse takes a bare "-1,3" for an option (its own one-line "expected one argument").
    assert main(["plan", f"--bucket-counts={counts}", "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"(got {counts!r})" in err and says in err, err


def test_bucket_counts_with_a_trailing_comma_are_the_counts():
    assert plan("--bucket-counts", "3,2,", "--epochs", "1")["train_images"] == 5


def test_kohya_repeats_and_max_train_epochs_in_both_conventions():
    # sd-scripts: 20 images in a 10_name folder, train_batch_size 2 on 2 GPUs, max_train_epochs 4. Its
    # train_network.py counts ceil(len(train_dataloader) / num_processes / grad_accum) = ceil(100 / 2) = 50 steps an
    # epoch, 200 max_train_steps; each image is seen 40 times, rangefinder's 40 epochs.
    p = plan("--images", "20", "--repeats", "10", "--batch-size", "2", "--world-size", "2", "--epochs", "4")
    assert (p["train_images"], p["images_per_epoch"], p["repeats"]) == (20, 200, 10)
    assert (p["total_updates"], p["images_seen"], p["passes_over_each_image"]) == (200, 800, 40)
    loader = p["per_epoch_loader"]
    assert (loader["updates_per_epoch"], loader["max_train_steps"], loader["num_train_epochs"]) == (50, 200, 4)
    # The split is of the images, before their repeats.
    p = plan("--images", "25", "--val-split", "0.2", "--repeats", "10", "--epochs", "1")
    assert (p["train_images"], p["val_images"], p["images_per_epoch"], p["total_updates"]) == (20, 5, 200, 200)


def test_diffusers_max_train_steps_to_its_num_train_epochs_and_rangefinders_epochs():
    # The diffusers examples: 21 images, train_batch_size 2, gradient_accumulation_steps 2, max_train_steps 1100.
    # Their dataloader has ceil(21 / 2) = 11 batches an epoch, so ceil(11 / 2) = 6 updates (the last one of 1
    # micro-batch) and num_train_epochs = ceil(1100 / 6) = 184; rangefinder's stream straddles epochs, 5.25 updates
    # an epoch, and the same 1100 updates show each image 4400 / 21 times.
    p = plan("--images", "21", "--batch-size", "2", "--grad-accum", "2", "--steps", "1100")
    assert (p["updates_per_epoch"], p["total_updates"], p["passes_over_each_image"]) == (5.25, 1100, 209.5238)
    loader = p["per_epoch_loader"]
    assert (loader["updates_per_epoch"], loader["max_train_steps"], loader["num_train_epochs"]) == (6, 1100, 184)
    # With their dataloader's drop_last, the partial batch is not an epoch's.
    assert plan("--images", "21", "--batch-size", "2", "--grad-accum", "2", "--steps", "1100",
                "--drop-last")["per_epoch_loader"]["updates_per_epoch"] == 5
