"""The compiled pipeline, read back from its IR YAML as KFP's own PipelineSpec / KubernetesExecutorConfig protos."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from google.protobuf import json_format
from kfp import dsl
from kfp.kubernetes import kubernetes_executor_config_pb2 as k8s_pb
from kfp.pipeline_spec import pipeline_spec_pb2 as pb

from rangefinder.config import RangefinderConfig, parse_config
from rangefinder.pipelines import kfp_components
from rangefinder.pipelines.pipeline import PIPELINE_NAME, compile_pipeline

TRAINING = ("lr-range-test", "prodigy-step-size", "finetune", "retrain-full", "sample-images")
RETRIED = ("lr-range-test", "prodigy-step-size", "finetune", "retrain-full", "sample-images")
CHEAP = ("resolve-config", "prepare-dataset", "choose-lr", "register-model", "record-status")


class Compiled:
    """A compiled package: the PipelineSpec, and each executor's Kubernetes settings."""

    def __init__(self, path: Path):
        # libyaml's parser (the same safe loader, in C): the pure-Python one took seconds per package.
        docs = list(yaml.load_all(path.read_text(), Loader=yaml.CSafeLoader))
        self.spec = json_format.ParseDict(docs[0], pb.PipelineSpec())
        platform = docs[1]["platforms"]["kubernetes"]["deploymentSpec"]["executors"] if len(docs) > 1 else {}
        self.k8s = {name: json_format.ParseDict(v, k8s_pb.KubernetesExecutorConfig()) for name, v in platform.items()}
        self.executors = {
            name: json_format.ParseDict(v, pb.PipelineDeploymentConfig.ExecutorSpec())
            for name, v in json_format.MessageToDict(self.spec.deployment_spec)["executors"].items()
        }

    def dags(self):
        """(component name, dag) for the root and every sub-DAG (conditions, sub-pipelines, exit handler)."""
        yield "root", self.spec.root.dag
        for name, comp in self.spec.components.items():
            if comp.WhichOneof("implementation") == "dag":
                yield name, comp.dag

    def tasks(self, prefix: str):
        """Every task (in any DAG) whose component is `comp-<prefix>` or `comp-<prefix>-N`."""
        out = []
        for dag_name, dag in self.dags():
            for task_name, task in dag.tasks.items():
                ref = task.component_ref.name
                numbered = ref.startswith(f"comp-{prefix}-") and ref[len(prefix) + 6:].replace("-", "").isdigit()
                if ref == f"comp-{prefix}" or numbered:
                    out.append((dag_name, task_name, task))
        assert out, f"no task of component {prefix}"
        return out

    def executor_of(self, task) -> str:
        return self.spec.components[task.component_ref.name].executor_label

    def condition_of(self, dag_name: str) -> str:
        """The trigger condition of the task that runs sub-DAG `dag_name`."""
        for _, dag in self.dags():
            for task in dag.tasks.values():
                if task.component_ref.name == dag_name:
                    return task.trigger_policy.condition
        raise AssertionError(f"no task runs {dag_name}")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> Compiled:
    path = tmp_path_factory.mktemp("compiled") / "pipeline.yaml"
    compile_pipeline(RangefinderConfig(), str(path))
    return Compiled(path)


def test_parameters_are_typed_with_descriptions(compiled):
    assert compiled.spec.pipeline_info.name == PIPELINE_NAME
    # The first thing the UI shows of the pipeline: lr_finder auto measures the LR with a Prodigy run on SDXL's full
    # fine-tune, SD3 and Flux, where it said an LR range test found it.
    described = compiled.spec.pipeline_info.description
    assert "LR range test" in described and "Prodigy" in described and "lr_finder" in described, described
    params = compiled.spec.root.input_definitions.parameters
    P = pb.ParameterType
    expected = {
        "dataset_uri": P.STRING, "dataset_dir": P.STRING, "base_model": P.STRING, "base_model_revision": P.STRING,
        "method": P.STRING, "lr_finder": P.STRING,
        "resolution": P.NUMBER_INTEGER, "batch_size": P.NUMBER_INTEGER, "grad_accum": P.NUMBER_INTEGER,
        "ramp": P.STRING, "lr_min": P.NUMBER_DOUBLE, "lr_max": P.NUMBER_DOUBLE, "range_test_epochs": P.NUMBER_INTEGER,
        "finetune_epochs": P.NUMBER_INTEGER, "val_split": P.NUMBER_DOUBLE, "split_seed": P.NUMBER_INTEGER,
        "seed": P.NUMBER_INTEGER, "fixed_lr": P.NUMBER_DOUBLE, "retrain": P.BOOLEAN,
        "retrain_epochs": P.NUMBER_INTEGER, "prompts": P.LIST, "mlflow_experiment": P.STRING,
        "mlflow_ui_url": P.STRING, "base_config": P.STRING,
    }
    assert {k: v.parameter_type for k, v in params.items()} == expected
    for name, p in params.items():
        assert len(p.description) > 10, f"{name} has no UI description"
        # The run form lists the parameters by name (base_config first), not in the signature's order.
        assert not {"above", "below"} & set(p.description.split()), f"{name}: {p.description}"
    # A fixed LR skips whichever finder lr_finder names, and the retrain's length applies with the retrain only.
    assert "range test" in params["fixed_lr"].description and "Prodigy" in params["fixed_lr"].description
    assert "with retrain on" in params["retrain_epochs"].description
    # Unset in the config: 0 in the UI, which the first step reads as the method's default sweep.
    assert params["lr_max"].default_value.number_value == 0.0
    assert params["fixed_lr"].default_value.number_value == 0.0
    # Where the run's MLflow links point, settable in the form: unset by default (the pods' tracking URI).
    assert params["mlflow_ui_url"].default_value.string_value == "" and "browser" in params["mlflow_ui_url"].description
    # Under KFP's MLflow integration the steps log into the experiment it names, whatever the form says: the form said
    # only "the runs are logged under" it.
    for described in (params["mlflow_experiment"].description, compiled.spec.components[
            "comp-resolve-config"].input_definitions.parameters["mlflow_experiment"].description):
        assert "KFP's MLflow integration" in described and "MLFLOW_EXPERIMENT_ID" in described, described
    # Images train in aspect-ratio buckets by default (data.bucketing): the form said the resolution was square, and
    # a user with portraits read that they would be cropped to squares.
    resolution = params["resolution"].description
    assert "square," not in resolution and "bucket" in resolution and "data.bucketing" in resolution, resolution
    resolved = compiled.spec.components["comp-resolve-config"].input_definitions.parameters["resolution"].description
    assert "square," not in resolved and "bucket" in resolved, resolved
    # The form sends every field, so each one left at its default still replaces what a pasted base_config sets: the
    # pipeline's form said only "the other parameters override it", where resolve-config's said so.
    for described in (params["base_config"].description, compiled.spec.components[
            "comp-resolve-config"].input_definitions.parameters["base_config"].description):
        assert "each at its default too" in described and "warns of each it replaced" in described, described


