"""Bad input through the real CLI (issue 16): one line on stderr naming the problem and the fix, exit status 2, no
traceback, and nothing written or built before the check.

Every command tested here runs as `rangefinder` in a process of its own at least once (its exit status, and that
nothing else reaches stderr: import-time warnings, a traceback): plan, demo, compile (a refused config and one that
compiles with warnings), run --local, train (to the model's loading: torch and diffusers imported), split,
analyze-lr, make-dataset, sample, relog, make-base-model. Every other call goes to the same entry point,
`rangefinder.cli.main.main`, in this process (`in_process`), which saves a Python start and its imports each.
"""

from __future__ import annotations

import io
import logging
import os
import shlex
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from tests.conftest import delivered_files
from tests.tracking.fixtures import free_port

NEEDS_TOMLLIB = pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no TOML reader")


def rangefinder(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True, text=True,
                          timeout=timeout, env=full_env)


def in_process(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`rangefinder(*args)` through the console script's own entry point in this process: its exit status (the
    parser's SystemExit included) and what it printed, Python's warnings and the libraries' log lines included as a
    fresh process shows them."""
    from rangefinder.cli.main import main

    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update({k: v for k, v in saved.items() if not k.startswith("MLFLOW_")} | (env or {}))
    out, err = io.StringIO(), io.StringIO()
    try:
        with warnings.catch_warnings(record=True) as caught, _library_logs_to(err), redirect_stdout(out), \
                redirect_stderr(err):
            # Python's default filters (pytest's would hide what a user sees), every occurrence recorded.
            warnings.resetwarnings()
            warnings.simplefilter("always")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            try:
                code = main(list(args))
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
    finally:
        os.environ.clear()
        os.environ.update(saved)
    shown = "".join(warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line) for w in caught)
    return subprocess.CompletedProcess(["rangefinder", *args], code, out.getvalue(), err.getvalue() + shown)


@contextmanager
def _library_logs_to(stream: io.StringIO) -> Iterator[None]:
    """The log handlers that a library imported earlier in this process bound to the stderr of then (huggingface_hub,
    diffusers, transformers and torch add one on their import; pytest's capture, or a test's own, closed since) write
    to `stream` while inside, as in a fresh process whose command imports them. Those a command added follow
    sys.stderr already (cli.main)."""
    loggers = [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
    bound = [h for lg in loggers if isinstance(lg, logging.Logger) for h in lg.handlers
             if type(h) is logging.StreamHandler
             and (h.stream is sys.stderr or h.stream is sys.__stderr__ or getattr(h.stream, "closed", False))]
    # diffusers' and transformers' handlers also flush with the `sys.stderr.flush` of their import.
    saved = [(h.stream, vars(h).pop("flush", None)) for h in bound]
    for handler in bound:
        handler.stream = stream
    try:
        yield
    finally:
        for handler, (previous, flush) in zip(bound, saved, strict=True):
            handler.stream = previous
            if flush is not None:
                handler.flush = flush  # type: ignore[method-assign]


def assert_one_line_error(proc: subprocess.CompletedProcess, *words: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize("lr", ["-1", "nan", "inf", "0"])
def test_plan_refuses_a_non_finite_or_non_positive_lr(lr):
    run = rangefinder if lr == "-1" else in_process
    assert_one_line_error(run("plan", "--images", "10", "--epochs", "1", "--lr", lr),
                          "lr must be a finite number above 0")


def test_plan_takes_a_large_lr():
    proc = in_process("plan", "--images", "10", "--epochs", "1", "--lr", "10", "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"lr": 10.0' in proc.stdout


@pytest.mark.parametrize("lr", ["-1", "nan", "inf"])
def test_demo_refuses_a_bad_lr_before_building_anything(lr, tmp_path):
    out = tmp_path / "demo"
    run = rangefinder if lr == "-1" else in_process
    line = assert_one_line_error(run("demo", "--lr", lr, "--out", str(out)), "lr:")
    assert "rangefinder demo: error:" in line
    assert not out.exists()  # no dataset, no model build, no empty --out left behind


def test_demo_refuses_credentials_in_the_tracking_uri_before_writing(tmp_path):
    """MLFLOW_TRACKING_URI with a user and password in it: the demo built its --out, dataset and model, and compiled
    its pipeline, before the local run refused the URI. Now it is refused first, with nothing written, the password
    not printed."""
    out = tmp_path / "demo"
    uri = f"http://someone:hunter2@127.0.0.1:{free_port()}"
    line = assert_one_line_error(in_process("demo", "--out", str(out), env={"MLFLOW_TRACKING_URI": uri}),
                                 "MLFLOW_TRACKING_URI", "holds")
    assert line.startswith("rangefinder demo: error:") and "hunter2" not in line
    assert not out.exists()


def test_demo_on_the_out_of_a_running_demo_is_refused_before_writing(tmp_path):
    """A second demo on the --out of one still running (by mistake, in another terminal): it made the dataset and
    model there and compiled its pipeline over the running one's pipeline.yaml before the folder's lock refused it."""
    import fcntl

    from rangefinder.training.outdir import LOCK_NAME

    out = tmp_path / "demo"
    out.mkdir()
    (out / "pipeline.yaml").write_text("the running demo's\n")
    running = os.open(out / LOCK_NAME, os.O_RDWR | os.O_CREAT)
    fcntl.flock(running, fcntl.LOCK_EX)  # as the running demo's process holds it
    try:
        assert_one_line_error(in_process("demo", "--out", str(out)), "is in use by another rangefinder run")
    finally:
        os.close(running)
    assert sorted(p.name for p in out.iterdir()) == [LOCK_NAME, "pipeline.yaml"]
    assert (out / "pipeline.yaml").read_text() == "the running demo's\n"


@pytest.mark.parametrize("variable,value", [("RANGEFINDER_CACHE", "~rf-no-such-user/cache"),
                                            ("RANGEFINDER_WORK", "~rf-no-such-user/work"),
                                            ("RANGEFINDER_MLFLOW_SPOOL", "~rf-no-such-user/spool"),
                                            ("MLFLOW_TRACKING_URI", "sqlite:///~rf-no-such-user/mlflow.db")])
def test_demo_and_run_local_refuse_a_variable_s_path_under_no_user_s_home_before_writing(variable, value, tmp_path):
    """A variable the run reads, set to a path under the home of a user not on this machine: the demo made its --out,
    dataset and model before it read $RANGEFINDER_CACHE and refused it (the others, in a step of the run it started);
    run --local took --out's lock and made its pipeline root. Both now refuse it first, with nothing written."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data:\n  resolution: 32\n")
    for command in (["demo"], ["run", "--local", "--config", str(cfg)]):
        out = tmp_path / f"{command[0]}-out"
        line = assert_one_line_error(in_process(*command, "--out", str(out), env={variable: value}),
                                     f"${variable}: ", "the home folder of a user this machine does not have")
        assert line.startswith(f"rangefinder {command[0]}: error:")
        assert not out.exists()


@pytest.mark.parametrize(
    "yaml_text,words",
    [
        ("training:\n  lr: .inf\n", ["training.lr", "finite number"]),
        ("training:\n  lr: .nan\n", ["training.lr", "finite number"]),
        ("training:\n  lr: -1\n", ["training.lr", "greater than 0"]),
        ("lr: .inf\n", ["lr: Input should be a finite number"]),
        ("training:\n  seed: -1\n", ["training.seed", "greater than or equal to 0"]),
        ("training:\n  seed: 4294967296\n", ["training.seed", "less than or equal to 4294967295"]),
        ("split:\n  seed: -5\n", ["split.seed"]),
        ("sampling:\n  seeds: [0, 99999999999999999999]\n", ["sampling.seeds.1"]),
        ("data:\n  resolution: 64\ndata:\n  resolution: 32\n", ["'data'", "lines 1 and 3", "remove one"]),
        ("sampling:\n  prompts: [" + ", ".join(["a cat"] * 1500) + "]\n", ["sampling.prompts", "1500 entries"]),
        ("tracking:\n  tracking_uri: http://rf-user:hunter2-pw@127.0.0.1:5000\n",
         ["tracking.tracking_uri", "a user name and password", "MLFLOW_TRACKING_PASSWORD", "Secret"]),
        ("kubernetes:\n  mlflow_tracking_uri: http://rf-user:hunter2-pw@mlflow:5000\n",
         ["kubernetes.mlflow_tracking_uri", "MLFLOW_TRACKING_USERNAME"]),
        ("model:\n  base_model: https://rf-user:hunter2-pw@models.example/sd15.safetensors\n",
         ["model.base_model", "a user name and password"]),
        # Issue 36, class 4: YAML 1.1 booleans where a number belongs, and names the API server would refuse.
        ("training:\n  grad_accum: on\n", ["training.grad_accum", "YAML boolean"]),
        ("sampling:\n  seeds: [0, no]\n", ["sampling.seeds", "YAML boolean"]),
        ("kubernetes:\n  mlflow_secret: MLflow_Creds\n", ["kubernetes.mlflow_secret", "RFC 1123 subdomain"]),
        ("kubernetes:\n  service_account: runner account\n", ["kubernetes.service_account", "RFC 1123"]),
        ("distributed:\n  namespace: ml.team\n", ["distributed.namespace", "RFC 1123 label"]),
        ("kubernetes:\n  node_selector:\n    pool: gpu pool\n", ["kubernetes.node_selector", "label value"]),
        # Pod values KFP's driver or the API server would refuse on the cluster: kfp raised a traceback for the
        # limits, and compiled the rest into a package whose steps never start.
        ("kubernetes:\n  memory_limit: 48GB\n", ["kubernetes.memory_limit: '48GB' is not a memory size", "48Gi"]),
        ("kubernetes:\n  memory_limit: 48K\n", ["kubernetes.memory_limit: '48K'", "Ki"]),
        ("kubernetes:\n  cpu_limit: 8 cores\n", ["kubernetes.cpu_limit: '8 cores' is not a CPU count", "500m"]),
        ("kubernetes:\n  shm_size: 8GB\n", ["kubernetes.shm_size: '8GB' is not a Kubernetes quantity", "8Gi"]),
        ("kubernetes:\n  accelerator_type: gpu\n", ["kubernetes.accelerator_type: 'gpu'", "nvidia.com/gpu"]),
        ("kubernetes:\n  data_mount_path: data\n", ["kubernetes.data_mount_path: 'data'", "absolute path", "/data"]),
        ("kubernetes:\n  tolerations:\n    - {key: spot, operator: Exists, value: 'true'}\n",
         ["kubernetes.tolerations.0: operator Exists tolerates spot whatever its value", "remove the value"]),
        ("kubernetes:\n  tolerations:\n    - {key: pool, value: gpu pool}\n",
         ["kubernetes.tolerations.0.value: 'gpu pool' is not a valid Kubernetes label value"]),
        ("kubernetes:\n  image: registry.example.com/Team/Trainer:1\n",
         ["kubernetes.image='registry.example.com/Team/Trainer:1' is not an image reference", "lower case"]),
        # YAML that does not parse: one line (PyYAML's own text spans four and calls the file "<byte string>").
        ("training: [\n", ["not valid YAML: line 2, column 1", "expected the node content", "check the brackets"]),
        ("training:\n\tepochs: 3\n", ["not valid YAML: line 2, column 1", "indent with spaces, not tabs"]),
        ("training:\n  lr: 1\x01\n", ["not valid YAML: offset 17", "save it as UTF-8 text"]),
        # Every pipeline renders sides in multiples of 8 px: refused when the config is read, whatever the base model
        # (a hub id not fetched yet too), not by resolve-config on the cluster.
        ("sampling:\n  resolution: 100\n", ["sampling.resolution: the pipeline renders sides in multiples of 8 px, "
                                            "not 100; set it to a multiple of 8"]),
        ("model:\n  base_model: org/not-fetched\nsampling:\n  resolution: 100\n", ["sampling.resolution", "not 100"]),
        # kohya sd-scripts' TOML, brought along: told to hold a mapping of sections, or to check its brackets.
        pytest.param('pretrained_model_name_or_path = "org/sd"\nlearning_rate = 1e-4\nnetwork_dim = 16\n',
                     ["is TOML (as kohya sd-scripts' configs are), and rangefinder reads YAML", "configs/example.yaml",
                      "of this file's keys, pretrained_model_name_or_path -> model.base_model, learning_rate -> "
                      "training.lr, network_dim -> training.lora.rank"], marks=NEEDS_TOMLLIB),
        pytest.param("[general]\nshuffle_caption = true\n\n[[datasets]]\nresolution = 512\n",
                     ["is TOML (as kohya sd-scripts' configs are), and rangefinder reads YAML"], marks=NEEDS_TOMLLIB),
    ],
    ids=["lr-inf", "lr-nan", "lr-negative", "fixed-lr-inf", "seed-negative", "seed-2**32", "split-seed",
         "sampling-seed-huge", "duplicate-key", "long-list", "uri-credentials", "k8s-uri-credentials",
         "credentials-in-any-url", "yaml-on-as-number", "yaml-no-in-a-list", "secret-name", "service-account-name",
         "namespace-with-dot", "label-value-with-space", "memory-limit-gb", "memory-limit-kfp-only",
         "cpu-limit-words", "shm-size-gb", "accelerator-type-bare", "data-mount-path-relative",
         "toleration-exists-with-value", "toleration-value-with-space", "image-in-upper-case", "yaml-unclosed",
         "yaml-tab", "yaml-control-character",
         "sampling-resolution-off-8-px", "sampling-resolution-off-8-px-hub-model", "kohya-config-toml",
         "kohya-dataset-toml"],
)
def test_compile_refuses_a_bad_config_and_writes_nothing(yaml_text, words, tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml_text)
    out = tmp_path / "pipeline.yaml"
    run = rangefinder if yaml_text == "training:\n  lr: .inf\n" else in_process
    line = assert_one_line_error(run("compile", "--config", str(cfg), "--out", str(out)), *words)
    assert "hunter2" not in line and "rf-user" not in line and "<byte string>" not in line
    assert list(tmp_path.iterdir()) == [cfg]  # no package, not even a temporary one


@pytest.mark.parametrize("model, yaml_text, words", [
    ("tiny_sd3_dir", "training:\n  method: textual_inversion\n",
     ["training.method: textual inversion is not supported on Stable Diffusion 3/3.5 models"]),
    ("tiny_sdxl_dir", "data:\n  resolution: 8\n", ["data.resolution: 8 px is below what Stable Diffusion XL supports"]),
    ("tiny_flux_dir", "training:\n  noise_offset: 0.05\n",
     ["training.noise_offset", "Flux.1 is a flow-matching model"]),
    ("tiny_model_dir", "training:\n  method: textual_inversion\n  textual_inversion:\n    initializer_token: zebra\n",
     ["training.textual_inversion.initializer_token: 'zebra' is 5 tokens"]),
    ("tiny_schnell_dir", "sampling:\n  guidance_scale: 3.5\n",
     ["sampling.guidance_scale: base model", "no guidance embedding", "remove sampling.guidance_scale"]),
], ids=["sd3-textual-inversion", "sdxl-below-its-floor", "flux-ddpm-setting", "initializer-split-into-tokens",
        "schnell-sampling-guidance"])
def test_compile_and_run_local_refuse_what_a_local_base_model_s_family_cannot_take(request, model, yaml_text, words,
                                                                                   tmp_path):
    """resolve-config's preflight (training.families.check_family_settings) refused these only at the pipeline's
    first step, on the cluster. With the base model here to read, compile and run --local refuse them first, in the
    same words, and write nothing."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model:\n  base_model: {request.getfixturevalue(model)}\n{yaml_text}")
    assert_one_line_error(in_process("compile", "--config", str(cfg), "--out", str(tmp_path / "p.yaml")), *words)
    assert_one_line_error(in_process("run", "--local", "--config", str(cfg), "--out", str(tmp_path / "run")), *words)
    assert list(tmp_path.iterdir()) == [cfg]


def test_a_guidance_scale_of_0_on_schnell_is_taken_as_none_asked_for(tiny_schnell_dir, tmp_path):
    """diffusers' own FLUX.1-schnell example passes guidance_scale=0.0: a config copied from it compiles (a scale
    that would change something is refused: the case above)."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"model:\n  base_model: {tiny_schnell_dir}\nsampling:\n  guidance_scale: 0.0\n")
    done = in_process("compile", "--config", str(cfg), "--out", str(tmp_path / "p.yaml"))
    assert done.returncode == 0, done.stderr


