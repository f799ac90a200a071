"""A pipeline of "a user's own" that reuses rangefinder's published component files, not its Python package's DAG.

The user's first step is their own lightweight component (it writes their dataset folder); rangefinder's
prepare-dataset and LR range test come from `components/<step>/component.yaml` through
`kfp.components.load_component_from_file`, as anyone would take them from this repository.

How far kfp.local goes: all the way. A loaded component.yaml is a YAML component to the SDK, but what kfp.local's
SubprocessRunner checks is the container command, and ours is still the lightweight component's (`python3 -m
kfp.dsl.executor_main` with the function's source), so it runs it as a lightweight component, in a subprocess of
this Python (kfp.local puts its executable in place of `python3`). What does not carry over locally: the image
(`ghcr.io/rangefinder/...` is never pulled; the local environment must hold the `rangefinder` package, as ours does)
and the pod settings. A component built as a container (`dsl.ContainerSpec`, or the image's own entrypoint) would
stop at kfp.local's "only supports running Lightweight Python Components" and need the DockerRunner (a Docker engine,
which the test machines do not have).
"""

# No `from __future__ import annotations`: KFP reads the component's annotations as real types.
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kfp import compiler, components, dsl, local
from kfp.dsl import Dataset, Output

from rangefinder.steps.resolve_config import load_step_config
from tests.mlflow_store import seed
from tests.pipelines.tiny_run import tiny_config

REPO = Path(__file__).resolve().parents[2]


@dsl.component(base_image="python:3.11-slim", install_kfp_package=False)
def my_images(source: str, images: Output[Dataset]) -> int:
    """The user's own first step: their images and captions, as one dataset folder.

    Args:
        source: Where their images are.

    Returns:
        images: The dataset folder.
        Output: How many images it holds.
    """
    import os
    import shutil

    shutil.copytree(source, images.path)
    return len([p for p in os.listdir(images.path) if p.endswith(".png")])


def _user_pipeline():
    prepare = components.load_component_from_file(str(REPO / "components/prepare_dataset/component.yaml"))
    range_test = components.load_component_from_file(str(REPO / "components/lr_range_test/component.yaml"))

    @dsl.pipeline(name="my-lr-search")
    def my_lr_search(source: str, config_json: str) -> float:
        mine = my_images(source=source)
        split = prepare(config_json=config_json, dataset=mine.outputs["images"])
        found = range_test(config_json=config_json, split=split.outputs["split"])  # stage: "first", the default
        return found.outputs["lr_mid"]

    return my_lr_search


def test_a_users_pipeline_with_the_published_range_test_compiles(tmp_path):
    package = tmp_path / "mine.yaml"
    compiler.Compiler().compile(_user_pipeline(), package_path=str(package))
    text = package.read_text()
    assert "comp-lr-range-test" in text and "comp-prepare-dataset" in text and "comp-my-images" in text
    # The published container (image, command, args) reaches the user's package as the file has it. (This said the
    # file's descriptions travelled too; what it found was the docstring in the command's source: KFP 2.17 drops the
    # descriptions when it loads a component, components/README.md.)
    published = yaml.safe_load((REPO / "components/lr_range_test/component.yaml").read_text())
    mine = yaml.safe_load(text)
    assert (mine["deploymentSpec"]["executors"]["exec-lr-range-test"]
            == published["deploymentSpec"]["executors"]["exec-lr-range-test"])
    # stage was required: a user's one range test had to say stage="first"; it is the default now.
    stage = yaml.safe_load(text)["components"]["comp-lr-range-test"]["inputDefinitions"]["parameters"]["stage"]
    assert stage["defaultValue"] == "first" and stage["isOptional"]


