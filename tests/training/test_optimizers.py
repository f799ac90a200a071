"""training.optimizer: each optimizer trains, resumes bit-exactly after kill -9 with its state loadable by
torch.load(weights_only=True), logs its effective LR; a schedule-free one is measured and saved in its eval mode;
the wrong combinations are one line each; an LR-free one skips the pipeline's range test."""

from __future__ import annotations

import csv
import json
import signal
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rangefinder.config import TrainingConfig, ValidationConfig, parse_config
from rangefinder.errors import ConfigError
from rangefinder.training.loop import TrainSpec, train
from tests.training.test_resume import run_child

UNET = Path("final") / "unet" / "diffusion_pytorch_model.safetensors"
# adamw (the default) has its own resume test (test_resume.py); adamw8bit needs CUDA (bitsandbytes).
OPTIMIZERS = ["prodigy", "prodigy_schedule_free", "adamw_schedule_free", "adafactor"]
# A schedule-free or LR-free optimizer's LR is its own default scale; the others a tiny model's usual one.
LR = {"prodigy": 1.0, "prodigy_schedule_free": 1.0, "adamw_schedule_free": 2.5e-3, "adafactor": 1e-3}


def _updates(out: Path) -> list[dict]:
    with open(out / "updates.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_each_optimizer_trains_and_resumes_bit_exactly_after_kill_9(optimizer, split_dir, tiny_model_dir, tmp_path):
    from rangefinder.training.restore import method_from_checkpoint

    # One epoch (16 images / batch 4 = 4 updates), validated and checkpointed every 2: killed inside update 3, the
    # resume restores the optimizer's state from a checkpoint mid-run (adamw's resume across epochs: test_resume.py).
    training = dict(optimizer=optimizer, lr=LR[optimizer], batch_size=4, epochs=1, seed=7, checkpoint_every_updates=2,
                    keep_checkpoints=5, cache_dir=str(tmp_path / "cache"))
    validation = dict(every_updates=2)
    base = dict(split_dir=str(split_dir), model=str(tiny_model_dir), training=training, validation=validation)

    whole = train(TrainSpec(TrainingConfig(**training), ValidationConfig(**validation), split_dir=split_dir,
                            model=tiny_model_dir), out_dir=tmp_path / "whole")
    # It trains: 4 updates move the weights and the loss, and the optimizer's own step size is logged.
    assert whole.status == "ok" and whole.updates == 4
    rows = _updates(tmp_path / "whole")
    assert len({r["train_loss"] for r in rows}) > 1
    effective = [float(r["lr_effective"]) for r in rows]
    assert all(e > 0 for e in effective)
    if optimizer.startswith("prodigy"):
        # d*lr: Prodigy's estimate (prodigy_d_lr) grows from d0 = 1e-6 as it learns the distance; it is not the lr
        # multiplier. Each update steps with the estimate from before it (the packages' defaults: no bias correction).
        estimate = [float(r["prodigy_d_lr"]) for r in rows]
        assert effective[0] != LR[optimizer] and estimate[-1] > estimate[0]
        assert effective[1:] == estimate[:-1]
    else:
        assert {r["prodigy_d_lr"] for r in rows} == {""}
    base_unet = load_file(str(tiny_model_dir / "unet" / "diffusion_pytorch_model.safetensors"))
    trained = load_file(str(tmp_path / "whole" / UNET))
    assert any(not torch.equal(base_unet[k], trained[k]) for k in trained)

    # Checkpoint at 2; killed inside update 3.
    cut = tmp_path / "cut"
    killed = run_child({**base, "out_dir": str(cut), "kill_at_update": 3}, tmp_path, "killed")
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    ckpt = cut / "checkpoints" / "checkpoint-000002"
    # The optimizer's whole state (Prodigy's d in param_groups, schedule-free's z) loads as plain data.
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert state["state"] and state["param_groups"]
    resumed = train(TrainSpec(TrainingConfig(**training, resume=True), ValidationConfig(**validation),
                              split_dir=split_dir, model=tiny_model_dir), out_dir=cut)
    assert resumed.resumed_from == 2 and resumed.updates == 4
    for name in ("metrics.csv", "updates.csv"):
        assert (cut / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    resumed_unet = load_file(str(cut / UNET))
    assert all(torch.equal(trained[k], resumed_unet[k]) for k in trained)

    # The last checkpoint's model (what the fine-tune delivers from a checkpoint) is final/'s: for a schedule-free
    # optimizer its averaged weights, not the ones it steps from.
    method, _ = method_from_checkpoint(cut / "checkpoints" / "checkpoint-000004", tiny_model_dir)
    exported = {k.removeprefix("unet."): v for k, v in method.trainable_state_dict().items()}
    shared = [k for k in trained if k in exported]
    assert shared and all(torch.equal(exported[k].cpu(), trained[k]) for k in shared)


@pytest.mark.slow
def test_validating_a_schedule_free_run_changes_nothing_it_trains(split_dir, tiny_model_dir, tmp_path):
    """Validation swaps in the averaged weights and puts the stepping ones back bit for bit: a run validated every
    update trains exactly what one validated once per epoch does."""
    training = TrainingConfig(optimizer="adamw_schedule_free", lr=2.5e-3, batch_size=4, epochs=1, seed=3,
                              cache_dir=str(tmp_path / "cache"))
    outs = []
    for every in (1, 4):
        out = tmp_path / f"every{every}"
        train(TrainSpec(training, ValidationConfig(every_updates=every), split_dir=split_dir, model=tiny_model_dir),
              out_dir=out)
        outs.append(out)
    a, b = (load_file(str(o / UNET)) for o in outs)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert [r["train_loss"] for r in _updates(outs[0])] == [r["train_loss"] for r in _updates(outs[1])]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["adamw_schedule_free", "prodigy_schedule_free"])
def test_a_schedule_free_run_with_ema_delivers_from_its_checkpoint_what_it_saved(optimizer, split_dir,
                                                                                  tiny_model_dir, tmp_path):
    """use_ema: true beside a schedule-free optimizer: the run validates and saves its EMA (Run.ema_weights inside
    Run.schedule_free_eval), so the model a checkpoint delivers is that EMA too, not the optimizer's average of the
    EMA and its z (restore applied the EMA first, then the eval mode on top of it)."""
    from rangefinder.training.restore import delivered_state, method_from_checkpoint

    training = TrainingConfig(optimizer=optimizer, lr=LR[optimizer], batch_size=4, epochs=1, seed=7, use_ema=True,
                              ema_decay=0.5, checkpoint_every_updates=4, cache_dir=str(tmp_path / "cache"))
    train(TrainSpec(training, ValidationConfig(every_updates=4), split_dir=split_dir, model=tiny_model_dir),
          out_dir=tmp_path / "run")
    saved = load_file(str(tmp_path / "run" / UNET))
    ckpt = tmp_path / "run" / "checkpoints" / "checkpoint-000004"
    method, _ = method_from_checkpoint(ckpt, tiny_model_dir)
    for delivered in (method.trainable_state_dict(), delivered_state(ckpt, tiny_model_dir)):
        delivered = {k.removeprefix("unet."): v for k, v in delivered.items()}
        shared = [k for k in saved if k in delivered]
        assert shared and all(torch.equal(delivered[k].cpu(), saved[k]) for k in shared)


@pytest.mark.slow
@pytest.mark.parametrize("settings", ["diffusers", "package"])
def test_prodigy_logs_the_step_size_each_update_took_and_its_estimate_after_it(settings, split_dir, tiny_model_dir,
                                                                               tmp_path):
    """lr_effective is the step each update took, measured off the weights: prodigyopt moves them by d x lr x its
    bias correction with the d from before the update (not the one the step computes for the next), so at update t
    (before - after) = dlr * (exp_avg / (sqrt(exp_avg_sq) + d eps) + weight_decay * before) for every weight.
    prodigy_d_lr is d x lr after the update, what the checkpoint holds: what lr_effective logged before it, which
    the prodigy_step finder's factors were measured on. diffusers' settings have the bias correction on (d does
    not move in 4 updates there); the package's defaults have it off and d grows within 4 updates."""
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    from rangefinder.analysis import read_curve_csv, read_prodigy_step
    from rangefinder.training.optimizers import PRODIGY_SETTINGS

    taken: list[float] = []
    before: dict[int, torch.Tensor] = {}

    def snapshot(optimizer, args, kwargs):
        before.update({id(p): p.detach().clone() for p in optimizer.param_groups[0]["params"] if p.grad is not None})

    def measure(optimizer, args, kwargs):  # least squares of the moves against the direction: the dlr taken
        group, num, den = optimizer.param_groups[0], 0.0, 0.0
        for p in group["params"]:
            if id(p) not in before:
                continue
            state, old = optimizer.state[p], before[id(p)].double()
            u = state["exp_avg"].double() / (state["exp_avg_sq"].double().sqrt() + group["d"] * group["eps"])
            u += group["weight_decay"] * old
            num += float(((old - p.detach().double()) * u).sum())
            den += float((u * u).sum())
        before.clear()
        taken.append(num / den)

    training = TrainingConfig(optimizer="prodigy", lr=1.0, prodigy=PRODIGY_SETTINGS if settings == "diffusers" else {},
                              batch_size=4, epochs=1, seed=7, checkpoint_every_updates=4,
                              cache_dir=str(tmp_path / "cache"))
    hooks = [register_optimizer_step_pre_hook(snapshot), register_optimizer_step_post_hook(measure)]
    try:
        result = train(TrainSpec(training, ValidationConfig(every_epochs=0), split_dir=split_dir,
                                 model=tiny_model_dir), out_dir=tmp_path / "run")
    finally:
        for hook in hooks:
            hook.remove()
    assert result.status == "ok" and result.updates == len(taken) == 4
    updates = read_curve_csv(tmp_path / "run" / "updates.csv", required=("lr_effective", "prodigy_d_lr"))
    assert updates["lr_effective"].tolist() == pytest.approx(taken, rel=1e-3)
    # Today's bug would log d x lr after the update: from update 2 on that is not the step taken (the bias
    # correction is 0.74 there; without it, d has grown by the last update).
    d_lr = updates["prodigy_d_lr"]
    assert abs(d_lr[-1] / taken[-1] - 1) > 0.05
    # The estimate after the last update is the final checkpoint's d x lr, and is what prodigy_step reads.
    group = torch.load(tmp_path / "run" / "checkpoints" / "checkpoint-000004" / "optimizer.pt",
                       weights_only=True)["param_groups"][0]
    assert d_lr[-1] == float(group["d"]) * float(group["lr"])
    if settings == "package":
        assert read_prodigy_step(updates, None, 1.0).step_size == d_lr[-1] > d_lr[0]


# ---------------------------------------------------------------------------------------------------------------
# Wrong combinations: one line each


@pytest.mark.parametrize("bad, message", [
    (dict(training=dict(optimizer="adamw_schedule_free", schedule="cosine", steps=10)), "schedule-free"),
    (dict(training=dict(optimizer="prodigy_schedule_free"), finetune=dict(schedule="triangular")),
     "finetune.schedule"),
    (dict(training=dict(optimizer="prodigy"), lr_range_test=dict(lr_min=1e-6)), "LR-free"),
    (dict(training=dict(optimizer="prodigy", use_8bit_adam=True)), "use_8bit_adam"),
    (dict(training=dict(optimizer="prodigy", scale_lr="linear")), "scale_lr"),
    # `train` with a ramp is the range test: refused as the pipeline's is (it trained, measuring nothing).
    (dict(training=dict(optimizer="prodigy", schedule="exp-ramp", lr_min=1e-3, lr_max=10)), "exp-ramp.*LR-free"),
    (dict(training=dict(optimizer="prodigy_schedule_free", schedule="linear-ramp", lr_max=10)), "linear-ramp.*LR-free"),
], ids=["schedule-free-cosine", "schedule-free-triangular-finetune", "range-test-with-prodigy", "8bit-and-prodigy",
        "prodigy-scaled-lr", "ramp-with-prodigy", "ramp-with-prodigy-schedule-free"])
def test_a_wrong_combination_is_one_config_line(bad, message):
    with pytest.raises(ConfigError, match=message) as err:
        parse_config(bad)
    assert "\n" not in str(err.value)


def test_use_8bit_adam_is_read_as_adamw8bit_and_lr_free_optimizers_default_to_lr_1():
    assert TrainingConfig(use_8bit_adam=True).optimizer == "adamw8bit"
    assert TrainingConfig(use_8bit_adam=False).optimizer == "adamw"
    assert "use_8bit_adam" not in TrainingConfig(use_8bit_adam=True).model_dump()
    assert TrainingConfig(optimizer="prodigy").lr == 1.0 and TrainingConfig(optimizer="prodigy", lr=0.5).lr == 0.5
    assert TrainingConfig(optimizer="adamw").lr == TrainingConfig().lr


def test_adamw8bit_without_cuda_is_one_line():
    from rangefinder.training.optimizers import check_optimizer

    with pytest.raises(ConfigError, match="adamw8bit.*CUDA") as err:
        check_optimizer(TrainingConfig(optimizer="adamw8bit"), cuda=False)
    assert "\n" not in str(err.value)
    check_optimizer(TrainingConfig(optimizer="adamw8bit"), cuda=True)


def test_a_missing_optimizer_package_names_the_pip_install(monkeypatch):
    from rangefinder.training.optimizers import make_optimizer

    # An import of them now fails, as when not installed: an optional one names the extra, prodigyopt (a dependency
    # of rangefinder since the prodigy_step LR finder) itself.
    monkeypatch.setitem(sys.modules, "schedulefree", None)
    monkeypatch.setitem(sys.modules, "prodigyopt", None)
    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    with pytest.raises(ConfigError, match=r"pip install 'rangefinder\[optimizers\]'") as err:
        make_optimizer(TrainingConfig(optimizer="adamw_schedule_free"), params, 1.0)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"training.optimizer prodigy needs the prodigyopt .*pip install prodigyopt"
                       ) as err:
        make_optimizer(TrainingConfig(optimizer="prodigy"), params, 1.0)
    assert "\n" not in str(err.value)


