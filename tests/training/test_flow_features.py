"""The engine's shared features on the flow families (issue 33, item 7), each in one short run of the tiny SD3 and
Flux: the range test's LR ramp over aspect-ratio buckets with samples during training, and a bucket off the family's
patch grid refused in one line. (Two processes on SD3: tests/cli/test_train.py's processes_per_node run; training,
validation, resume and the outputs are tests/training/test_sd3.py and tests/methods/test_flux_engine.py; the range
test's reading, its zoom, halving and the step window read only metrics.csv's val_loss, which a flow family writes
as every family does.)"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from PIL import Image

from rangefinder.config import DataConfig, SamplingConfig, TrainingConfig, ValidationConfig
from rangefinder.errors import ConfigError
from rangefinder.planning import plan_for
from rangefinder.training.loop import TrainSpec, train
from rangefinder.training.samples import read_index
from tests.training.test_bucketed_training import split_report  # noqa: F401 (the mixed-aspect split, a fixture)

FLOW_DIRS = {"sd3": "tiny_sd3_dir", "flux": "tiny_flux_dir"}
DATA = DataConfig(resolution=32)  # bucketing on: 24x40, 32x32 and 40x24, multiples of the tiny models' 8 px


def rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def base_render(model: Path, prompt: str, seed: int) -> Image.Image:
    """What the model's own diffusers pipeline renders at 32 px in 2 steps, with no guidance scale given."""
    import torch

    from rangefinder.models.loading import pipeline_call_kwargs
    from rangefinder.sampling import pipeline_class

    cls, kwargs = pipeline_class(model)
    pipe = cls.from_pretrained(str(model), local_files_only=True, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe(prompt=prompt, num_inference_steps=2, height=32, width=32,
                generator=torch.Generator("cpu").manual_seed(seed), **pipeline_call_kwargs(pipe)).images[0]


@pytest.mark.parametrize("family", FLOW_DIRS)
def test_the_range_test_ramp_runs_over_buckets_with_samples(family, split_report, request, tmp_path):  # noqa: F811
    """The range test's exp ramp (TrainSpec.ramp's schedule) on the mixed-aspect set: every update at a higher LR,
    the planned updates across the three buckets, per-sigma and per-bucket validation losses, and sample grids."""
    model = request.getfixturevalue(FLOW_DIRS[family])
    split_dir, report = split_report[0], split_report[1]
    cfg = TrainingConfig(method="lora", schedule="exp-ramp", lr_min=1e-5, lr_max=1e-2, lr=1e-2, scale_lr="none",
                         batch_size=2, epochs=1, seed=2, cache_dir=str(tmp_path / "cache"))
    sampling = SamplingConfig(prompts=["a red circle"], seeds=[0], num_inference_steps=2, resolution=32,
                              every_validations=1)  # guidance unset: the pipeline's own
    result = train(TrainSpec(cfg, ValidationConfig(every_updates=3, timesteps=2), split_dir=split_dir, model=model,
                             data=DATA, sampling=sampling), out_dir=tmp_path / "run")
    assert result.status == "ok" and result.family == family

    planned = plan_for(cfg, 12, [b["train"] for b in report["buckets"]])
    lrs = [float(r["lr"]) for r in rows(result.updates_csv)]
    assert len(lrs) == planned.total_updates == 7  # buckets of 4, 5 and 3 images: 2 + 3 + 2
    assert lrs == sorted(set(lrs)) and 1e-5 <= lrs[0] and lrs[-1] <= 1e-2
    table = rows(result.metrics_csv)
    assert [int(r["update"]) for r in table] == [0, 3, 6, 7]
    val_buckets = [b["bucket"] for b in report["buckets"] if b["val"]]
    assert len(val_buckets) > 1
    for column in ["val_loss_b0", "val_loss_b1", *(f"val_loss_{b}" for b in val_buckets)]:
        assert all(float(r[column]) > 0 for r in table), column
    index = read_index(tmp_path / "run")
    assert index is not None and [e["update"] for e in index["samples"]] == [0, 3, 6, 7]
    folder = tmp_path / "run" / "samples"
    cells = []
    for e in index["samples"]:
        assert (folder / e["grid"]).is_file()
        with Image.open(folder / e["cells"][0]) as cell:
            assert cell.size == (32, 32)
            cells.append(cell.tobytes())
    assert cells[0] != cells[-1]  # the ramp moved the weights, and the samples show it
    # At the pipeline's own guidance scale (Flux.1-dev's distilled guidance 3.5, SD3's 7.0), not 7.5 for every family:
    # the baseline, still the base model, is what the pipeline renders given none.
    assert index["settings"]["guidance_scale"] == {"sd3": 7.0, "flux": 3.5}[family]
    assert cells[0] == base_render(model, "a red circle", seed=0).tobytes()


@pytest.mark.parametrize("family", FLOW_DIRS)
def test_a_bucket_off_the_patch_grid_is_one_line(family, request):
    """The bucket check reads the family's side multiple: the transformer's 2x2 patches on the VAE's x4 (8 px) on
    the tiny models; shown at 16 px (SD3's patch set to 4; Flux with a VAE of Flux.1's depth, x8)."""
    from rangefinder.config import ModelConfig
    from rangefinder.models.loading import load_sd_components
    from rangefinder.training.encoding import check_bucket_sides
    from rangefinder.training.families import family_for

    sd = load_sd_components(ModelConfig(base_model=str(request.getfixturevalue(FLOW_DIRS[family]))))
    flow = family_for(sd, TrainingConfig())
    check_bucket_sides(sd, flow, {(24, 40), (32, 32)}, DATA)
    if family == "sd3":
        sd.unet.register_to_config(patch_size=4)
    else:
        sd.vae.register_to_config(block_out_channels=[8, 16, 32, 32])
    with pytest.raises(ConfigError, match=r"multiples of 16 px .* but buckets 24x40 are not") as e:
        check_bucket_sides(sd, flow, {(24, 40), (32, 32)}, DATA)
    assert "\n" not in str(e.value)