def test_dag_order_and_conditions(compiled):
    # The exit handler records the final status whatever happened inside.
    (_, _, status), = compiled.tasks("record-status")
    assert status.trigger_policy.strategy == pb.PipelineTaskSpec.TriggerPolicy.ALL_UPSTREAM_TASKS_COMPLETED
    assert status.inputs.parameters["status"].task_final_status.producer_task == "exit-handler-1"
    # It finds the parent run by the KFP run's id and name, as resolve-config made it (kfp.local's ids can repeat).
    (_, _, resolve), = compiled.tasks("resolve-config")
    for task in (status, resolve):
        given = {k: task.inputs.parameters[k].runtime_value.constant.string_value
                 for k in ("pipeline_job_id", "pipeline_job_name")}
        assert given == {"pipeline_job_id": "{{$.pipeline_job_uuid}}", "pipeline_job_name": "{{$.pipeline_job_name}}"}
    # What it resolved to is a Markdown report the KFP UI shows, as it shows the later steps' (a local run collects it
    # as OUT/reports/resolve-config-report.md).
    outputs = compiled.spec.components[resolve.component_ref.name].output_definitions.artifacts
    assert outputs["report"].artifact_type.schema_title == "system.Markdown", outputs

    # The importer runs only when a dataset URI is given, and feeds prepare-dataset.
    (imp_dag, imp_name, imp), = compiled.tasks("importer")
    assert "dataset_uri" in compiled.condition_of(imp_dag) and "!= ''" in compiled.condition_of(imp_dag)
    # After resolve-config, whose check of the URI (no path, no credentials) is then the run's one line.
    runs_in = {t.component_ref.name: (dag_name, t) for dag_name, dag in compiled.dags() for t in dag.tasks.values()}
    waits, group = list(imp.dependent_tasks), imp_dag
    while group in runs_in:  # the groups around the importer, out to the root: what each waits for
        group, task = runs_in[group]
        waits += task.dependent_tasks
    assert "resolve-config" in waits, waits
    (_, _, resolve_task), = compiled.tasks("resolve-config")
    assert resolve_task.inputs.parameters["dataset_uri"].component_input_parameter.endswith("dataset_uri")
    preps = compiled.tasks("prepare-dataset")
    assert len(preps) == 2
    fed = [t for d, _, t in preps if "dataset" in t.inputs.artifacts]
    assert len(fed) == 1 and fed[0].inputs.artifacts["dataset"].task_output_artifact.producer_task == imp_name

    # Discovery runs only without a fixed LR; the zoom re-test only when the first test asks for it.
    tests = compiled.tasks("lr-range-test")
    stages = {t.inputs.parameters["stage"].runtime_value.constant.string_value: (d, t) for d, _, t in tests}
    assert set(stages) == {"first", "zoom"}
    zoom_dag, zoom = stages["zoom"]
    # The zoom runs when the first test says it is needed, its readable curve's choose-lr otherwise (not the reverse).
    assert "needs_zoom" in compiled.condition_of(zoom_dag)
    assert compiled.condition_of(zoom_dag).endswith("== true") and not compiled.condition_of(zoom_dag).startswith("!(")
    kept = [d for d, _, t in compiled.tasks("choose-lr")
            if t.inputs.parameters["source"].runtime_value.constant.string_value == "range-test"]
    assert kept and all(compiled.condition_of(d).startswith("!(") and "needs_zoom" in compiled.condition_of(d)
                        for d in kept)
    assert source(zoom.inputs.parameters["lr_min"]).endswith("zoom_lr_min")
    assert source(zoom.inputs.parameters["lr_max"]).endswith("zoom_lr_max")
    first_dag, _ = stages["first"]
    assert first_dag.startswith("comp-range-test")
    for dag_name, _, _ in compiled.tasks("discover-lr"):
        assert "fixed_lr" in compiled.condition_of(dag_name) and "== 0.0" in compiled.condition_of(dag_name)
    fixed = [t for d, _, t in compiled.tasks("choose-lr")
             if t.inputs.parameters["source"].runtime_value.constant.string_value == "fixed"]
    assert fixed and fixed[0].inputs.parameters["lr_mid"].component_input_parameter

    # The fine-tune takes the LR the branches agreed on, and the split.
    for dag_name, _, ft in compiled.tasks("finetune"):
        dag = dict(compiled.dags())[dag_name]
        assert ft.inputs.parameters["lr_mid"].task_output_parameter.producer_task.startswith("condition-branches")
        branches = dag.tasks[ft.inputs.parameters["lr_mid"].task_output_parameter.producer_task]
        assert branches.component_ref.name.startswith("comp-condition-branches")
        # Each bound from the same output of either branch: not the range's top as its midpoint.
        for name, wanted in (("lr_low", "lr_low"), ("lr_high", "lr_high"), ("lr_mid", "lr_mid"),
                             ("lr_source", "source")):
            out = ft.inputs.parameters[name].task_output_parameter
            oneof = compiled.spec.components[branches.component_ref.name].dag.outputs.parameters[
                out.output_parameter_key].value_from_oneof
            keys = [p.output_parameter_key for p in oneof.parameter_selectors]
            assert len(keys) == 2 and all(k.endswith(f"-{wanted}") for k in keys), (name, keys)
        assert ft.inputs.artifacts["split"].component_input_artifact == "split"

    # The retrain is conditional and takes the fine-tune's recommended epochs, and the LR the fine-tune kept
    # (lr_mid, or lr_high by successive halving), as the registry does.
    retrain_dags = set()
    for dag_name, _, rt in compiled.tasks("retrain-full"):
        assert "retrain" in compiled.condition_of(dag_name)
        # retrain on (true) retrains; retrain off keeps the fine-tune's checkpoint.
        assert compiled.condition_of(dag_name).endswith("== true") and not compiled.condition_of(dag_name).startswith(
            "!(")
        retrain_dags.add(dag_name)
        assert source(rt.inputs.parameters["recommended_epochs"]).endswith("recommended_epochs")
        assert source(rt.inputs.parameters["lr"]).endswith("lr_used")
        assert "lr_mid" not in rt.inputs.parameters  # the retrain's LR is the kept one, named as such
    for _, _, reg in compiled.tasks("register-model"):
        assert source(reg.inputs.parameters["lr"]).endswith("lr_used")

    # Samples and registration come last, on the retrained model when there is one.
    regs = compiled.tasks("register-model")
    assert regs
    for dag_name, _, reg in regs:
        dag = dict(compiled.dags())[dag_name]
        model = reg.inputs.artifacts["model"]
        producer = model.task_output_artifact.producer_task or model.component_input_artifact
        assert producer, "register-model has no model input"
        # The retrained model with the retrain's epochs where it retrained; else the fine-tune's model and its
        # recommended epochs (its chosen checkpoint's), both named in the registry's tags.
        if dag_name in retrain_dags:
            assert producer == "retrain-full" and source(reg.inputs.parameters["epochs"]) == "retrain-full.epochs"
        else:
            assert producer.endswith("finetune-model"), producer
            assert source(reg.inputs.parameters["epochs"]).endswith("finetune-recommended_epochs")
    samples = compiled.tasks("sample-images")
    assert any("retrained" in t.inputs.artifacts for _, _, t in samples)
    assert any("retrained" not in t.inputs.artifacts for _, _, t in samples)
    # A first range test whose curve gave no bounds hands on 0 and a zoom; one needing no zoom, 0 as its range: the
    # UI showed "lr_low: 0" under "the lowest LR at which the loss falls clearly".
    tested = compiled.spec.components["comp-lr-range-test"].output_definitions.parameters
    for name in ("lr_low", "lr_high", "lr_mid", "zoom_lr_min", "zoom_lr_max"):
        assert "0:" in tested[name].description, (name, tested[name].description)
    # The grid's description in the UI names what it shows: a row per prompt and seed, and the retrain's column where
    # there is one (it named only base, checkpoints and final).
    grid = compiled.spec.components["comp-sample-images"].output_definitions.artifacts["grid"].description
    assert "retrain" in grid and "seed" in grid, grid