def test_compile_refuses_to_write_its_package_over_its_config(tmp_path):
    """`compile --config my.yaml --out my.yaml` replaced the user's config with the compiled pipeline, and said
    nothing; a link to the config is the same file."""
    cfg = tmp_path / "my.yaml"
    cfg.write_text("training:\n  method: lora\n")
    (tmp_path / "link.yaml").symlink_to(cfg)
    for out in (cfg, tmp_path / "link.yaml"):
        assert_one_line_error(in_process("compile", "--config", str(cfg), "--out", str(out)),
                              "is the --config file itself", "my-pipeline.yaml" if out == cfg else "link-pipeline")
    assert cfg.read_text() == "training:\n  method: lora\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.yaml", "my.yaml"]


@pytest.mark.parametrize("command", ["analyze-lr", "select-steps"])
def test_a_plot_named_as_the_curve_is_refused_and_the_curve_kept(command, tmp_path):
    """`analyze-lr metrics.csv --plot metrics.csv` wrote the PNG over the curve it had read."""
    curve = tmp_path / "metrics.csv"
    rows = [(u, u, 10 ** (u - 7), loss) for u, loss in enumerate((0.50, 0.49, 0.45, 0.38, 0.36, 0.37, 0.60))]
    text = "update,epoch,lr,val_loss\n" + "".join(f"{u},{e},{lr!r},{loss}\n" for u, e, lr, loss in rows)
    curve.write_text(text)
    assert_one_line_error(in_process(command, str(curve), "--plot", str(curve)),
                          "--plot", "is the CURVE.csv file itself", str(tmp_path / "metrics.png"))
    assert curve.read_text() == text