def test_the_cli_says_a_wrong_combination_in_one_line(tmp_path):
    import subprocess

    config = tmp_path / "c.yaml"
    config.write_text("training: {schedule: cosine, steps: 4}\n")
    out = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "train", "--data", str(tmp_path / "split"),
                          "--out", str(tmp_path / "out"), "--config", str(config), "--optimizer",
                          "adamw_schedule_free"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "schedule-free" in lines[0], out.stderr


def test_adamw8bit_without_cuda_is_one_line_before_anything_is_written_by_compile_and_a_local_run(tmp_path):
    """compile: training pods without a GPU (kubernetes.gpu_count 0) would fail every training step on the cluster;
    run --local on a machine without CUDA ran resolve-config and prepare-dataset, wrote OUT, and stopped at the range
    test in a ten-line log. Both are now one line, exit 2, nothing written."""
    import subprocess

    def rangefinder(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True, text=True,
                              timeout=120)

    config = tmp_path / "c.yaml"
    config.write_text("training: {use_8bit_adam: true}\nkubernetes: {gpu_count: 0}\n")
    out = tmp_path / "pipeline.yaml"
    cases = [(("compile", "--config", str(config), "--out", str(out)), out, "kubernetes.gpu_count is 0")]
    if not torch.cuda.is_available():
        cases.append((("run", "--local", "--config", str(config), "--out", str(tmp_path / "run")), tmp_path / "run",
                      "on this machine"))
    for args, written, words in cases:
        proc = rangefinder(*args)
        lines = [line for line in proc.stderr.splitlines() if line.strip() and "warning" not in line]
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "adamw8bit" in lines[0] and "CUDA" in lines[0] and words in lines[0], lines[0]
        assert not written.exists()
    # With a GPU in the pods the cluster's package compiles (this machine's CUDA is not the cluster's).
    config.write_text("training: {optimizer: adamw8bit}\n")
    assert rangefinder("compile", "--config", str(config), "--out", str(out)).returncode == 0 and out.is_file()