def _graph_names(compiled, dag, branch: str = "") -> list[tuple[str, str, str]]:
    """(the name of the branch it runs in, its name on the run's graph, its component) of every step under `dag`,
    as the Kubeflow UI names the nodes (task_info.name); a branch is the nearest dsl.If / dsl.Else above it."""
    out = []
    for task in dag.tasks.values():
        ref = task.component_ref.name
        comp = compiled.spec.components[ref]
        if comp.WhichOneof("implementation") == "dag":
            conditional = ref.startswith("comp-condition-") and not ref.startswith("comp-condition-branches")
            out += _graph_names(compiled, comp.dag, task.task_info.name if conditional else branch)
        else:
            out.append((branch, task.task_info.name, ref))
    return out


def test_each_node_of_the_graph_says_what_it_does_and_in_which_branch(compiled):
    """The run's graph in the Kubeflow UI shows the steps by name: the four ways to an LR were four nodes named
    choose-lr, and the two registrations (retrained model or fine-tuned checkpoint) two named register-model; which
    one ran, or was skipped, was to be read off the branch around it. Each name is unique in its sub-pipeline and says
    what it does; the exit handler's step says what it records where."""
    names = _graph_names(compiled, compiled.spec.root.dag)
    (status,) = [n for _, n, ref in names if ref == "comp-record-status"]
    assert status == "record-final-status-in-mlflow"
    chosen = {(b, n) for b, n, ref in names if ref.startswith("comp-choose-lr")}
    assert chosen == {("prodigy-step", "choose-lr-from-prodigy-step"), ("zoom-needed", "choose-lr-from-zoom"),
                      ("first-test-readable", "choose-lr-from-range-test"), ("fixed-lr", "choose-lr-fixed")}, chosen
    delivered = {(b, n) for b, n, ref in names if ref.startswith(("comp-register-model", "comp-sample-images"))}
    assert delivered == {("retrain-on-all-data", "register-retrained-model"),
                         ("retrain-on-all-data", "sample-images-finetuned-and-retrained"),
                         ("keep-finetuned", "register-finetuned-model"),
                         ("keep-finetuned", "sample-images-finetuned")}, delivered
    # Within one dataset branch (the importer's or the folder's train-and-evaluate) no two steps share a name.
    for dataset_branch in ("import-dataset", "dataset-folder"):
        under = [n for b, n, _ in _graph_names(compiled, next(
            compiled.spec.components[t.component_ref.name].dag for _, dag in compiled.dags()
            for t in dag.tasks.values() if t.task_info.name == dataset_branch))]
        assert len(under) == len(set(under)), sorted(under)
    # Each dataset branch's sub-pipeline node reads as what it does: the folder's (the usual branch) was shown as
    # "train-and-evaluate-2", KFP's name for the second call of the same sub-pipeline.
    sub_pipelines = sorted(t.task_info.name for _, dag in compiled.dags() for t in dag.tasks.values()
                           if t.component_ref.name.startswith("comp-train-and-evaluate"))
    assert sub_pipelines == ["train-and-evaluate", "train-and-evaluate"], sub_pipelines