def test_compile_refuses_a_config_file_over_1_mib(tmp_path):
    cfg = tmp_path / "big.yaml"
    with open(cfg, "w") as f:  # 50 MB, as in the issue: refused after reading at most 1 MiB of it
        f.write("sampling:\n  prompts:\n")
        line = "    - " + "a red circle on a blue background " * 30 + "\n"
        f.write(line * (50_000_000 // len(line)))
    out = tmp_path / "pipeline.yaml"
    assert_one_line_error(in_process("compile", "--config", str(cfg), "--out", str(out)),
                          str(cfg), "larger than 1024 KiB")
    assert not out.exists()


def test_the_largest_seeds_compile(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("training:\n  seed: 4294967295\nsplit:\n  seed: 0\nsampling:\n  seeds: [4294967295]\n")
    out = tmp_path / "pipeline.yaml"
    # What a compile killed mid-write (kill -9) left, which stayed beside the package for ever, goes; one a compile
    # running now fills (its process alive: the one that started this test) and a user's own dot-file stay.
    dead = subprocess.Popen(["true"])
    dead.wait()
    # Killed as kfp wrote its output, or as the header was written again into it: a temporary of a temporary.
    left = [tmp_path / f".pipeline.yaml.{dead.pid}.0123abcd.tmp.yaml",
            tmp_path / f"..pipeline.yaml.{dead.pid}.0123abcd.tmp.yaml.{dead.pid}.4567cdef.tmp",
            tmp_path / f".pipeline.yaml.{os.getppid()}.89abcdef.tmp.yaml", tmp_path / ".pipeline.yaml.notes",
            tmp_path / f".other.yaml.{dead.pid}.0123abcd.tmp.yaml"]
    for p in left:
        p.write_text("kind: half\n")
    proc = in_process("compile", "--config", str(cfg), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert out.stat().st_size > 1000
    assert [p.exists() for p in left] == [False, False, True, True, True]


def test_run_local_refuses_credentials_in_mlflow_tracking_uri_before_running(tmp_path):
    """From the environment too: refused before a step runs, so no table, log, executor output or store has it."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data:\n  resolution: 32\n")
    out = tmp_path / "out"
    uri = f"http://rf-user:hunter2-pw@127.0.0.1:{free_port()}"
    proc = rangefinder("run", "--local", "--config", str(cfg), "--out", str(out), env={"MLFLOW_TRACKING_URI": uri})
    line = assert_one_line_error(proc, "MLFLOW_TRACKING_URI", "a user name and password", "MLFLOW_TRACKING_PASSWORD")
    assert "hunter2" not in proc.stdout + proc.stderr and "rf-user" not in line
    written = [p for p in out.rglob("*") if p.is_file()] if out.exists() else []
    assert not written, written


def test_train_reads_its_config_with_the_same_checks(tmp_path, split_dir):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("training:\n  epochs: 1\n  epochs: 2\n")
    assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", str(tmp_path / "run"),
                                     "--config", str(cfg)), "'epochs'", "lines 2 and 3")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("section", ["training: 3\n", "training:\n", "training: [1, 2]\n"])
def test_train_refuses_a_section_that_is_not_a_mapping_as_compile_does(section, tmp_path, split_dir):
    # The flags' training section used to take the place of the file's, so `train --steps 1` ran without a word.
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(section)
    out = str(tmp_path / "run")
    assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", out, "--config", str(cfg), "--steps",
                                     "1", "--lr", "1e-4"), "training: Input should be a section of settings")
    assert not (tmp_path / "run").exists()
    assert_one_line_error(in_process("compile", "--config", str(cfg), "--out", str(tmp_path / "p.yaml")),
                          "training: Input should be a valid dictionary")


@pytest.mark.parametrize("cut", [0, 5, -100], ids=["empty", "no-header", "cut-short"])
def test_train_on_a_damaged_safetensors_base_model_is_one_line(cut, tmp_path, split_dir):
    # The settings' family check read the file's tensor names first, and a cut file's SafetensorError (neither an
    # OSError nor a ValueError) came out as a traceback before loading.py's own check could name the file.
    import torch
    from safetensors.torch import save_file

    whole = tmp_path / "whole.safetensors"
    save_file({"model.diffusion_model.input_blocks.0.0.weight": torch.zeros(64, 64)}, str(whole))
    data = whole.read_bytes()
    path = tmp_path / "model.safetensors"
    path.write_bytes(data[:cut])
    assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", str(tmp_path / "run"), "--model",
                                     str(path), "--steps", "1", "--batch-size", "16"),
                          f"model.base_model: {path} is not a readable safetensors file", "download it again")


@pytest.mark.parametrize("family, form", [("sd3", "folder"), ("flux", "folder"), ("sd3", "single file"),
                                          ("flux", "single file"), ("sd3", "hub id"), ("flux", "hub id")])
def test_train_refuses_textual_inversion_on_sd3_and_flux_before_loading_any_weights(family, form, request, tmp_path,
                                                                                     split_dir, monkeypatch):
    """It was refused once the weights had loaded (minutes for a real model), naming the family by its code (`sd3`).
    The folder here holds the model's configs and no weights, the single file only the tensor names that tell its
    family: a refusal made after loading or converting would name what is missing instead. A hub id's family is
    read off its model_index.json alone: it was refused only after the whole download; here the offline Hugging Face
    cache holds the configs-only folder as the repo, and a refusal made after fetching or loading weights would name
    the weights missing."""
    import shutil

    import torch
    from safetensors.torch import save_file

    from rangefinder.formats.flux_layout import FLUX_CHECKPOINT_PREFIX, FLUX_DOUBLE_BLOCK_KEY, FLUX_SINGLE_BLOCK_KEY
    from rangefinder.training.family_detection import SD3_SINGLE_FILE_KEY_PREFIX
    from tests.models.fake_hub import make_cached_repo

    if form != "single file":
        source = request.getfixturevalue(f"tiny_{family}_dir")
        model = tmp_path / "configs-only"
        for f in source.rglob("*"):
            if f.is_file() and f.suffix != ".safetensors":
                (model / f.relative_to(source)).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(f, model / f.relative_to(source))
        # Flux's own refusal says why (family_flux.refuse_unsupported); SD3's names the families that take it.
        words = {"sd3": "not supported on Stable Diffusion 3/3.5 models", "flux": "not supported on Flux (its prompt"}
        if form == "hub id":
            make_cached_repo(tmp_path / "hub", f"rangefinder-tests/{family}-configs", model)
            monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
            monkeypatch.setenv("HF_HUB_OFFLINE", "1")
            model = f"rangefinder-tests/{family}-configs"
            # The method's rule, told from the family's name (as for a single file): the configs are read once
            # the model is resolved.
            words["flux"] = "not supported on Flux.1 models"
    else:
        model = tmp_path / "model.safetensors"
        keys = ([SD3_SINGLE_FILE_KEY_PREFIX + "0.x.weight"] if family == "sd3"
                else [FLUX_CHECKPOINT_PREFIX + FLUX_DOUBLE_BLOCK_KEY, FLUX_CHECKPOINT_PREFIX + FLUX_SINGLE_BLOCK_KEY])
        save_file({k: torch.zeros(1) for k in keys}, str(model))
        words = {"sd3": "not supported on Stable Diffusion 3/3.5 models", "flux": "not supported on Flux.1 models"}
    line = assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", str(tmp_path / "run"),
                                            "--model", str(model), "--method", "textual_inversion", "--steps", "1"),
                                 "training.method: textual inversion", words[family], "use method lora")
    assert f" {family} " not in line
    assert not (tmp_path / "run").exists()


def test_train_refuses_an_initializer_word_the_tokenizer_splits_before_loading_any_weights(tiny_model_dir, tmp_path,
                                                                                             split_dir):
    """Textual inversion's initializer word must be one token (each new row starts as its row): one the tokenizer
    splits was refused only once a training step had loaded the weights (the pipeline's range test, after the
    dataset was prepared). The folder holds the model's configs and tokenizer, no weights: a refusal made after
    loading them would name the weights missing instead."""
    import shutil

    model = tmp_path / "configs-only"
    shutil.copytree(tiny_model_dir, model, ignore=shutil.ignore_patterns("*.safetensors"))
    cfg = tmp_path / "ti.yaml"
    cfg.write_text("training:\n  textual_inversion:\n    initializer_token: zebra\n")
    assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", str(tmp_path / "run"), "--model",
                                     str(model), "--config", str(cfg), "--method", "textual_inversion", "--steps", "1"),
                          "training.textual_inversion.initializer_token: 'zebra' is 5 tokens for the base model's "
                          "tokenizer; pick a word that is a single token")
    assert not (tmp_path / "run").exists()


def test_a_config_path_that_is_a_folder_is_named_a_folder(tmp_path):
    assert_one_line_error(in_process("compile", "--config", str(tmp_path), "--out", str(tmp_path / "p.yaml")),
                          f"config file {tmp_path} is a folder; pass the path of a YAML file")


def test_a_bad_seed_flag_is_one_line(tmp_path, split_dir):
    assert_one_line_error(in_process("train", "--data", str(split_dir), "--out", str(tmp_path / "run"),
                                     "--epochs", "1", "--seed", "-3"), "training.seed")
    assert not Path(tmp_path / "run").exists()


def test_train_given_the_dataset_folder_instead_of_its_split_names_the_split_command(tmp_path, shapes_dataset_dir):
    """`train --data` on the images themselves (kohya's `10_name/` layout, a space in the path) was told to make a
    split `--out` that same folder, unquoted: followed, it wrote the split's files into the dataset."""
    data = tmp_path / "my data" / "10_sks dog"
    data.mkdir(parents=True)
    for name in ("00000.png", "00000.txt"):
        shutil.copy(shapes_dataset_dir / name, data / name)
    line = assert_one_line_error(in_process("train", "--data", str(data.parent), "--out", str(tmp_path / "run"),
                                            "--epochs", "1"), "is a dataset folder (it holds images), not a split")
    assert f"rangefinder split {shlex.quote(str(data.parent))} --out SPLIT_DIR" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["my data"]
    assert sorted(p.name for p in data.iterdir()) == ["00000.png", "00000.txt"]


def test_run_local_refuses_an_out_folder_inside_the_dataset(tmp_path, shapes_dataset_dir):
    """--out inside data.dataset_dir (or the folder itself, or the default ./rangefinder-run run from there): the
    next run read this one's sample grids and MLflow's copies of them as images, and textual inversion, which keeps
    images without captions, trained on them."""
    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    before = sorted(p.name for p in data.iterdir())
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(f"data:\n  dataset_dir: {data}\n  resolution: 32\nlr: 1.0e-4\n")
    for out, where in ((data, "is the dataset folder"), (data / "runs" / "1", f"is inside the dataset folder {data}")):
        assert_one_line_error(in_process("run", "--local", "--config", str(cfg), "--out", str(out)),
                              f"--out {out} {where} (data.dataset_dir)", "pass an --out outside it")
    assert sorted(p.name for p in data.iterdir()) == before
    val = tmp_path / "val"  # a validation folder chosen by hand: its next scan read the outputs as validation images
    shutil.copytree(shapes_dataset_dir, val)
    cfg.write_text(f"data:\n  dataset_dir: {data}\n  resolution: 32\nsplit:\n  val_dir: {val}\nlr: 1.0e-4\n")
    assert_one_line_error(in_process("run", "--local", "--config", str(cfg), "--out", str(val / "run")),
                          f"--out {val / 'run'} is inside the dataset folder {val} (split.val_dir)")
    assert not (val / "run").exists()


def test_split_refuses_an_out_folder_inside_the_dataset_as_run_local_does(tmp_path, shapes_dataset_dir):
    """`split --out` the dataset folder (or a folder in it) wrote train.jsonl, val.jsonl, stabilize.jsonl and
    split.json among the images, and the next split listed each as a file of the dataset. Refused as `run --local`
    refuses an --out inside data.dataset_dir, by the same check, with nothing written."""
    data = tmp_path / "data"
    shutil.copytree(shapes_dataset_dir, data)
    before = sorted(p.name for p in data.iterdir())
    for out, where in ((data, "is the dataset folder"), (data / "s" / "1", f"is inside the dataset folder {data}")):
        assert_one_line_error(in_process("split", str(data), "--out", str(out), "--resolution", "32"),
                              f"--out {out} {where} (DATA_DIR)", "train.jsonl", "pass an --out outside it")
    assert sorted(p.name for p in data.iterdir()) == before
    # The validation folder chosen by hand too: its manifests were read back as validation images' neighbours.
    val = tmp_path / "val"
    shutil.copytree(shapes_dataset_dir, val)
    assert_one_line_error(in_process("split", str(data), "--val-dir", str(val), "--out", str(val / "split"),
                                     "--resolution", "32"),
                          f"--out {val / 'split'} is inside the dataset folder {val} (--val-dir)")
    assert not (val / "split").exists()


def test_run_local_refuses_an_out_folder_another_run_is_using(tmp_path, shapes_dataset_dir):
    """Two `run --local` into one --out both ran: they shared pipeline.log and reports/, and each printed the reports
    the other had replaced as its own."""
    out = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from rangefinder.training.outdir import OutDirLock; "
                               f"lock = OutDirLock({str(out)!r}); print('held', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        cfg = tmp_path / "cfg.yaml"
        cfg.write_text(f"data:\n  dataset_dir: {shapes_dataset_dir}\n  resolution: 32\nlr: 1.0e-4\n")
        assert_one_line_error(in_process("run", "--local", "--config", str(cfg), "--out", str(out)),
                              f"output folder {out} is in use by another", f"pid {holder.pid}", "choose another --out")
    finally:
        holder.kill()
        holder.wait()
    assert sorted(p.name for p in out.iterdir()) == [".rangefinder.lock"]  # the holder's: nothing of this run


def test_compile_names_each_pair_of_settings_that_cancel_each_other(tmp_path):
    # Issue 36, class 3: settings one of which switches the other off get one warning line each; the compile goes on.
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("split:\n  val_dir: /data/val\n  val_split: 0.3\nretrain:\n  epochs: 7\n"
                   "lr_range_test:\n  zoom: false\n  zoom_min_points: 9\n")
    proc = rangefinder("compile", "--config", str(cfg), "--out", str(tmp_path / "p.yaml"))
    assert proc.returncode == 0, proc.stderr
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("rangefinder: warning: ")]
    assert len(warnings) == 3, proc.stderr
    assert "split.val_split (0.3) is not used" in warnings[0]
    assert "retrain.epochs (7) is not used" in warnings[1]
    assert "zoom_min_points is not used" in warnings[2]


@pytest.mark.parametrize("args,flag", [
    (["split", "DATA", "--out", "  "], "--out is empty"),
    (["analyze-lr", ""], "CURVE is empty"),
    (["train", "--data", "", "--out", "x", "--epochs", "1"], "--data is empty"),
    # Options whose absence means a default: an unset CI secret (`--token "$KFP_TOKEN"`) sent the pod's token or
    # none, an empty --experiment ran in the config's experiment, an empty --tracking-uri promoted in ./mlflow.db.
    (["submit", "--host", "http://127.0.0.1:9", "--config", "c.yaml", "--token", "\n"], "--token is empty"),
    (["submit", "--host", "http://127.0.0.1:9", "--config", "c.yaml", "--experiment", ""], "--experiment is empty"),
    (["schedule", "--host", "", "--config", "c.yaml", "--cron", "@daily"], "--host is empty"),
    (["promote", "--tracking-uri", ""], "--tracking-uri is empty"),
], ids=["split-out-blank", "analyze-lr-curve-empty", "train-data-empty", "submit-token-blank",
        "submit-experiment-empty", "schedule-host-empty", "promote-tracking-uri-empty"])
def test_an_empty_path_argument_is_refused(args, flag, tmp_path):
    # Issue 36, class 4: an empty path (an unset shell variable) is the working folder to pathlib.
    args = [str(tmp_path) if a == "DATA" else a for a in args]
    run = rangefinder if args[0] == "split" else in_process
    assert_one_line_error(run(*args), flag)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [
    ["sample", "--model", "~rf-no-such-user/sd15", "--out", "OUT"],
    ["train", "--data", "DATA", "--model", "~rf-no-such-user/sd15", "--out", "OUT", "--epochs", "1"],
], ids=["sample-model", "train-model"])
def test_a_path_under_the_home_of_no_such_user_is_one_line(args, tmp_path):
    """`~sd15` (the slash after ~ forgotten) is the home folder of a user named sd15: pathlib's expanduser raised
    RuntimeError ("Could not determine home directory.") and the command ended in its traceback."""
    args = [str(tmp_path / a) if a in ("DATA", "OUT") else a for a in args]
    assert_one_line_error(in_process(*args), "--model ~rf-no-such-user/sd15 begins with ~rf-no-such-user",
                          "write ~/ for your own home folder")
    assert list(tmp_path.iterdir()) == []
    if args[0] == "train":  # the same in a config file's path settings (a pipeline step's too), named by the setting
        config = tmp_path / "my.yaml"
        config.write_text("model:\n  base_model: ~rf-no-such-user/sd15\n")
        assert_one_line_error(in_process("train", "--data", str(tmp_path / "DATA"), "--config", str(config), "--out",
                                         str(tmp_path / "OUT"), "--epochs", "1"),
                              "model.base_model: ~rf-no-such-user/sd15 begins with ~rf-no-such-user")


# --- issue 36, class 5: one line instead of a traceback, on inputs beside the examples


@pytest.mark.parametrize("args,words", [
    (["make-dataset", "--out", "OUT", "--resolution", "9000"], ["--resolution", "from 8 to 8192"]),
    (["sample", "--model", "M", "--out", "OUT", "--resolution", "36"],
     ["--resolution: 36 is not a multiple of 8 (the VAE downsamples by 8); try 32"]),
    (["sample", "--model", "M", "--out", "OUT", "--resolution", "4"],
     ["--resolution: 4 is out of range: a resolution in pixels must be from 8 to 8192;"]),
    # 0 is a resolution given, not "take the one the dataset was made at".
    (["split", "DATA", "--out", "OUT", "--resolution", "0"], ["data.resolution", "greater than or equal to 8 (got 0)"]),
    (["sample", "--model", "M", "--out", "OUT", "--seeds", "0", "-1"], ["--seeds", "from 0 to 4294967295"]),
    (["analyze-lr", "CURVE", "--seed", "-3"], ["--seed", "from 0 to 4294967295"]),
    (["select-steps", "CURVE", "--seed", "4294967296"], ["--seed", "from 0 to 4294967295"]),
], ids=["dataset-resolution-9000", "sample-resolution-36", "sample-resolution-4", "split-resolution-0",
        "sample-seed-negative", "analyze-seed-negative", "select-seed-2**32"])
def test_an_argument_out_of_its_bounds_is_one_line(args, words, tmp_path, shapes_dataset_dir):
    curve = tmp_path / "c.csv"  # a curve the analyses can read: the seed is what is wrong
    curve.write_text("update,epoch,lr,val_loss\n" + "".join(f"{i},{i / 10},{10 ** (i / 4 - 7)},{0.2 - 0.01 * i}\n"
                                                         for i in range(12)))
    args = [str(tmp_path / "out") if a == "OUT" else str(tmp_path / "m") if a == "M" else
            str(curve) if a == "CURVE" else str(shapes_dataset_dir) if a == "DATA" else a for a in args]
    run = rangefinder if args[0] == "make-dataset" else in_process
    assert_one_line_error(run(*args), *words)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv"]


def test_an_output_folder_under_a_file_and_an_output_file_that_is_a_folder(tmp_path, shapes_dataset_dir):
    (tmp_path / "taken").write_text("a file where a folder is asked for")
    assert_one_line_error(in_process("split", str(shapes_dataset_dir), "--out", str(tmp_path / "taken" / "split"),
                                     "--resolution", "32"), "a folder above it, is a file")
    curve = tmp_path / "c.csv"
    curve.write_text("update,lr,val_loss\n0,0,0.2\n1,1e-6,0.19\n2,1e-5,0.15\n3,1e-4,0.1\n4,1e-3,0.3\n")
    assert_one_line_error(rangefinder("analyze-lr", str(curve), "--plot", str(tmp_path)), "is a folder")
    (tmp_path / "binary.csv").write_bytes(bytes(range(128, 256)))
    assert_one_line_error(in_process("analyze-lr", str(tmp_path / "binary.csv")), "is not a CSV text file")


def test_a_runs_folder_given_for_its_curve_names_the_curve_in_it(tmp_path):
    """`analyze-lr OUT` (the run's folder, not its metrics.csv) was told the folder does not exist."""
    run = tmp_path / "run"
    run.mkdir()
    assert_one_line_error(in_process("select-steps", str(run)), f"curve file {run} is a folder; pass the metrics.csv")
    (run / "metrics.csv").write_text("update,lr,val_loss\n0,0,0.2\n1,1e-6,0.19\n2,1e-5,0.15\n3,1e-4,0.1\n")
    assert_one_line_error(in_process("analyze-lr", str(run)),
                          f"curve file {run} is a folder; pass the curve in it, {run / 'metrics.csv'}")
    assert sorted(p.name for p in run.iterdir()) == ["metrics.csv"]


def test_the_cache_folder_on_a_file_is_one_line(tmp_path, split_dir, tiny_model_dir):
    (tmp_path / "cache").write_text("not a folder")
    proc = rangefinder("train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out",
                       str(tmp_path / "out"), "--steps", "1", env={"RANGEFINDER_CACHE": str(tmp_path / "cache")})
    assert_one_line_error(proc, "$RANGEFINDER_CACHE", "it is a file")


def test_a_cut_or_foreign_column_in_sample_is_one_line(tmp_path, tiny_model_dir, tiny_sdxl_dir):
    weights = next((tiny_model_dir / "unet").glob("*.safetensors")).read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(weights[: len(weights) // 3])
    out = tmp_path / "grid"
    assert_one_line_error(rangefinder("sample", "--model", str(tiny_model_dir), "--checkpoints",
                                      str(tmp_path / "cut.safetensors"), "--out", str(out), "--steps", "1"),
                          "cut.safetensors", "damaged")
    assert_one_line_error(in_process("sample", "--model", str(tiny_sdxl_dir), "--checkpoints", str(tiny_model_dir),
                                      "--out", str(out), "--steps", "1"),
                          "is a Stable Diffusion 1.x/2.x model", "is Stable Diffusion XL")
    # A .ckpt renamed .safetensors was "damaged, cut short or not a weights file".
    import torch

    torch.save({"state_dict": {"w": torch.zeros(2)}}, tmp_path / "renamed.safetensors")
    assert_one_line_error(in_process("sample", "--model", str(tiny_model_dir), "--checkpoints",
                                     str(tmp_path / "renamed.safetensors"), "--out", str(out), "--steps", "1"),
                          "renamed.safetensors is a PyTorch zip file, not safetensors", "refused unread")
    assert not out.exists()


@pytest.mark.parametrize("family, method, name, base, words", [
    ("flux", "lora", "pytorch_lora_weights.safetensors", "tiny_sd3_dir",
     ["is a Flux.1 LoRA, but the base model", "is Stable Diffusion 3/3.5"]),
    ("sd1", "textual_inversion", "learned_embeds.safetensors", "tiny_sdxl_dir",
     ["is a Stable Diffusion 1.x/2.x embedding, but the base model", "is Stable Diffusion XL"]),
    ("sd3", "lora", "lora_kohya.safetensors", "tiny_sd3_dir",
     ["is a LoRA in kohya's SD3 names, which diffusers' SD3 loader", "pass the pytorch_lora_weights.safetensors"]),
], ids=["flux-lora-on-sd3", "sd1-embedding-on-sdxl", "sd3-kohya-lora"])
def test_sample_refuses_an_adapter_diffusers_would_apply_in_part_or_not_at_all(family, method, name, base, words,
                                                                                request, tmp_path):
    """diffusers loaded a Flux LoRA on SD3 in part (the blocks both name transformer_blocks) and an SD 1.x embedding
    into SDXL's first encoder, and skipped kohya's SD3 names without a word: each column was drawn, labelled as the
    adapter, from weights it did not hold."""
    folder = request.getfixturevalue({"sd1": "tiny_model_dir", "sdxl": "tiny_sdxl_dir", "sd3": "tiny_sd3_dir",
                                      "flux": "tiny_flux_dir"}[family])
    adapter = delivered_files(folder, method, tmp_path / "final") / name
    out = tmp_path / "grid"
    assert_one_line_error(in_process("sample", "--model", str(request.getfixturevalue(base)), "--checkpoints",
                                     str(adapter), "--out", str(out), "--steps", "1"), str(adapter), *words)
    assert not out.exists()


def test_a_training_checkpoint_of_another_family_in_sample_is_one_line(tmp_path, split_dir, tiny_model_dir,
                                                                       tiny_sdxl_dir):
    """A textual-inversion checkpoint of SD 1.x on an SDXL base model was loaded, and refused half-way with "does not
    hold 1 embedding vectors for text_encoder_2; resume with the same training.textual_inversion settings"."""
    from rangefinder.formats.checkpoints import latest_checkpoint

    run = tmp_path / "run"
    trained = in_process("train", "--data", str(split_dir), "--model", str(tiny_model_dir), "--out", str(run),
                         "--method", "textual_inversion", "--steps", "1", "--checkpoint-every-updates", "1",
                         "--validate-every-epochs", "0")
    assert trained.returncode == 0, trained.stderr
    checkpoint = latest_checkpoint(run / "checkpoints")
    out = tmp_path / "grid"
    assert_one_line_error(in_process("sample", "--model", str(tiny_sdxl_dir), "--checkpoints", str(checkpoint),
                                     "--out", str(out), "--steps", "1"),
                          f"({checkpoint}) is a Stable Diffusion 1.x/2.x checkpoint, but the base model",
                          "is Stable Diffusion XL")
    assert not out.exists()


def test_a_runs_folder_as_a_sample_column_names_the_models_in_it(tmp_path, tiny_model_dir):
    """`sample --checkpoints OUT` (a `train --out` folder) was told the folder holds no model_index.json, unet/, ..."""
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "checkpoints" / "checkpoint-000004").mkdir(parents=True)
    out = tmp_path / "grid"
    assert_one_line_error(in_process("sample", "--model", str(tiny_model_dir), "--checkpoints", str(run), "--out",
                                     str(out), "--steps", "1"),
                          f"{run} is a training run's folder, not a model; pass {run / 'final'} or a checkpoint under "
                          f"{run / 'checkpoints'}")
    assert not out.exists()


def test_a_model_folder_that_ships_code_is_refused_by_sample_export_and_register(tmp_path, tiny_model_dir,
                                                                                  monkeypatch):
    """Only training's base model was checked for code shipped in its folder (models/loading.py
    refuse_shipped_code): `sample --model` and `--checkpoints`, export_pipeline (a full fine-tune's folder registered as
    it is, or the base model an embedding goes onto) and `register` loaded or logged such a folder, where diffusers
    named unet/evil.py in a traceback-free but misleading "damaged checkpoint" line, and an older diffusers imported
    it. Each is one line now, before anything is loaded, written or logged, and the planted code never runs."""
    import json

    import torch
    from safetensors.torch import save_file

    from rangefinder.errors import ConfigError
    from rangefinder.sampling import export_pipeline

    planted, marker = tmp_path / "model", tmp_path / "code-ran"
    shutil.copytree(tiny_model_dir, planted)
    code = (f"open({str(marker)!r}, 'w')\n"
            "from diffusers import UNet2DConditionModel\nfrom transformers import CLIPTokenizer\n")
    for part in ("unet", "tokenizer"):
        (planted / part / "evil.py").write_text(code)
    index = json.loads((planted / "model_index.json").read_text())
    (planted / "model_index.json").write_text(json.dumps({**index, "unet": ["evil", "UNet2DConditionModel"]}))
    tokenizer_config = planted / "tokenizer" / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()),
                                            "auto_map": {"AutoTokenizer": ["evil.CLIPTokenizer", None]}}))
    shipped = ("loads parts with code shipped in the folder (unet/evil.py, tokenizer/tokenizer_config.json "
               "(auto_map)), and rangefinder never runs code from a model; pass a model saved by diffusers' own "
               "classes (its save_pretrained) without that code")
    out = tmp_path / "grid"
    line = assert_one_line_error(in_process("sample", "--model", str(planted), "--out", str(out), "--steps", "1"))
    assert line == f"rangefinder sample: error: --model: {planted} {shipped}"
    line = assert_one_line_error(in_process("sample", "--model", str(tiny_model_dir), "--checkpoints", str(planted),
                                            "--out", str(out), "--steps", "1"))
    assert line == f"rangefinder sample: error: column model ({planted}) {shipped}"
    assert not out.exists()

    config = tmp_path / "config.yaml"
    config.write_text("{}\n")
    monkeypatch.chdir(tmp_path)  # a register that went on would make its local ./mlflow.db here
    line = assert_one_line_error(in_process("register", str(planted), "--config", str(config), "--lr", "1e-4",
                                            "--epochs", "1"))
    assert line == f"rangefinder register: error: the delivered model {planted} {shipped}"

    with pytest.raises(ConfigError) as e:
        export_pipeline(planted, tiny_model_dir, tmp_path / "export")
    assert str(e.value) == f"model {planted} {shipped}"
    embedding = tmp_path / "embedding.safetensors"  # diffusers' learned_embeds: {token: (vectors, dim)}
    save_file({"<shape>": torch.zeros(1, 32)}, str(embedding))
    with pytest.raises(ConfigError) as e:
        export_pipeline(embedding, planted, tmp_path / "export")
    assert str(e.value) == f"base model {planted} {shipped}"
    assert not (tmp_path / "export").exists() and not marker.exists()