@pytest.mark.slow
def test_a_users_pipeline_with_the_published_range_test_runs_under_kfp_local(
    shapes_dataset_dir, tiny_model_dir, tmp_path, monkeypatch
):
    cfg = tiny_config(shapes_dataset_dir, tiny_model_dir)
    seed(tmp_path / "mlflow.db")  # migrated: the range test's step skips MLflow's migrations
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'mlflow.db'}")
    monkeypatch.setenv("RANGEFINDER_MLFLOW_SPOOL", str(tmp_path / "spool"))
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    # One torch thread, as `rangefinder run --local` gives its steps (pipelines.local_run): with torch's default of a
    # thread per core, the range test's threads spun against the other xdist worker (measured on the loaded 2-core
    # machine: 77 -> 34 CPU-s, 172 -> 121 s for this test; the same steps, the same assertions).
    monkeypatch.setenv("RANGEFINDER_TORCH_THREADS", "1")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    # the image is not pulled locally (see the module's docstring); kfp.local says so, and that is expected here
    with pytest.warns(RuntimeWarning, match="custom or non-Python base image"):
        lr_mid = _user_pipeline()(source=str(shapes_dataset_dir), config_json=cfg.model_dump_json()).output
    lo, hi = cfg.lr_range_test.range_for(cfg.training.method)
    assert lo < lr_mid < hi
    curves = list((tmp_path / "root").rglob("metrics.csv"))
    assert curves, "the range test wrote no curve"
    # The range the run swept, beside the setting it came from: it was logged as `range_test.lr_min` next to the
    # config's `lr_range_test.lr_min`, two params of one name in MLflow's compare view.
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name(cfg.tracking.experiment_name).experiment_id],
                                filter_string="tags.`rangefinder.step` = 'lr_range_test'")
    params = run.data.params
    assert (float(params["lr_range_test.lr_min_used"]), float(params["lr_range_test.lr_max_used"])) == (lo, hi)
    assert params["lr_range_test.lr_min"] == str(cfg.lr_range_test.lr_min)  # the setting, as before
    assert not [k for k in params if k.startswith("range_test.lr")]


def _load(step: str):
    return components.load_component_from_file(str(REPO / "components" / step / "component.yaml"))


def _users_config_pipeline():
    """A user's pipeline that sets only what differs from rangefinder's defaults: resolve-config's other inputs keep
    the default config's values, as the published pipeline's parameters do."""
    resolve, prepare = _load("resolve_config"), _load("prepare_dataset")

    @dsl.pipeline(name="my-config")
    def my_config(dataset_dir: str) -> str:
        resolved = resolve(dataset_dir=dataset_dir, method="lora", resolution=32)
        prepare(config_json=resolved.outputs["config_json"])
        return resolved.outputs["config_json"]

    return my_config


def test_a_users_pipeline_sets_only_the_resolve_config_inputs_it_changes(tmp_path):
    # Every input of resolve-config was required: a user's pipeline had to pass all 23 (base_config's whole JSON
    # among them) to compile.
    package = tmp_path / "mine.yaml"
    compiler.Compiler().compile(_users_config_pipeline(), package_path=str(package))
    spec = yaml.safe_load(package.read_text())
    task = spec["root"]["dag"]["tasks"]["resolve-config"]["inputs"]["parameters"]
    assert set(task) == {"dataset_dir", "method", "resolution"}
    inputs = spec["components"]["comp-resolve-config"]["inputDefinitions"]["parameters"]
    assert all(p.get("isOptional") for p in inputs.values())
    assert inputs["finetune_epochs"]["defaultValue"] == 30 and inputs["method"]["defaultValue"] == "full"


@pytest.mark.slow
def test_resolve_config_with_its_defaults_runs_under_kfp_local(shapes_dataset_dir, tmp_path, monkeypatch):
    """kfp.local hands a component the IR's defaults for the inputs a pipeline leaves out."""
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               raise_on_error=True)
    with pytest.warns(RuntimeWarning, match="custom or non-Python base image"):
        config_json = _users_config_pipeline()(dataset_dir=str(shapes_dataset_dir)).output
    cfg = load_step_config(config_json)
    assert (cfg.training.method, cfg.data.resolution, cfg.data.dataset_dir) == ("lora", 32, str(shapes_dataset_dir))
    assert (cfg.finetune.epochs, cfg.lr_range_test.epochs, cfg.split.seed) == (30, 10, 555)  # the config's defaults
    assert list((tmp_path / "root").rglob("split")), "prepare-dataset did not run on the resolved config"