@pytest.mark.parametrize("doc", ["README.md", "docs/design.md"])
def test_the_documents_drawings_of_the_graph_name_its_steps_as_the_ui_does(compiled, doc):
    """The README and docs/design.md draw the DAG and say "those are the nodes' names on the run's graph": the
    README's named the dataset importer "importer", a node the Kubeflow UI shows as dataset-importer. Every step of
    the compiled graph is named in each drawing (a drawing's `choose-lr-from-...` stands for each choose-lr-from-*)."""
    text = (Path(__file__).parents[2] / doc).read_text()
    (drawing,) = [block for block in text.split("```")[1::2] if "record-final-status-in-mlflow" in block]
    named = set(re.findall(r"[a-z0-9]+(?:-[a-z0-9]+)*", drawing))
    elided = re.findall(r"([a-z0-9-]+-)\.\.\.", drawing)
    steps = {n for _, n, _ in _graph_names(compiled, compiled.spec.root.dag)}
    missing = sorted(n for n in steps if n not in named and not n.startswith(tuple(elided)))
    assert missing == [], f"{doc}'s drawing of the DAG does not name {missing}"


def test_every_training_step_shows_a_report_in_the_ui(compiled):
    """The KFP UI shows a step's HTML and Markdown outputs in its Visualizations tab (and no image files): retrain-full
    had none, so a user looking at the retrain saw nothing of its run, where range-test and finetune show theirs. Its
    earlier outputs stay for the pipelines that read them."""
    for step in ("lr-range-test", "prodigy-step-size", "finetune", "retrain-full"):
        for _, _, task in compiled.tasks(step):
            outputs = compiled.spec.components[task.component_ref.name].output_definitions
            kinds = {name: a.artifact_type.schema_title for name, a in outputs.artifacts.items()}
            assert (kinds.get("report_html"), kinds.get("report_md")) == ("system.HTML", "system.Markdown"), (step,
                                                                                                            kinds)
            if step == "retrain-full":
                assert (kinds["model"], kinds["metrics"]) == ("system.Model", "system.Metrics"), kinds
                assert {"epochs", "Output"} <= set(outputs.parameters), outputs.parameters
                described = outputs.artifacts["report_html"].description
                assert "training loss" in described, described


def test_the_lr_finder_is_a_parameter_resolved_at_run_time_and_picks_the_discovery_branch(compiled):
    """lr_finder reaches resolve-config with the method (auto is resolved there, at run time, so a UI user who
    changes `method` gets its finder), and resolve-config's resolved value picks, inside discover-lr, the Prodigy run
    and its choose-lr, or the range test's sub-pipeline; the fine-tune takes whichever bounds came out."""
    params = compiled.spec.root.input_definitions.parameters
    assert params["lr_finder"].default_value.string_value == RangefinderConfig().lr_finder
    assert "prodigy_step" in params["lr_finder"].description and "auto" in params["lr_finder"].description
    (_, _, resolve), = compiled.tasks("resolve-config")
    # Inside the exit handler the root's parameters arrive as pipeline channels.
    assert resolve.inputs.parameters["lr_finder"].component_input_parameter.endswith("lr_finder")
    assert resolve.inputs.parameters["method"].component_input_parameter.endswith("method")
    assert "lr_finder" in compiled.spec.components["comp-resolve-config"].output_definitions.parameters

    probes = compiled.tasks("prodigy-step-size")
    assert probes
    for probe_dag, _, probe in probes:
        assert "lr_finder" in compiled.condition_of(probe_dag)
        assert "== 'prodigy_step'" in compiled.condition_of(probe_dag)
        assert probe.inputs.artifacts["split"].component_input_artifact.endswith("split")
        read = [t for d, _, t in compiled.tasks("choose-lr") if d == probe_dag]
        assert len(read) == 1
        assert read[0].inputs.parameters["source"].runtime_value.constant.string_value == "prodigy-step"
        for bound in ("lr_low", "lr_mid", "lr_high"):
            assert source(read[0].inputs.parameters[bound]).endswith(".lr")
        assert source(read[0].inputs.parameters["updates"]).endswith(".updates")
    # The other branch of the same condition runs the range-test sub-pipeline; both sit inside discover-lr.
    for range_dag, _, _ in compiled.tasks("range-test"):
        assert "lr_finder" in compiled.condition_of(range_dag) and "!(" in compiled.condition_of(range_dag)


