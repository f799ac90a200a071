"""The typed config rejects every invalid value with a message naming the field, and loads from YAML."""

from pathlib import Path

import pytest

from rangefinder.config import RangefinderConfig, demo_config, load_config, parse_config, plan, val_count
from rangefinder.errors import ConfigError


@pytest.mark.parametrize(
    "raw,field,hint",
    [
        ({"split": {"val_split": 1.0}}, "split.val_split", "less than 1"),
        ({"split": {"val_split": -0.1}}, "split.val_split", "greater than or equal to 0"),
        ({"split": {"val_split": 0.0}}, "split.val_split", "needs val_split > 0"),
        ({"split": {"stabilize_split": 1.5}}, "split.stabilize_split", "less than or equal to 1"),
        ({"data": {"resolution": 30}}, "data.resolution", "multiple of 8"),
        ({"data": {"min_images": 1}}, "data.min_images", "greater than or equal to 2"),
        ({"data": {"colour": "red"}}, "data.colour", "Extra inputs are not permitted"),
        ({"trainng": {}}, "trainng", "Extra inputs are not permitted"),
        ({"training": {"batch_size": 0}}, "training.batch_size", "greater than or equal to 1"),
        ({"training": {"lr": 0}}, "training.lr", "greater than 0"),
        ({"training": {"epochs": 2, "steps": 10}}, "training", "either training.epochs or training.steps"),
        ({"training": {"schedule": "triangular", "lr_min": 1e-3, "lr_max": 1e-4}}, "training.lr_max",
         "must be above training.lr_min"),
        ({"training": {"schedule": "exp-ramp", "lr_max": 1e-2}}, "training.lr_min", "lr_min > 0"),
        ({"training": {"schedule": "cosine-ish"}}, "training.schedule", "Input should be"),
        ({"training": {"steps_unit": "epoch"}}, "training.steps_unit", "'update' or 'micro-batch'"),
        ({"lr_range_test": {"lr_min": 1e-2, "lr_max": 1e-3}}, "lr_range_test.lr_max", "must be above"),
        ({"lr_range_test": {"midpoint": "harmonic"}}, "lr_range_test.midpoint", "'tuned', 'geometric' or 'arithmetic'"),
        ({"validation": {"divergence_factor": 1.0}}, "validation.divergence_factor", "greater than 1"),
        ({"finetune": {"tolerance": 0}}, "finetune.tolerance", "greater than 0"),
        ({"sampling": {"prompts": []}}, "sampling.prompts", "at least one"),
        ({"lr": -1}, "lr", "greater than 0"),
    ],
)
def test_invalid_values_name_the_field(raw, field, hint):
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    msg = str(e.value)
    assert field in msg and hint in msg, msg


def test_defaults_and_demo_are_valid():
    cfg = RangefinderConfig()
    assert cfg.split.val_split == 0.2 and cfg.data.resolution == 512
    demo = demo_config()
    assert demo.data.resolution == 32 and demo.model.base_model is None


def test_val_split_always_leaves_a_training_image():
    # ceil(p*N) validation images, at least one, and never all of them.
    assert [val_count(n, 0.2) for n in (2, 5, 20, 21)] == [1, 1, 4, 5]
    assert val_count(2, 0.99) == 1 and val_count(10, 0.0) == 0
    p = plan(2, val_split=0.99, epochs=1)
    assert (p.train_images, p.val_images) == (1, 1)
    with pytest.raises(ConfigError, match="no training images left"):
        plan(1, val_split=0.0, epochs=1, train_images=0)


def test_yaml_loading(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "data:\n  dataset_dir: /data/dogs\n  resolution: 64\n"
        "training:\n  method: lora\n  batch_size: 2\n  lora:\n    rank: 8\n"
        "lr_range_test:\n  lr_min: 1.0e-6\n  lr_max: 1.0e-3\n"
    )
    cfg = load_config(path, overrides={"training": {"grad_accum": 3}})
    assert cfg.data.dataset_dir == "/data/dogs" and cfg.data.resolution == 64
    assert cfg.training.method == "lora" and cfg.training.lora.rank == 8 and cfg.training.lora.alpha == 4.0
    assert (cfg.training.batch_size, cfg.training.grad_accum) == (2, 3)
    assert cfg.lr_range_test.lr_max == 1e-3


def test_yaml_errors_name_the_file_and_field(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    listy = tmp_path / "list.yaml"
    listy.write_text("- a\n- b\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(listy)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("data:\n  resolution: 100\n")
    with pytest.raises(ConfigError, match=r"data\.resolution: must be a multiple of 8.*try 96"):
        load_config(wrong)


def test_lr_range_defaults_follow_the_method():
    """Adapters and embeddings learn ~100x higher than full fine-tuning: their default sweep reaches higher."""
    from rangefinder.config import DEFAULT_LR_RANGE, RangefinderConfig

    for method, (lo, hi) in DEFAULT_LR_RANGE.items():
        cfg = RangefinderConfig.model_validate({"training": {"method": method}})
        assert cfg.lr_range_test.range_for(method) == (lo, hi)
    assert DEFAULT_LR_RANGE["lora"][1] >= 100 * DEFAULT_LR_RANGE["full"][1]
    # One end set by hand keeps the other's default, and an impossible pair is refused naming both fields.
    cfg = RangefinderConfig.model_validate({"lr_range_test": {"lr_max": 0.5}, "training": {"method": "lora"}})
    assert cfg.lr_range_test.range_for("lora") == (DEFAULT_LR_RANGE["lora"][0], 0.5)
    with pytest.raises(ConfigError, match="lr_range_test.lr_max .* must be above lr_range_test.lr_min"):
        parse_config({"lr_range_test": {"lr_min": 0.05}, "training": {"method": "full"}})


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load_and_compile(path, tmp_path):
    """The README points people at configs/: each must validate and compile into a pipeline package."""
    from rangefinder.pipelines.pipeline import compile_pipeline

    cfg = load_config(path)
    out = compile_pipeline(cfg, str(tmp_path / "pipeline.yaml"))
    assert Path(out).stat().st_size > 1000
