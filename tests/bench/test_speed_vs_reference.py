"""The speed benchmark keeps working: the reference loop trains, and a two-update smoke run of the comparison."""

import json
import math

import pytest


@pytest.mark.slow
def test_reference_loop_trains_the_unet(tmp_path, tiny_model_dir, split_dir):
    import torch
    from diffusers import UNet2DConditionModel

    from bench.reference_loop import train_reference

    torch.set_num_threads(1)
    r = train_reference(tiny_model_dir, split_dir, updates=3, batch_size=4, resolution=32, lr=1e-3)
    assert (r.updates, r.images) == (3, 12)
    assert math.isfinite(r.final_loss) and 0 < r.final_loss < 10
    assert r.updates_per_second > 0 and r.loop_seconds > 0
    # It is the model folder's UNet that trains: its config matches the folder's.
    assert UNet2DConditionModel.load_config(str(tiny_model_dir), subfolder="unet")["sample_size"] == 8


@pytest.mark.slow
def test_reference_loop_refuses_a_batch_larger_than_the_split(tiny_model_dir, split_dir):
    """With drop_last, a batch larger than the training set yields no batch: the loop must say so, not spin (it hung
    a GPU session at batch 48 on 38 images)."""
    from bench.reference_loop import train_reference
    from rangefinder.data.split import read_split

    too_big = len(read_split(split_dir).train) + 1
    with pytest.raises(ValueError, match=f"batch_size={too_big}"):
        train_reference(tiny_model_dir, split_dir, updates=1, batch_size=too_big, resolution=32)


def test_speed_vs_reference_smoke(tmp_path, tiny_model_dir):
    import torch

    from bench.speed_vs_reference import encoders_flops_per_update, main, unet_flops_per_update

    out = tmp_path / "speed.json"
    result = main(["--smoke", "--out", str(out), "--work-dir", str(tmp_path / "work")])
    saved = json.loads(out.read_text())
    assert saved["smoke"] is True
    assert saved["tiny"] == json.loads(json.dumps(result["tiny"]))
    # --smoke is one round of 2 updates at batch 4, fp32, one torch thread, no warm-up, and never the CUDA section.
    gpu = torch.cuda.is_available()
    assert saved["cuda"] == {"skipped": "--cpu-only" if gpu else "no CUDA device"}
    assert saved["machine"]["torch"] == torch.__version__ and saved["machine"]["torch_threads"] == 1
    s = saved["tiny"]["summary"]
    assert {k: s[k] for k in ("setting", "batch_size", "mixed_precision", "updates", "rounds")} == {
        "setting": f"tiny-{'cuda' if gpu else 'cpu'}-fp32", "batch_size": 4, "mixed_precision": "no", "updates": 2,
        "rounds": 1,
    }
    assert saved["tiny"]["warmup"] == {} and "engine_cold_setup_seconds" not in s
    runs = saved["tiny"]["runs"]
    assert [(r["loop"], r["round"]) for r in runs] == [("reference", 0), ("engine", 0)]  # round 0: reference first
    for r in runs:
        assert (r["updates"], r["batch_size"]) == (2, 4)
        assert r["loop_seconds"] > 0 and r["peak_mib"] > 0
        assert r["images_per_second"] == pytest.approx(4 * r["updates_per_second"])
        # One round: each median is that round's own number.
        assert s[f"{r['loop']}_updates_per_second"] == r["updates_per_second"]
    reference, engine = runs
    # The engine's cache starts empty: it encodes the split's 20 images (16 train, 4 validation) and reuses none.
    assert engine["cache"]["latents"] == {"encoded": 20, "reused": 0}
    assert s["ratio"] == pytest.approx(engine["updates_per_second"] / reference["updates_per_second"])
    assert s["ratio_per_round"] == [pytest.approx(s["ratio"])]
    # FLOPs are counted from the model's shapes, not timed: the same on every machine.
    flops = unet_flops_per_update(tiny_model_dir, batch_size=4, resolution=32)
    encoders = encoders_flops_per_update(tiny_model_dir, batch_size=4, resolution=32)
    assert (s["flops_per_update"], s["encoder_flops_per_update"]) == (flops, encoders)
    assert s["ratio_predicted_by_flops"] == pytest.approx(1 + encoders / flops)
    assert s["engine_tflops"] == pytest.approx(flops * engine["updates_per_second"] / 1e12)
    assert s["engine_mfu"] is None and s["reference_mfu"] is None  # no peak to compare with on the CPU run
    # The engine-only section: one method in the smoke (lora, its frozen UNet counted without weight gradients).
    (row,) = saved["methods"]
    assert (row["setting"], row["updates"], row["rounds"], row["batch_size"]) == ("lora-eager", 2, 1, 4)
    assert row["images_per_second"] == pytest.approx(4 * row["updates_per_second"]) and row["mfu"] is None
    assert 0 < row["flops_per_update"] < flops