def test_gpu_and_limits_only_on_training_steps(compiled):
    for prefix in TRAINING:
        for _, _, task in compiled.tasks(prefix):
            res = compiled.executors[compiled.executor_of(task)].container.resources
            assert res.accelerator.resource_type == "nvidia.com/gpu", prefix
            assert res.accelerator.resource_count == "1", prefix
            assert res.resource_cpu_limit == "8" and res.resource_memory_limit == "48Gi", prefix
    for prefix in CHEAP:
        for _, _, task in compiled.tasks(prefix):
            res = compiled.executors[compiled.executor_of(task)].container.resources
            assert not res.accelerator.resource_type, prefix
            # Requests, so a namespace's ResourceQuota (a Kubeflow Profile's) admits the pod; no limit to be killed by.
            assert (res.resource_cpu_request, res.resource_memory_request) == ("500m", "2Gi"), prefix
            assert not res.resource_cpu_limit and not res.resource_memory_limit, prefix


def test_kubernetes_settings(compiled):
    cfg = RangefinderConfig().kubernetes
    for prefix in TRAINING:
        for _, _, task in compiled.tasks(prefix):
            k = compiled.k8s[compiled.executor_of(task)]
            assert dict(k.node_selector.labels) == cfg.node_selector, prefix
            tolerations = [(t.key, t.operator, t.effect) for t in k.tolerations]
            assert tolerations == [("nvidia.com/gpu", "Exists", "NoSchedule")]
            env = {e.name: e.value for e in compiled.executors[compiled.executor_of(task)].container.env}
            assert env["RANGEFINDER_WORK"] == "/data/work" and env["RANGEFINDER_CACHE"] == "/data/cache", prefix
            shm = [m for m in k.empty_dir_mounts if m.mount_path == "/dev/shm"]
            assert shm and shm[0].medium == "Memory" and shm[0].size_limit == cfg.shm_size
    for prefix in ("prepare-dataset", "choose-lr", "resolve-config"):
        for _, _, task in compiled.tasks(prefix):
            k = compiled.k8s[compiled.executor_of(task)]
            assert not k.node_selector.labels and not k.tolerations, prefix
    # The exit step removes a succeeded run's work folder from the data volume (steps/workdir.remove_run_work).
    for _, _, task in compiled.tasks("record-status"):
        env = {e.name: e.value for e in compiled.executors[compiled.executor_of(task)].container.env}
        assert env["RANGEFINDER_WORK"] == "/data/work"
        assert [m.mount_path for m in compiled.k8s[compiled.executor_of(task)].pvc_mount] == ["/data"]
    # MLflow credentials come from the Secret, as environment variables, on every step that logs.
    for prefix in ("lr-range-test", "finetune", "register-model", "record-status", "resolve-config"):
        for _, _, task in compiled.tasks(prefix):
            k = compiled.k8s[compiled.executor_of(task)]
            (sec,) = [s for s in k.secret_as_env if s.secret_name_parameter.runtime_value.constant.string_value
                      == cfg.mlflow_secret]
            assert {m.env_var for m in sec.key_to_env} == set(cfg.mlflow_secret_keys) and not sec.optional
            # What the step cannot log while MLflow is away outlives the pod, on the data volume.
            env = {e.name: e.value for e in compiled.executors[compiled.executor_of(task)].container.env}
            assert env["RANGEFINDER_MLFLOW_SPOOL"] == "/data/work/mlflow-spool", prefix
    for _, _, task in compiled.tasks("prepare-dataset"):
        k = compiled.k8s[compiled.executor_of(task)]
        assert not k.secret_as_env
        assert [(p.mount_path, p.pvc_name_parameter.runtime_value.constant.string_value) for p in k.pvc_mount] == [
            ("/data", "rangefinder-data")]


def test_pod_labels_go_on_every_step_and_mlflow_s_only_on_the_steps_that_reach_it(tmp_path):
    """pod_labels on every pod; mlflow_client_labels (what MLflow's NetworkPolicy admits) only where a step logs to
    MLflow: prepare-dataset and choose-lr had it too."""
    path = tmp_path / "p.yaml"
    compile_pipeline(parse_config({"kubernetes": {"pod_labels": {"team": "vision"},
                                                  "mlflow_client_labels": {"mlflow-access": "yes"}}}), str(path))
    c = Compiled(path)
    for prefix in (*TRAINING, *CHEAP):
        for _, _, task in c.tasks(prefix):
            labels = dict(c.k8s[c.executor_of(task)].pod_metadata.labels)
            talks_to_mlflow = prefix not in ("prepare-dataset", "choose-lr")
            assert labels == {"team": "vision", **({"mlflow-access": "yes"} if talks_to_mlflow else {})}, prefix


def _hf_token_secrets(c: Compiled, prefix: str) -> list:
    """The HF token Secrets wired into every task of `prefix` (one list per task, concatenated)."""
    out = []
    for _, _, task in c.tasks(prefix):
        for sec in c.k8s[c.executor_of(task)].secret_as_env:
            if any(m.env_var == "HF_TOKEN" for m in sec.key_to_env):
                out.append(sec)
    return out


MODEL_STEPS = ("resolve-config", "lr-range-test", "finetune", "retrain-full", "sample-images", "register-model")