@pytest.mark.parametrize("index,reason", [("{", "Expecting property name"), ("[1]", "a JSON list, not an object")],
                         ids=["not-json", "a-list"])
def test_a_model_folder_whose_model_index_is_not_json_is_one_line_from_sample(index, reason, tmp_path):
    """refuse_shipped_code, which `sample --model FOLDER` runs before anything else, read model_index.json unguarded:
    a damaged one was a JSONDecodeError's traceback, where the load after it names the file in one line; a JSON list
    was an AttributeError's there and in detect_family."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text(index)
    line = assert_one_line_error(in_process("sample", "--model", str(model), "--out", str(tmp_path / "grid"),
                                            "--steps", "1"))
    assert line.startswith(f"rangefinder sample: error: model.base_model: cannot read {model / 'model_index.json'} "
                           f"({reason}"), line
    assert line.endswith("; pass a diffusers folder"), line
    assert not (tmp_path / "grid").exists()


@pytest.mark.parametrize("content", [b"a red circle\nun cercle bleu \xe9\n", None], ids=["latin-1", "a-folder"])
def test_a_prompts_file_that_is_not_utf8_text_or_is_a_folder_is_one_line(content, tmp_path, tiny_model_dir):
    prompts = tmp_path / "prompts.txt"
    if content is None:
        prompts.mkdir()
        words = [f"prompts file {prompts} is a folder"]
    else:
        prompts.write_bytes(content)
        words = [f"prompts file {prompts} line 2 is not UTF-8 text (byte 0xe9", "iconv -f cp1252 -t utf-8"]
    out = tmp_path / "grid"
    assert_one_line_error(in_process("sample", "--model", str(tiny_model_dir), "--prompts", str(prompts), "--out",
                                     str(out), "--steps", "1"), *words)
    assert not out.exists()


@pytest.mark.parametrize("header", [
    '{"kind": "spool", "version": 1, "tracking_uri": "http://127.0.0.1:1", "run_id": 42}',
    '{"kind": "spool", "version": 1, "run_id": "abc"}',
], ids=["run-id-a-number", "no-tracking-uri"])
def test_relog_of_a_spool_with_a_damaged_header_is_one_line(header, tmp_path):
    spool = tmp_path / "step.jsonl"
    spool.write_text(header + '\n{"kind": "tags", "run_id": "abc", "tags": {"a": "b"}}\n')
    run = rangefinder if "42" in header else in_process
    assert_one_line_error(run("relog", str(spool)), "damaged header line")
    assert spool.is_file()


def test_main_called_again_in_one_process_reads_no_mlflow_setting_an_earlier_command_set(tmp_path, monkeypatch,
                                                                                          capsys):
    """main() in a notebook or a test harness: a command left the HTTP limits it set for its MLflow calls
    (tracking.target.HTTP_LIMITS) in the process's environment, where every later call read them as the user's."""
    from rangefinder.cli.main import main

    spool = tmp_path / "step.jsonl"
    spool.write_text('{"kind": "spool", "version": 1, "run_id": "abc"}\n')
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "5")  # the user's own: it stays
    before = {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")}
    assert main(["relog", str(spool)]) == 2 and "damaged header line" in capsys.readouterr().err
    assert {k: v for k, v in os.environ.items() if k.startswith("MLFLOW_")} == before


# --- issue 36, class 8: first-run traps


def test_split_reads_the_resolution_a_made_dataset_has_and_names_the_fix_for_small_images(tmp_path):
    from PIL import Image

    from rangefinder.data.synthetic import make_synthetic_dataset

    make_synthetic_dataset(tmp_path / "made", kind="stripes", count=6, seed=3, resolution=48)
    proc = rangefinder("split", str(tmp_path / "made"), "--out", str(tmp_path / "split"), "--json")
    assert proc.returncode == 0, proc.stderr
    assert '"resolution": 48' in proc.stdout
    # A folder made by hand at 40 px, at the default 512 px: the error names both settings that fix it.
    (tmp_path / "own").mkdir()
    for i in range(4):
        Image.new("RGB", (40, 40), (60 * i, 90, 120)).save(tmp_path / "own" / f"{i}.png")
        (tmp_path / "own" / f"{i}.txt").write_text(f"a teal tile {i}")
    assert_one_line_error(in_process("split", str(tmp_path / "own"), "--out", str(tmp_path / "split2")),
                          "4 are too small", "--resolution", "--min-image-size")


def test_make_base_model_takes_a_family(tmp_path, tiny_sdxl_dir):
    import json

    proc = rangefinder("make-base-model", "--family", "sdxl", "--out", str(tmp_path / "m"), "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["family"] == "sdxl"
    assert json.loads((tmp_path / "m" / "model_index.json").read_text())["_class_name"] == "StableDiffusionXLPipeline"


# --- a write the file system refuses (a full disk, a read-only mount, a file-size limit), outside training


def limited_writes(max_file_bytes: int):
    """For subprocess.run's preexec_fn: no file the child writes may grow past `max_file_bytes`. As root, chmod does
    not stop a write; RLIMIT_FSIZE does, and a write past it fails with EFBIG, as a full disk fails with ENOSPC."""
    import resource
    import signal

    def limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing the child
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))

    return limit


@pytest.mark.parametrize("command", ["make-dataset", "make-base-model"])
def test_a_write_the_file_system_refuses_is_one_line_and_leaves_nothing_that_looks_finished(command, tmp_path,
                                                                                              tiny_model_dir):
    out = tmp_path / "out"
    args = (["make-dataset", "--out", str(out), "--count", "2", "--resolution", "256"] if command == "make-dataset"
            else ["make-base-model", "--out", str(out)])  # the cached tiny model (tiny_model_dir), copied to --out
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True, text=True,
                          timeout=120, env=env, preexec_fn=limited_writes(1000))
    line = assert_one_line_error(proc, f"cannot write {out}: file too large", "raise the limit")
    assert ".tmp" not in line  # the folder the user named, not the writer's temporary sibling
    assert list(tmp_path.iterdir()) == []


def read_only_mount(folder: Path) -> list[str]:
    """The argv prefix that runs a command in a mount namespace of its own, where `folder` is a read-only bind mount
    of itself: as root, chmod does not stop a write, and a read-only mount does (EROFS), as a volume mounted
    read-only does. Nothing outside the child sees the mount, and it ends with the child. Skips where this machine
    gives no mount namespace (not root, no unshare)."""
    prefix = ["unshare", "--mount", "--propagation", "private", "sh", "-c",
              'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" && exec "$@"', str(folder)]
    probe = subprocess.run([*prefix, "sh", "-c", 'touch "$0/.probe"', str(folder)], capture_output=True, text=True)
    if "Read-only file system" not in probe.stderr:
        pytest.skip(f"no read-only bind mount in a mount namespace here ({probe.stderr.strip() or 'the write passed'})")
    return prefix


def test_train_and_run_local_into_a_read_only_folder_are_one_line_without_resume(tmp_path, split_dir):
    """--out on a read-only mount: refused at the run's lock file, before anything trains, in one line naming the
    file system and the fix. It ended "then run again with --resume", which `train` then refused (no checkpoint to
    resume) and `run --local` does not take."""
    ro = tmp_path / "ro"
    ro.mkdir()
    prefix = read_only_mount(ro)
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("data:\n  resolution: 32\nlr: 1.0e-4\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    for args in (["train", "--data", str(split_dir), "--out", str(ro / "run"), "--steps", "1"],
                 ["run", "--local", "--config", str(cfg), "--out", str(ro / "run")]):
        proc = subprocess.run([*prefix, sys.executable, "-m", "rangefinder.cli.main", *args], capture_output=True,
                              text=True, timeout=120, env=env)
        line = assert_one_line_error(proc, f"cannot write the run's lock file under {ro / 'run'}: read-only file "
                                           f"system", f"mount {ro} writable or choose another --out, then run again")
        assert "--resume" not in line
    assert list(ro.iterdir()) == []


def test_a_plot_the_file_system_refuses_names_the_plot(tmp_path):
    # A write() that fails names no file: the line names the output the command was given (--plot), not the
    # working folder.
    curve = tmp_path / "c.csv"
    curve.write_text("update,lr,val_loss\n" + "".join(f"{i},{10 ** (i / 4 - 7)},{0.2 - 0.01 * i}\n" for i in range(12)))
    plot = tmp_path / "plot.png"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    proc = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "analyze-lr", str(curve), "--plot", str(plot)],
                          capture_output=True, text=True, timeout=120, env=env, preexec_fn=limited_writes(1000))
    assert_one_line_error(proc, f"cannot write {plot}: file too large")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.csv"]


def test_storage_problem_names_the_folder_and_the_free_space(tmp_path):
    import errno
    import shutil

    from rangefinder.cli.storage import storage_problem

    full = OSError(errno.ENOSPC, "No space left on device")  # as a write() says it: no file named
    assert storage_problem(full, str(tmp_path / "split")).startswith(f"cannot write {tmp_path / 'split'}: disk full (")
    assert "GiB free on" in storage_problem(full, str(tmp_path / "split"))
    ro = OSError(errno.EROFS, "Read-only file system", str(tmp_path / ".ds.123.tmpab12" / "00000.png"))
    assert storage_problem(ro) == (f"cannot write {tmp_path / 'ds'}: read-only file system; mount {tmp_path} "
                                   "writable or pass a path on another file system")
    assert storage_problem(OSError(errno.ENOENT, "No such file or directory", "x")) is None  # not a storage problem
    assert storage_problem(shutil.Error([("a", "b", "some other failure")])) is None


def test_a_reader_that_stops_reading_ends_the_command_quietly():
    """`rangefinder plan ... | head -1`: the reader closes the pipe before the table is written. The command did its
    work, so nothing reaches stderr (it once ended in a BrokenPipeError traceback) and the status is a shell's for
    SIGPIPE."""
    proc = subprocess.Popen([sys.executable, "-m", "rangefinder.cli.main", "plan", "--images", "1000", "--epochs", "3"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # before the child has written a byte: its first write finds no reader
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_a_file_or_folder_name_reaches_the_terminal_with_its_control_characters_escaped(tmp_path, capsys):
    """A dataset's file and folder names reach the terminal in split's table, its warnings and its errors: an ESC
    sequence in one cleared the screen or hid what followed, and a newline split a one-line message."""
    from PIL import Image

    esc = "\x1b[2J\x1b[8m"
    data = tmp_path / f"10_dog{esc}"
    data.mkdir()
    for i, name in enumerate(("a.png", "b.png", f"c{esc}\n.png")):
        Image.new("RGB", (16, 16), (40 * i, 0, 0)).save(data / name)
    for name in ("a", "b"):
        (data / f"{name}.txt").write_text("a dog")
    done = in_process("split", str(data), "--out", str(tmp_path / "s"), "--resolution", "16")
    assert done.returncode == 0, done.stderr
    for text in (done.stdout, done.stderr):
        assert "\x1b" not in text and "\\x1b[2J\\x1b[8m" in text
    assert done.stderr.count("\n") == 1  # the repeat folder's warning, one line
    assert "c\\x1b[2J\\x1b[8m\\n.png: missing caption" in done.stdout
    # The pipeline's prepare-dataset step warns of the same folder in its log, escaped as the command does.
    from rangefinder.config import RangefinderConfig
    from rangefinder.steps.prepare_dataset import run_prepare_dataset

    cfg = RangefinderConfig.model_validate({"data": {"dataset_dir": str(data), "resolution": 16}})
    run_prepare_dataset(cfg, out_dir=tmp_path / "p", report_path=tmp_path / "report.md")
    step_err = capsys.readouterr().err
    assert step_err.startswith("rangefinder: warning: ") and "\x1b" not in step_err and "\\x1b[2J" in step_err
    refused = in_process("split", str(tmp_path / f"gone{esc}\nx"), "--out", str(tmp_path / "t"))
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1
    assert "\x1b" not in refused.stderr and "gone\\x1b[2J\\x1b[8m\\nx" in refused.stderr


def test_sample_takes_the_single_file_config_a_bare_checkpoint_needs(tiny_model_dir, tmp_path, monkeypatch):
    """A single file that names no architecture (no metadata, as most downloads) needs a diffusers folder of its
    architecture, and the refusal said to set model.single_file_config: `sample` has no config file, so it had no way
    to. It takes --single-file-config, names it in that refusal, and refuses it beside a folder --model."""
    from huggingface_hub import constants

    from rangefinder.formats.single_file import export_full

    bare = export_full(tiny_model_dir, tmp_path / "bare.safetensors")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red circle\n")
    env = {"RANGEFINDER_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    # huggingface_hub reads HF_HUB_OFFLINE once, on its import, long before `env` here: without this, diffusers went
    # to the hub for the file's configs (and said so only by the failed name lookup, offline).
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    common = ("--prompts", str(prompts), "--seeds", "0", "--steps", "1")
    line = assert_one_line_error(in_process("sample", "--model", str(bare), "--out", str(tmp_path / "a"), *common,
                                            env=env), "--model: cannot convert the checkpoint", "HF_HUB_OFFLINE",
                                 "--single-file-config")
    assert "model.single_file_config" not in line
    done = in_process("sample", "--model", str(bare), "--single-file-config", str(tiny_model_dir), "--out",
                      str(tmp_path / "b"), *common, env=env)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "b" / "grid.png").is_file()
    assert_one_line_error(in_process("sample", "--model", str(tiny_model_dir), "--single-file-config",
                                     str(tiny_model_dir), "--out", str(tmp_path / "c"), *common),
                          "--single-file-config is for a --model that is a single .safetensors file")