# ---------------------------------------------------------------------------------------------------------------
# The pipeline with an LR-free optimizer: no range test


def test_an_lr_free_optimizer_skips_the_range_test(tiny_model_dir, split_dir, tmp_path):
    from rangefinder.steps.choose_lr import run_choose_lr
    from rangefinder.steps.halving import halving_applies
    from rangefinder.steps.lr_range_test import run_lr_range_test
    from rangefinder.steps.resolve_config import run_resolve_config

    model = {"base_model": str(tiny_model_dir)}
    cfg = parse_config({"training": {"optimizer": "prodigy"}, "model": model})
    # resolve-config's fixed_lr is the DAG's condition: non-zero takes the fixed-lr branch (no discovery).
    resolved = run_resolve_config(json.dumps({"training": {"optimizer": "prodigy"}, "model": model}))
    assert resolved.fixed_lr == 1.0
    adamw = run_resolve_config(json.dumps({"training": {"optimizer": "adamw"}, "model": model}))
    assert adamw.fixed_lr == 0.0  # AdamW still discovers its LR
    # choose-lr on that branch says why; the fine-tune's bounds collapse: one constant run, no halving.
    report = tmp_path / "lr.md"
    chosen = run_choose_lr(cfg, source="fixed", lr_low=1.0, lr_high=1.0, lr_mid=1.0, decision_path=report)
    assert "prodigy is LR-free" in report.read_text() and "range test skipped" in report.read_text()
    assert not halving_applies(True, True, "constant", chosen.lr_mid, chosen.lr_high)
    # The fine-tune the engine is given: Prodigy, constant, at its multiplier 1.0.
    from rangefinder.data.split import read_split

    tc = TrainSpec.finetune(cfg, read_split(split_dir), bounds=(chosen.lr_low, chosen.lr_high), lr=chosen.lr_mid,
                            world_size=1).training
    assert (tc.optimizer, tc.schedule, tc.lr) == ("prodigy", "constant", 1.0)
    # Running the range test anyway is one clear error, before anything is read.
    with pytest.raises(ConfigError, match="LR-free") as err:
        run_lr_range_test(cfg, split_dir=tmp_path / "nowhere", out_dir=tmp_path / "out")
    assert "\n" not in str(err.value)