def test_hf_token_secret_reaches_the_steps_that_load_the_base_model(tmp_path):
    """Named in the config: HF_TOKEN from that Secret in every step that loads (or first downloads) the model,
    optional so a public model needs none; nowhere else. With the shared caches on the data volume."""
    path = tmp_path / "p.yaml"
    compile_pipeline(parse_config({"kubernetes": {"hf_token_secret": "my-hf", "hf_token_secret_key": "token"}}),
                     str(path))
    c = Compiled(path)
    for prefix in MODEL_STEPS:
        secrets = _hf_token_secrets(c, prefix)
        assert secrets, f"{prefix} gets no HF_TOKEN"
        for sec in secrets:
            assert sec.secret_name_parameter.runtime_value.constant.string_value == "my-hf", prefix
            assert [(m.secret_key, m.env_var) for m in sec.key_to_env] == [("token", "HF_TOKEN")], prefix
            assert sec.optional, prefix
        for _, _, task in c.tasks(prefix):
            env = {e.name: e.value for e in c.executors[c.executor_of(task)].container.env}
            assert env["HF_HOME"] == "/data/cache/huggingface" and env["RANGEFINDER_CACHE"] == "/data/cache", prefix
    for prefix in ("prepare-dataset", "choose-lr", "record-status"):
        assert not _hf_token_secrets(c, prefix), prefix
    # The token is a Secret reference only: no parameter, default or env value carries one.
    assert "HF_TOKEN" not in json_format.MessageToJson(c.spec.root.input_definitions)

    off = tmp_path / "off.yaml"
    compile_pipeline(parse_config({"kubernetes": {"hf_token_secret": None}}), str(off))
    for prefix in MODEL_STEPS:
        assert not _hf_token_secrets(Compiled(off), prefix), prefix


def source(spec) -> str:
    """Where a task input comes from: `task.output` or a DAG input (a channel from outside a condition)."""
    if spec.task_output_parameter.producer_task:
        return f"{spec.task_output_parameter.producer_task}.{spec.task_output_parameter.output_parameter_key}"
    return spec.component_input_parameter


def test_retries_and_caching(compiled):
    for prefix in RETRIED:
        for _, _, task in compiled.tasks(prefix):
            assert task.retry_policy.max_retry_count == 2, prefix
            assert not task.caching_options.enable_cache, prefix
    for prefix in ("resolve-config", "register-model"):
        for _, _, task in compiled.tasks(prefix):
            assert not task.caching_options.enable_cache, prefix
    for _, _, task in compiled.tasks("choose-lr"):
        assert task.caching_options.enable_cache
        assert task.retry_policy.max_retry_count == 0


def test_prepare_dataset_is_never_served_from_the_cache(compiled):
    # Its inputs are the config (the dataset folder's path) and, from an object store, the imported artifact: not the
    # images behind them. KFP's cache key is those inputs, so a cached prepare-dataset would hand a rerun after images
    # were added to /data/datasets/mine (or re-uploaded to the same URI) the earlier run's split: the whole run would
    # train, pick and register on the old images, with nothing saying so.
    tasks = compiled.tasks("prepare-dataset")
    assert len(tasks) == 2  # the dataset_uri branch and the dataset folder's
    for dag, _, task in tasks:
        assert not task.caching_options.enable_cache, dag
        assert task.retry_policy.max_retry_count == 0, dag


def test_config_drives_pods_and_defaults(tmp_path):
    # Line breaks in defaults (U+2028 from a web page's text, a newline or a carriage return in a folder's name): KFP
    # writes each default into the package's header comment as it is, where the break ended the comment and the
    # package did not load.
    prompt, folder = "a cat\u2028on a mat", "/data/two\nlines \x85é\rcr"
    cfg = parse_config({
        "data": {"resolution": 768, "dataset_dir": folder},
        "sampling": {"prompts": [prompt]},
        "lr_range_test": {"lr_max": 0.05},
        "kubernetes": {
            "image": "registry.example.com/team/trainer:1", "gpu_count": 2, "accelerator_type": "nvidia.com/gpu",
            "node_selector": {"cloud.google.com/gke-accelerator": "nvidia-l4"},
            "tolerations": [{"key": "spot", "operator": "Equal", "value": "true", "effect": "NoExecute"}],
            "image_pull_secrets": ["regcred"], "retries": 0, "data_pvc": None,
        },
    })
    path = tmp_path / "p.yaml"
    compile_pipeline(cfg, str(path))
    c = Compiled(path)
    params = c.spec.root.input_definitions.parameters
    assert params["resolution"].default_value.number_value == 768
    assert params["lr_max"].default_value.number_value == pytest.approx(0.05)
    assert params["dataset_dir"].default_value.string_value == folder
    assert [v.string_value for v in params["prompts"].default_value.list_value.values] == [prompt]
    header = path.read_text(encoding="utf-8").split("\ncomponents:\n")[0]
    assert "dataset_dir: str [Default: '/data/two\\nlines \\x85é\\rcr']" in header
    for _, _, task in c.tasks("finetune"):
        ex = c.executors[c.executor_of(task)].container
        assert ex.image == "registry.example.com/team/trainer:1"
        assert ex.resources.accelerator.resource_count == "2"
        k = c.k8s[c.executor_of(task)]
        assert dict(k.node_selector.labels) == {"cloud.google.com/gke-accelerator": "nvidia-l4"}
        assert [(t.key, t.value, t.effect) for t in k.tolerations] == [("spot", "true", "NoExecute")]
        assert [s.secret_name for s in k.image_pull_secret] == ["regcred"]
        assert not k.pvc_mount
        assert task.retry_policy.max_retry_count == 0
    for _, _, task in c.tasks("prepare-dataset"):
        assert c.executors[c.executor_of(task)].container.image != "registry.example.com/team/trainer:1"