def test_resolve_config_in_a_pod_takes_the_packages_defaults_for_inputs_left_out(tmp_path):
    """On a cluster KFP's driver does not pass an optional input a pipeline left out; the component's own Python
    default applies in the pod (kubeflow/pipelines backend/src/v2/driver/resolve.go: "They are resolved internally
    within the component"). Here the published container command runs as the pod runs it, with an executor input
    that holds only `method`: the defaults come from the package (this Python stands in for the image's)."""
    spec = yaml.safe_load((REPO / "components" / "resolve_config" / "component.yaml").read_text())
    container = spec["deploymentSpec"]["executors"]["exec-resolve-config"]["container"]
    definitions = spec["components"]["comp-resolve-config"]["outputDefinitions"]
    outputs = definitions["parameters"]
    executor_output = tmp_path / "executor_output.json"
    # The driver hands every output artifact its URI, always (the report): only inputs can be left out.
    artifacts = {name: {"artifacts": [{"name": name, "type": d["artifactType"], "uri": str(tmp_path / name)}]}
                 for name, d in definitions["artifacts"].items()}
    executor_input = {
        "inputs": {"parameterValues": {"method": "lora"}},
        "outputs": {"parameters": {name: {"outputFile": str(tmp_path / name)} for name in outputs},
                    "artifacts": artifacts, "outputFile": str(executor_output)},
    }
    args = [json.dumps(executor_input) if a == "{{$}}" else a for a in container["args"]]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    env.pop("MLFLOW_RUN_ID", None)
    done = subprocess.run([*container["command"], *args], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    values = json.loads(executor_output.read_text())["parameterValues"]
    cfg = load_step_config(values["config_json"])
    assert cfg.training.method == "lora"
    assert (cfg.data.resolution, cfg.finetune.epochs, cfg.tracking.experiment_name) == (512, 30, "rangefinder")
    assert values["mlflow_parent_run_id"] == ""  # no pipeline_job_id: no parent run
    assert "- method: lora" in (tmp_path / "report").read_text()  # what the run resolved to, for the KFP UI


def _users_retrain_pipeline(epochs_output: str):
    """A user's own split, retrained on by the published retrain-full, whose epochs register-model records."""
    prepare, retrain, register = _load("prepare_dataset"), _load("retrain_full"), _load("register_model")

    @dsl.pipeline(name="my-retrain")
    def my_retrain(source: str, config_json: str, lr: float) -> int:
        mine = my_images(source=source)
        split = prepare(config_json=config_json, dataset=mine.outputs["images"])
        full = retrain(config_json=config_json, split=split.outputs["split"], lr_low=lr, lr_high=lr, lr=lr,
                       recommended_epochs=1)
        register(config_json=config_json, model=full.outputs["model"], lr=lr, epochs=full.outputs[epochs_output])
        return full.outputs[epochs_output]

    return my_retrain


def test_retrain_full_names_its_epochs_and_keeps_the_old_name(tmp_path):
    # Its one output was KFP's default name for a return value, `Output`, beside every other component's named
    # ones; `epochs` now, with `Output` kept for the pipelines written against it.
    for name in ("epochs", "Output"):
        package = tmp_path / f"{name}.yaml"
        compiler.Compiler().compile(_users_retrain_pipeline(name), package_path=str(package))
        spec = yaml.safe_load(package.read_text())
        register = spec["root"]["dag"]["tasks"]["register-model"]["inputs"]["parameters"]["epochs"]
        assert register["taskOutputParameter"] == {"outputParameterKey": name, "producerTask": "retrain-full"}