def test_training_prodigy_reaches_prodigy_and_unset_keeps_the_package_defaults():
    from prodigyopt import Prodigy

    from rangefinder.training.optimizers import PRODIGY_SETTINGS, make_optimizer

    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    recipe = make_optimizer(TrainingConfig(optimizer="prodigy", prodigy=PRODIGY_SETTINGS), params, 1.0)
    group = recipe.param_groups[0]
    assert (group["betas"], group["weight_decay"], group["use_bias_correction"], group["safeguard_warmup"]) == \
        ((0.9, 0.99), 0.01, True, True)
    plain = make_optimizer(TrainingConfig(optimizer="prodigy"), params, 1.0).param_groups[0]
    package = Prodigy(params, lr=1.0).param_groups[0]
    assert {k: plain[k] for k in PRODIGY_SETTINGS} == {k: package[k] for k in PRODIGY_SETTINGS}


def test_adamw_gets_the_betas_eps_and_weight_decay_set_and_adafactor_steps_at_the_lr_given():
    """training.adam_beta1/2, adam_epsilon and weight_decay reach AdamW in their places; Adafactor's own LR
    (relative_step, scale_parameter, warmup_init) is off, so an update moves a weight by the LR it was given (its
    first step on a zero weight: the clipped, RMS-normalised gradient's sign times lr), and the LR logged is that."""
    from rangefinder.training.optimizers import make_optimizer, step_optimizer

    params = [{"params": [torch.nn.Parameter(torch.zeros(2))]}]
    cfg = TrainingConfig(adam_beta1=0.8, adam_beta2=0.95, adam_epsilon=1e-6, weight_decay=0.03)
    group = make_optimizer(cfg, params, 2e-4).param_groups[0]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (2e-4, (0.8, 0.95), 1e-6, 0.03)

    weight = torch.nn.Parameter(torch.zeros(4))
    adafactor = make_optimizer(TrainingConfig(optimizer="adafactor"), [{"params": [weight]}], 1e-3)
    assert {k: adafactor.param_groups[0][k] for k in ("relative_step", "scale_parameter", "warmup_init")} == \
        dict.fromkeys(("relative_step", "scale_parameter", "warmup_init"), False)
    weight.grad = torch.tensor([1.0, -1.0, 1.0, -1.0])
    assert step_optimizer("adafactor", adafactor) == {"lr_effective": 1e-3, "prodigy_d_lr": None}
    assert torch.allclose(weight.detach(), torch.tensor([-1e-3, 1e-3, -1e-3, 1e-3]))


def test_prodigy_logs_d_times_its_lr_when_the_lr_multiplier_is_not_1():
    """Prodigy's training.lr multiplies its d: prodigy_d_lr is d x lr after the step (at lr 1.0, as every run
    above trains, d alone would pass), and lr_effective is d x lr x the bias correction before it."""
    from rangefinder.training.optimizers import PRODIGY_SETTINGS, make_optimizer, step_optimizer

    weight = torch.nn.Parameter(torch.ones(4))
    optimizer = make_optimizer(TrainingConfig(optimizer="prodigy", lr=0.5, prodigy=PRODIGY_SETTINGS),
                               [{"params": [weight]}], 0.5)
    group = optimizer.param_groups[0]
    d0 = group["d"]
    weight.grad = torch.tensor([1.0, -2.0, 3.0, -4.0])
    logged = step_optimizer("prodigy", optimizer)
    assert logged["prodigy_d_lr"] == group["d"] * 0.5
    assert logged["lr_effective"] == pytest.approx(d0 * 0.5 * (1 - 0.99) ** 0.5 / (1 - 0.9), rel=1e-12)