def test_no_gpu_config_requests_no_accelerator(tmp_path):
    path = tmp_path / "cpu.yaml"
    compile_pipeline(parse_config({"kubernetes": {"gpu_count": 0}}), str(path))
    c = Compiled(path)
    for _, _, task in c.tasks("finetune"):
        assert not c.executors[c.executor_of(task)].container.resources.accelerator.resource_type
        assert not c.k8s[c.executor_of(task)].node_selector.labels


def test_sample_images_asks_for_one_gpu_whatever_the_training_steps_get(tmp_path):
    """It renders every column on one GPU (sampling.render_grid): with kubernetes.gpu_count 4 its pod held 4, three
    of them idle while it rendered, on the same node pool, selector and taint as the training steps."""
    path = tmp_path / "p.yaml"
    compile_pipeline(parse_config({"kubernetes": {"gpu_count": 4}}), str(path))
    c = Compiled(path)
    for prefix in TRAINING:
        for _, _, task in c.tasks(prefix):
            res = c.executors[c.executor_of(task)].container.resources
            assert res.accelerator.resource_type == "nvidia.com/gpu", prefix
            assert res.accelerator.resource_count == ("1" if prefix == "sample-images" else "4"), prefix
            k = c.k8s[c.executor_of(task)]
            assert dict(k.node_selector.labels) == {"rangefinder.io/pool": "gpu"} and k.tolerations, prefix