def test_flops_grow_with_the_batch(tiny_model_dir):
    from bench.speed_vs_reference import unet_flops_per_update

    one = unet_flops_per_update(tiny_model_dir, batch_size=1, resolution=32)
    four = unet_flops_per_update(tiny_model_dir, batch_size=4, resolution=32)
    assert one > 1e6
    assert four == pytest.approx(4 * one, rel=0.05)


def test_sd15_sized_unet_flops(tmp_path):
    """SD 1.5's UNet (860 M parameters) at 512 px: about 0.8 TFLOPs forward, 2.4 forward+backward per image."""
    import json

    from bench.fixtures import SD15_UNET, SD15_VAE
    from bench.speed_vs_reference import unet_flops_per_update

    for part, cfg in (("unet", dict(SD15_UNET, _class_name="UNet2DConditionModel")),
                      ("vae", dict(SD15_VAE, _class_name="AutoencoderKL"))):
        (tmp_path / part).mkdir()
        (tmp_path / part / "config.json").write_text(json.dumps(cfg))
    flops = unet_flops_per_update(tmp_path, batch_size=1, resolution=512)
    assert 2.2e12 < flops < 2.6e12


def test_reference_encoders_flops(tiny_model_dir):
    """What the reference adds per update (VAE encode + text encoder) grows with the batch and is a real share."""
    from bench.speed_vs_reference import encoders_flops_per_update, unet_flops_per_update

    one = encoders_flops_per_update(tiny_model_dir, batch_size=1, resolution=32)
    two = encoders_flops_per_update(tiny_model_dir, batch_size=2, resolution=32)
    assert two == pytest.approx(2 * one, rel=0.01)
    assert 0.01 < one / unet_flops_per_update(tiny_model_dir, batch_size=1, resolution=32) < 10


def test_device_peaks_by_name():
    from bench.speed_vs_reference import device_peak_flops

    assert device_peak_flops("NVIDIA H100 80GB HBM3") == 989e12
    assert device_peak_flops("NVIDIA H100 PCIe") == 756e12
    assert device_peak_flops("NVIDIA A100-SXM4-40GB") == 312e12
    assert device_peak_flops("Some Unknown GPU") is None


@pytest.mark.slow
def test_sized_section_logic_on_cpu(tmp_path):
    """The GPU section's steps (largest batch, comparison at 4 and at it, FLOPs, MFU) on the tiny model on CPU:
    no GPU here, so this is what keeps that path honest until one runs it."""
    import torch

    from bench.fixtures import tiny_setup
    from bench.speed_vs_reference import sized_section

    torch.set_num_threads(1)
    setup = tiny_setup(tmp_path / "work", "shapes", images=20)
    out = sized_section(setup, device="cpu", mixed_precision="no", candidates=[2, 8], rounds=1, updates=2,
                        peak_flops=1e12, cache_dir=tmp_path / "cache", label="tiny")
    assert out["largest_batch"] == 8 and [t["fits"] for t in out["largest_batch_search"]] == [True, True]
    assert [s["summary"]["batch_size"] for s in out["settings"]] == [4, 8]
    for s in (x["summary"] for x in out["settings"]):
        assert s["ratio_predicted_by_flops"] > 1
        assert s["engine_mfu"] == pytest.approx(s["flops_per_update"] * s["engine_updates_per_second"] / 1e12)
        assert s["reference_images_per_second"] == pytest.approx(s["batch_size"] * s["reference_updates_per_second"])