def test_compile_cli(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  resolution: 256\nkubernetes:\n  gpu_count: 1\n")
    out = tmp_path / "sub" / "p.yaml"
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "compile", "--out", str(out),
                        "--config", str(cfg)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    c = Compiled(out)
    assert c.spec.root.input_definitions.parameters["resolution"].default_value.number_value == 256
    assert list(out.parent.iterdir()) == [out]

    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  resolution: 250\n")
    out2 = tmp_path / "p2.yaml"
    r = subprocess.run([sys.executable, "-m", "rangefinder.cli.main", "compile", "--out", str(out2),
                        "--config", str(bad)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "data.resolution" in r.stderr and "multiple of 8" in r.stderr
    assert not out2.exists()


def test_compile_refuses_a_package_name_kfp_s_upload_does_not_take(tmp_path, capsys):
    """The package is YAML whatever --out is called (the compile goes to a temporary .yaml, from which KFP's compiler
    picks the format): `--out pipeline` or `--out p.json` wrote YAML under a name KFP's upload refuses, or reads as
    another format, and KFP's own compiler refuses. One line naming the name to use, before anything is written."""
    from rangefinder.cli.main import main as cli_main

    for out, named in (("pipeline", "pipeline.yaml"), ("p.json", "p.yaml"), ("p.YML", "p.yaml")):
        assert cli_main(["compile", "--out", str(tmp_path / out)]) == 2
        assert capsys.readouterr().err == (f"rangefinder compile: error: --out {tmp_path / out}: the package is YAML, "
                                           "which KFP's upload knows by a name ending in .yaml or .yml; name it "
                                           f"{tmp_path / named}\n")
    assert cli_main(["compile", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (f"rangefinder compile: error: --out {tmp_path} is a folder; name the package "
                                       f"in it, e.g. {tmp_path / 'rangefinder-pipeline.yaml'}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model", ["embedded", "sd3 folder", "sd1 folder, SD 1.4's scheduler config"])
def test_compile_checks_a_local_model_s_family_without_loading_torch_or_diffusers(model, tiny_model_dir, tiny_sd3_dir,
                                                                                 tmp_path):
    """`compile` on the embedded model or a local folder judges the settings against the model's family before
    writing anything (families.check_pipeline_settings), from its model_index.json and config.json files. It imported
    diffusers and torch to do it (a laptop's compile went from about 3.5 s to 9 s); the family rules are plain Python
    (training/family_rules.py) and the configs JSON. Checked in a fresh interpreter, on a config the family accepts
    and on one it refuses. A scheduler config written without prediction_type (SD 1.4's) predicts DDPMScheduler's
    default, epsilon, as when diffusers read it. The SD configs sample with the demo's scheduler, DDIM (its name was
    checked by importing diffusers: a compile of the demo's config took 6.2 s, 1.6 s without)."""
    import json
    import shutil

    base = {"model": {"base_model": str(tiny_sd3_dir)}} if model == "sd3 folder" else {
        "sampling": {"scheduler": "DDIMScheduler"}}
    refused = ({"training": {"prediction_type": "v_prediction"}}, "training.prediction_type: Stable Diffusion 3")
    if model != "sd3 folder":
        refused = ({"training": {"flow": {"shift": 2.0}}}, "training.flow (shift): the base model is a DDPM model")
    if model.startswith("sd1 folder"):
        folder = tmp_path / "sd14-like"
        shutil.copytree(tiny_model_dir, folder, ignore=shutil.ignore_patterns("*.safetensors"))  # configs alone
        scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
        del scheduler["prediction_type"]
        (folder / "scheduler" / "scheduler_config.json").write_text(json.dumps(scheduler))
        base = {**base, "model": {"base_model": str(folder)}}
    code = ("import json, sys\nfrom rangefinder.cli.main import main\nrc = main(sys.argv[1:])\n"
            "loaded = sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules)\n"
            "print(json.dumps([rc, loaded]), file=sys.stderr)\n")
    cfg = tmp_path / "c.yaml"
    for settings, status in ((base, 0), ({**base, **refused[0]}, 2)):
        cfg.write_text(yaml.safe_dump(settings))
        r = subprocess.run([sys.executable, "-c", code, "compile", "--config", str(cfg), "--out",
                            str(tmp_path / "p.yaml")], capture_output=True, text=True)
        lines = r.stderr.strip().splitlines()
        assert json.loads(lines[-1]) == [status, []], r.stderr
    assert refused[1] in lines[-2], lines


def test_local_build_carries_no_cluster_environment(tmp_path):
    """kfp.local hands a task's environment variables to the step: the local build must carry none of the cluster's
    (data-volume paths, MLflow URI), nor retries (kfp.local would rerun a failing step) or cached steps."""
    from kfp import compiler

    from rangefinder.pipelines.pipeline import build_pipeline

    path = tmp_path / "local.yaml"
    compiler.Compiler().compile(build_pipeline(RangefinderConfig(), local=True), package_path=str(path))
    c = Compiled(path)
    for name, ex in c.executors.items():
        if ex.HasField("container"):
            assert not ex.container.env, name
    for _dag, _name, task in c.tasks("finetune") + c.tasks("prepare-dataset") + c.tasks("lr-range-test"):
        assert task.retry_policy.max_retry_count == 0 and not task.caching_options.enable_cache


def test_a_package_carrying_a_url_with_credentials_is_refused(tmp_path):
    """Defence in depth: the config refuses such URLs when read; a config changed without validation (model_copy)
    is still caught when compiled, and no package is left behind."""
    from rangefinder.config import ModelConfig
    from rangefinder.errors import ConfigError

    cfg = RangefinderConfig().model_copy(
        update={"model": ModelConfig.model_construct(base_model="https://rf-user:hunter2-pw@models.example/sd.ckpt")})
    out = tmp_path / "p.yaml"
    with pytest.raises(ConfigError, match="credentials in the URL https://models.example/sd.ckpt") as e:
        compile_pipeline(cfg, str(out))
    assert "hunter2" not in str(e.value) and not out.exists()


def test_kfp_still_names_its_caller_while_the_pipeline_is_built():
    """build_pipeline hands kfp an `inspect.stack()` that reads no source (a compile's largest cost in a deep stack):
    kfp's message still names the method it guards, and kfp's own `inspect` is back afterwards."""
    import inspect

    from kfp.dsl import pipeline_task

    from rangefinder.pipelines.pipeline import _kfp_stack_without_source, build_pipeline

    @dsl.pipeline
    def inner():
        kfp_components.choose_lr(config_json="{}", source="fixed", lr_low=1e-4, lr_high=1e-4, lr_mid=1e-4)

    with pytest.raises(ValueError, match="^set_env_variable can only be used on single-step components"):
        with _kfp_stack_without_source():
            @dsl.pipeline
            def outer():
                inner().set_env_variable("A", "b")
    assert pipeline_task.inspect is inspect
    build_pipeline(RangefinderConfig())
    assert pipeline_task.inspect is inspect


def test_kfp_refuses_pipeline_outputs_from_inside_the_exit_handler(compiled):
    """The pipeline has no outputs (docs/design.md, 4.4): every step runs inside the exit handler that records the
    run's state in MLflow, and kfp 2.17 refuses a pipeline output made there, a dsl.OneOf across branches too. A kfp
    that takes it fails this test: then the delivered model's URI and LR can be the pipeline's outputs."""
    from kfp.compiler.compiler_utils import InvalidTopologyException

    assert not compiled.spec.root.output_definitions.parameters and not compiled.spec.root.output_definitions.artifacts
    def outputs_from_the_exit_handler(retrain=False):
        with dsl.ExitHandler(kfp_components.record_status(mlflow_experiment="x", pipeline_job_id="",
                                                          pipeline_job_name="")):
            with dsl.If(retrain == True):  # noqa: E712 (a KFP expression)
                kept = kfp_components.choose_lr(config_json="{}", source="fixed", lr_low=1.0, lr_high=1.0, lr_mid=1.0)
            with dsl.Else():
                other = kfp_components.choose_lr(config_json="{}", source="fixed", lr_low=2.0, lr_high=2.0,
                                                 lr_mid=2.0)
        return dsl.OneOf(kept.outputs["lr_mid"], other.outputs["lr_mid"])

    # Real types: this module's annotations are strings (from __future__ import annotations), which kfp cannot read.
    outputs_from_the_exit_handler.__annotations__ = {"retrain": bool, "return": float}
    with pytest.raises(InvalidTopologyException, match=r"from within the control flow group dsl\.ExitHandler"):
        dsl.pipeline(name="outputs-from-the-exit-handler")(outputs_from_the_exit_handler)


def test_a_compile_cut_short_leaves_the_earlier_pipeline_whole(tmp_path):
    """The compiler writes the YAML where it was asked to: a write the disk refused part-way (a full disk; here the
    file-size limit, EFBIG, as a full disk fails with ENOSPC), or a Ctrl-C in it, left a truncated pipeline.yaml in
    place of the one there before, which the Kubeflow UI then refused on upload. It is written beside, then renamed."""
    import errno
    import resource
    import signal

    path = tmp_path / "pipeline.yaml"
    path.write_text("the earlier pipeline\n")
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing us
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))  # the YAML is over 300 kB
    try:
        with pytest.raises(OSError) as e:
            compile_pipeline(None, str(path))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, previous)
    assert e.value.errno == errno.EFBIG
    assert path.read_text() == "the earlier pipeline\n"
    assert [p.name for p in tmp_path.iterdir()] == ["pipeline.yaml"]  # no temporary file left
