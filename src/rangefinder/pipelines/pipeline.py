"""The DAG: dataset -> prepare -> LR range test (-> zoom) -> fine-tune (-> full-data retrain) -> samples -> registry.

```
record-status  (exit handler: runs whatever happened, records the final state)
└── resolve-config (validates the config; resolves the base model once, for every later step)
    ├── if dataset_uri:  importer -> prepare-dataset -> train-and-evaluate
    └── else:            prepare-dataset (dataset_dir or the embedded default) -> train-and-evaluate

train-and-evaluate (one sub-pipeline, so the two dataset branches share everything after the split)
    ├── if fixed_lr == 0:  discover-lr (lr_finder: resolve-config's, auto resolved for the model and method)
    │       if lr_finder == prodigy_step:  prodigy-step-size -> choose-lr (its final step size as the one LR)
    │       else:  range-test
    │           lr-range-test -> if censored / too few points: lr-range-test (zoom) -> choose-lr
    │                            else:                                             choose-lr
    ├── else:              choose-lr (the fixed LR; no discovery)
    ├── finetune (at the chosen midpoint, or lr_mid against lr_high by successive halving)
    ├── if retrain:  retrain-full -> sample-images(finetuned, retrained) -> register-model(retrained)
    └── else:        sample-images(finetuned) -> register-model(finetuned: its chosen checkpoint's model)
```

Branches meet through `dsl.OneOf` on *parameters* (the LR bounds) only: kfp.local resolves a parameter OneOf but
not an artifact one, and the same DAG must run there.

Everything about pods (GPU, node pool, volumes, secrets, retries, caching) comes from `KubernetesConfig` through
kfp's and kfp-kubernetes' own calls, at compile time. Nothing here reads the environment or the cluster at import.
"""

# No `from __future__ import annotations`: KFP reads the pipeline functions' annotations as real types.
import inspect
import sys
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple, Optional

from kfp import dsl, kubernetes

from rangefinder.config import KubernetesConfig, RangefinderConfig
from rangefinder.container_images import cpu_image, trainer_image
from rangefinder.pipelines import kfp_components as c
from rangefinder.steps.resolve_config import parameters_from_config
from rangefinder.tracking.spool import SPOOL_ENV

PIPELINE_NAME = "rangefinder-finetune"
PIPELINE_DESCRIPTION = (
    "Fine-tune Stable Diffusion with the learning rate found by measurement (an LR range test, or the step size of a "
    "Prodigy run where that measured better: lr_finder) and the training length found by a constant-LR fine-tune; "
    "every metric, report and model is tracked in MLflow."
)

# Steps whose pods need the GPU node pool; the cheap ones run on any node and may be cached.
TRAINING_STEPS = ("lr_range_test", "prodigy_step_size", "finetune", "retrain_full", "sample_images")
# The GPU step that uses one GPU whatever kubernetes.gpu_count gives the training: it renders every column on the
# first (sampling.render_grid), so more would be held idle for as long as it renders.
ONE_GPU_STEPS = ("sample_images",)
# Steps whose pods talk to MLflow (they log to the parent run) and so get its credentials and the labels its
# NetworkPolicy admits (kubernetes.mlflow_client_labels).
MLFLOW_STEPS = ("resolve_config", "lr_range_test", "prodigy_step_size", "finetune", "retrain_full", "sample_images",
                "register_model", "record_status")
# Steps that load the base model: the first resolves (downloads, converts) it into the caches on the data volume, the
# others load what it resolved (or resolve again where they cannot see it). They get the caches' paths and HF_TOKEN.
MODEL_STEPS = ("resolve_config", "lr_range_test", "prodigy_step_size", "finetune", "retrain_full", "sample_images",
               "register_model")
# Deterministic, cheap steps: the same inputs give the same outputs, so a rerun may reuse them. Not prepare-dataset:
# it reads a folder on the data volume (or an object-store URI) whose path is all KFP's cache key sees, so a rerun
# after images were added or changed there would be handed the earlier run's split and train on the old images.
CACHED_STEPS = ("choose_lr",)
SHM_VOLUME = "dshm"
# With distributed.num_nodes > 1 these steps submit a Kubeflow Trainer TrainJob instead of training in their own pod.
TRAINJOB_STEPS = ("lr_range_test", "prodigy_step_size", "finetune", "retrain_full")
SUBMITTER_CPU, SUBMITTER_MEMORY = "1", "4Gi"  # the submitting pod copies the split, streams logs, writes reports
NAMESPACE_ENV = "RANGEFINDER_NAMESPACE"
NUM_NODES_ENV = "RANGEFINDER_NUM_NODES"


def configure_task(task: dsl.PipelineTask, step: str, k8s: KubernetesConfig, local: bool = False,
                   num_nodes: int = 1) -> dsl.PipelineTask:
    """The pod settings of one step, from the config. `local`: for kfp.local, which ignores pod settings but does
    pass a task's environment variables on, so the cluster's paths and URIs are left out. `num_nodes` > 1: the
    training runs (TRAINJOB_STEPS) go to a Kubeflow Trainer TrainJob that this step's pod submits and watches
    (rangefinder.launch.trainjob); the pod itself then needs no GPU, only the volume, the secrets and its namespace."""
    training = step in TRAINING_STEPS
    if local:
        task.set_caching_options(False)  # a local rerun is meant to run again
        return task.set_display_name(step.replace("_", "-"))
    task.set_container_image(trainer_image(k8s.image) if training else cpu_image(k8s.cpu_image))
    task.set_caching_options(step in CACHED_STEPS)
    submits = num_nodes > 1 and step in TRAINJOB_STEPS
    if submits:
        task.set_cpu_limit(SUBMITTER_CPU)
        task.set_memory_limit(SUBMITTER_MEMORY)
        # The TrainJob goes to the namespace the step runs in (the runner's RBAC: manifests/multi-node).
        kubernetes.use_field_path_as_env(task, env_name=NAMESPACE_ENV, field_path="metadata.namespace")
        task.set_env_variable(NUM_NODES_ENV, str(num_nodes))
        if k8s.retries:
            # A retry replaces the TrainJob, which resumes from the newest whole checkpoint on the data volume.
            task.set_retry(num_retries=k8s.retries, backoff_duration="60s", backoff_factor=2.0)
    elif training:
        if k8s.gpu_count > 0:
            task.set_accelerator_type(k8s.accelerator_type)
            task.set_accelerator_limit(1 if step in ONE_GPU_STEPS else k8s.gpu_count)
            for key, value in k8s.node_selector.items():
                kubernetes.add_node_selector(task, label_key=key, label_value=value)
            for t in k8s.tolerations:
                kubernetes.add_toleration(task, key=t.key, operator=t.operator, value=t.value, effect=t.effect)
        task.set_cpu_limit(k8s.cpu_limit)
        task.set_memory_limit(k8s.memory_limit)
        # Data loader workers share batches through /dev/shm, which is 64 MiB in a default pod.
        kubernetes.empty_dir_mount(task, volume_name=SHM_VOLUME, mount_path="/dev/shm", medium="Memory",
                                   size_limit=k8s.shm_size)
        if k8s.retries:
            # A preempted node kills the pod; the retry resumes from the newest whole checkpoint (training.resume).
            # sample-images, on the same (often spot) GPU pool, renders its fixed seeds again, in its attempt's MLflow
            # run: without a retry a preemption there failed the run after all the training, with nothing registered.
            task.set_retry(num_retries=k8s.retries, backoff_duration="60s", backoff_factor=2.0)
    else:
        # Requests without limits: admitted under a namespace's ResourceQuota (KubernetesConfig.cpu_request).
        task.set_cpu_request(k8s.cpu_request)
        task.set_memory_request(k8s.memory_request)
    if k8s.data_pvc:
        kubernetes.mount_pvc(task, pvc_name=k8s.data_pvc, mount_path=k8s.data_mount_path)
    if step in MLFLOW_STEPS:
        secret_keys = list(k8s.mlflow_secret_keys) if k8s.mlflow_secret else []
        if "MLFLOW_TRACKING_URI" not in secret_keys:
            task.set_env_variable("MLFLOW_TRACKING_URI", k8s.mlflow_tracking_uri)
        if secret_keys:
            kubernetes.use_secret_as_env(task, secret_name=k8s.mlflow_secret,
                                         secret_key_to_env={key: key for key in secret_keys})
        if k8s.data_pvc:
            # What a step cannot log while MLflow is away must outlive its pod: on the data volume, for
            # `rangefinder relog` (tracking/spool.py).
            task.set_env_variable(SPOOL_ENV, f"{k8s.data_mount_path.rstrip('/')}/work/mlflow-spool")
    if k8s.image_pull_secrets:
        kubernetes.set_image_pull_secrets(task, list(k8s.image_pull_secrets))
    labels = {**k8s.pod_labels, **(k8s.mlflow_client_labels if step in MLFLOW_STEPS else {})}
    for key, value in labels.items():
        kubernetes.add_pod_label(task, label_key=key, label_value=value)
    if step in MODEL_STEPS and k8s.hf_token_secret:
        # Gated or private hub models; optional, so a run on a public model needs no Secret. The token stays in the
        # environment, where huggingface_hub reads it: never a parameter, param or tag.
        kubernetes.use_secret_as_env(task, secret_name=k8s.hf_token_secret,
                                     secret_key_to_env={k8s.hf_token_secret_key: "HF_TOKEN"}, optional=True)
    if step in MODEL_STEPS or step == "prepare_dataset":
        # Downloads (hub models), converted single files and the latent cache land on the data volume, shared by
        # every pod of the run, not in the pod's small disk.
        if k8s.data_pvc:
            mount = k8s.data_mount_path.rstrip("/")
            task.set_env_variable("RANGEFINDER_CACHE", f"{mount}/cache")
            task.set_env_variable("HF_HOME", f"{mount}/cache/huggingface")
    if k8s.data_pvc and (step in TRAINING_STEPS or step == "record_status"):
        # Runs (and their checkpoints) outlive a preempted pod there; the retry resumes from them, and the exit step
        # removes a succeeded run's work folder (steps/workdir.remove_run_work).
        task.set_env_variable("RANGEFINDER_WORK", f"{k8s.data_mount_path.rstrip('/')}/work")
    return task.set_display_name(step.replace("_", "-"))


def pipeline_config(k8s: KubernetesConfig) -> dsl.PipelineConfig:
    """The run-level settings of KFP 2.17 (the package's platform spec): how long the run's Workflow and pods are kept
    after it ends, and the longest it may run; from `kubernetes.ttl_seconds_*` and `active_deadline_seconds`."""
    return dsl.PipelineConfig(
        ttl_seconds_after_finished=k8s.ttl_seconds_after_finished,
        ttl_seconds_after_success=k8s.ttl_seconds_after_success,
        ttl_seconds_after_failure=k8s.ttl_seconds_after_failure,
        active_deadline_seconds=k8s.active_deadline_seconds,
    )


class Bounds(NamedTuple):
    """discover-lr's and range-test's outputs (KFP reads the fields): the LR range to fine-tune with, and which
    measurement chose it."""

    lr_low: float
    lr_high: float
    lr_mid: float
    source: str  # "range-test", "zoom" or "prodigy-step"


class _InspectWithoutSource(types.ModuleType):
    """The `inspect` module as kfp's pipeline_task module sees it while a pipeline is built: the same, but `stack()`
    reads no source. kfp calls `inspect.stack()[1][3]` (its caller's name, for an error message) each time a task's
    resources or environment are set, about 80 times a build, and `inspect.stack()` opens the source of every frame
    on the stack: in a deep stack (a test, a notebook, a service) that was ~2.5 of a compile's ~4 CPU-s. The cost is
    CPython's (`inspect.getmodule` per frame; python/cpython#92041, open); projects that hit it walk the frames
    themselves, as `stack()` below does. Not a kfp setting, so this swaps the module kfp sees, only while it builds,
    and leaves any other kfp version as it is (`_kfp_stack_without_source`)."""

    def __getattr__(self, name: str) -> object:
        return getattr(inspect, name)

    @staticmethod
    def stack(context: int = 1) -> list[inspect.FrameInfo]:
        frames: list[inspect.FrameInfo] = []
        frame: Optional[types.FrameType] = sys._getframe(1)  # from the caller of stack(), as inspect.stack() has them
        while frame is not None:
            frames.append(inspect.FrameInfo(frame, frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name,
                                            None, None))
            frame = frame.f_back
        return frames


@contextmanager
def _kfp_stack_without_source() -> Iterator[None]:
    from kfp.dsl import pipeline_task

    if getattr(pipeline_task, "inspect", None) is not inspect:  # another kfp: leave it as it is
        yield
        return
    pipeline_task.inspect = _InspectWithoutSource("inspect")
    try:
        yield
    finally:
        pipeline_task.inspect = inspect


def build_pipeline(cfg: Optional[RangefinderConfig] = None, *, local: bool = False) -> Callable:
    """The pipeline function; `cfg` gives the parameters' defaults and the pod settings (none when `local`)."""
    with _kfp_stack_without_source():
        return _build_pipeline(cfg or RangefinderConfig(), local=local)


def _build_pipeline(cfg: RangefinderConfig, *, local: bool) -> Callable:
    k8s = cfg.kubernetes
    d = parameters_from_config(cfg)

    def step(task: dsl.PipelineTask, name: str, shown: Optional[str] = None) -> dsl.PipelineTask:
        """`task` configured as step `name`; `shown`: its name on the run's graph where the step appears in more than
        one branch, saying which (the Kubeflow UI names each node by it alone), else the step's."""
        configured = configure_task(task, name, k8s, local=local, num_nodes=cfg.distributed.num_nodes)
        return configured.set_display_name(shown) if shown else configured

    @dsl.pipeline(name="range-test")
    def range_test(
        config_json: str, split: dsl.Input[dsl.Dataset], mlflow_parent_run_id: str
    ) -> Bounds:
        """LR range test, and a second one on a narrower range when the first curve cannot be read well."""
        first = step(c.lr_range_test(config_json=config_json, split=split, stage="first",
                                     mlflow_parent_run_id=mlflow_parent_run_id), "lr_range_test")
        first.set_display_name("lr-range-test")
        with dsl.If(first.outputs["needs_zoom"] == True, name="zoom-needed"):  # noqa: E712 (a KFP expression)
            zoom = step(c.lr_range_test(config_json=config_json, split=split, stage="zoom",
                                        lr_min=first.outputs["zoom_lr_min"], lr_max=first.outputs["zoom_lr_max"],
                                        mlflow_parent_run_id=mlflow_parent_run_id), "lr_range_test")
            zoom.set_display_name("lr-range-test-zoom")
            zoomed = step(c.choose_lr(config_json=config_json, source="zoom", lr_low=zoom.outputs["lr_low"],
                                      lr_high=zoom.outputs["lr_high"], lr_mid=zoom.outputs["lr_mid"]), "choose_lr",
                          "choose-lr-from-zoom")
        with dsl.Else(name="first-test-readable"):
            kept = step(c.choose_lr(config_json=config_json, source="range-test", lr_low=first.outputs["lr_low"],
                                    lr_high=first.outputs["lr_high"], lr_mid=first.outputs["lr_mid"]), "choose_lr",
                        "choose-lr-from-range-test")
        return Bounds(
            lr_low=dsl.OneOf(zoomed.outputs["lr_low"], kept.outputs["lr_low"]),
            lr_high=dsl.OneOf(zoomed.outputs["lr_high"], kept.outputs["lr_high"]),
            lr_mid=dsl.OneOf(zoomed.outputs["lr_mid"], kept.outputs["lr_mid"]),
            source=dsl.OneOf(zoomed.outputs["source"], kept.outputs["source"]),
        )

    @dsl.pipeline(name="discover-lr")
    def discover_lr(
        config_json: str, split: dsl.Input[dsl.Dataset], lr_finder: str, mlflow_parent_run_id: str
    ) -> Bounds:
        """The LR measured by the finder resolve-config resolved for the base model and method (auto included): the
        step size a Prodigy run ends on, or the LR range test (and its zoom)."""
        with dsl.If(lr_finder == "prodigy_step", name="prodigy-step"):
            probe = step(c.prodigy_step_size(config_json=config_json, split=split,
                                             mlflow_parent_run_id=mlflow_parent_run_id), "prodigy_step_size")
            size = probe.outputs["lr"]
            read = step(c.choose_lr(config_json=config_json, source="prodigy-step", lr_low=size, lr_high=size,
                                    lr_mid=size, updates=probe.outputs["updates"],
                                    factor=probe.outputs["factor"]), "choose_lr", "choose-lr-from-prodigy-step")
        with dsl.Else(name="lr-range-test"):
            tested = range_test(config_json=config_json, split=split, mlflow_parent_run_id=mlflow_parent_run_id)
        return Bounds(**{k: dsl.OneOf(read.outputs[k], tested.outputs[k]) for k in Bounds._fields})

    @dsl.pipeline(name="train-and-evaluate")
    def train_and_evaluate(
        config_json: str, split: dsl.Input[dsl.Dataset], fixed_lr: float, lr_finder: str, retrain: bool,
        mlflow_parent_run_id: str
    ):
        """Everything after the split: the LR, the fine-tune, the optional retrain, the samples and the registry."""
        with dsl.If(fixed_lr == 0.0, name="discover-lr"):
            found = discover_lr(config_json=config_json, split=split, lr_finder=lr_finder,
                                mlflow_parent_run_id=mlflow_parent_run_id)
        with dsl.Else(name="fixed-lr"):
            fixed = step(c.choose_lr(config_json=config_json, source="fixed", lr_low=fixed_lr, lr_high=fixed_lr,
                                     lr_mid=fixed_lr), "choose_lr", "choose-lr-fixed")
        lr = {k: dsl.OneOf(found.outputs[k], fixed.outputs[k]) for k in ("lr_low", "lr_high", "lr_mid", "source")}

        tuned = step(c.finetune(config_json=config_json, split=split, lr_low=lr["lr_low"], lr_high=lr["lr_high"],
                                lr_mid=lr["lr_mid"], lr_source=lr["source"],
                                mlflow_parent_run_id=mlflow_parent_run_id), "finetune")
        # The LR the fine-tune kept (lr_mid, or another candidate by successive halving) is retrained and registered.
        kept_lr = tuned.outputs["lr_used"]
        with dsl.If(retrain == True, name="retrain-on-all-data"):  # noqa: E712
            full = step(c.retrain_full(config_json=config_json, split=split, lr_low=lr["lr_low"],
                                       lr_high=lr["lr_high"], lr=kept_lr,
                                       recommended_epochs=tuned.outputs["recommended_epochs"],
                                       mlflow_parent_run_id=mlflow_parent_run_id), "retrain_full")
            step(c.sample_images(config_json=config_json, finetuned=tuned.outputs["model"],
                                 retrained=full.outputs["model"], mlflow_parent_run_id=mlflow_parent_run_id),
                 "sample_images", "sample-images-finetuned-and-retrained")
            step(c.register_model(config_json=config_json, model=full.outputs["model"], lr=kept_lr,
                                  epochs=full.outputs["epochs"], mlflow_parent_run_id=mlflow_parent_run_id),
                 "register_model", "register-retrained-model")
        with dsl.Else(name="keep-finetuned"):
            step(c.sample_images(config_json=config_json, finetuned=tuned.outputs["model"],
                                 mlflow_parent_run_id=mlflow_parent_run_id), "sample_images", "sample-images-finetuned")
            step(c.register_model(config_json=config_json, model=tuned.outputs["model"], lr=kept_lr,
                                  epochs=tuned.outputs["recommended_epochs"],
                                  mlflow_parent_run_id=mlflow_parent_run_id), "register_model",
                 "register-finetuned-model")

    @dsl.pipeline(name=PIPELINE_NAME, description=PIPELINE_DESCRIPTION,
                  pipeline_config=None if local else pipeline_config(k8s))
    def rangefinder_finetune(
        dataset_uri: str = d["dataset_uri"],
        dataset_dir: str = d["dataset_dir"],
        base_model: str = d["base_model"],
        base_model_revision: str = d["base_model_revision"],
        method: str = d["method"],
        lr_finder: str = d["lr_finder"],
        resolution: int = d["resolution"],
        batch_size: int = d["batch_size"],
        grad_accum: int = d["grad_accum"],
        ramp: str = d["ramp"],
        lr_min: float = d["lr_min"],
        lr_max: float = d["lr_max"],
        range_test_epochs: int = d["range_test_epochs"],
        finetune_epochs: int = d["finetune_epochs"],
        val_split: float = d["val_split"],
        split_seed: int = d["split_seed"],
        seed: int = d["seed"],
        fixed_lr: float = d["fixed_lr"],
        retrain: bool = d["retrain"],
        retrain_epochs: int = d["retrain_epochs"],
        prompts: list = d["prompts"],
        mlflow_experiment: str = d["mlflow_experiment"],
        mlflow_ui_url: str = d["mlflow_ui_url"],
        base_config: str = d["base_config"],
    ):
        """Fine-tune Stable Diffusion with the learning rate and training length found by measurement.

        Args:
            dataset_uri: Object-store URI (s3://, gs://, minio://) of a dataset folder: images with a caption in a
                sibling .txt or .caption, or a metadata.jsonl or metadata.csv. Imported as a Dataset artifact. Empty:
                use dataset_dir.
            dataset_dir: Path of the dataset folder on the data volume (e.g. /data/datasets/mine). Empty with an
                empty dataset_uri: the embedded synthetic shapes dataset.
            base_model: Base model: a diffusers folder or single-file .safetensors checkpoint on the data volume, or
                a hub id (e.g. stable-diffusion-v1-5/stable-diffusion-v1-5), downloaded once per run into the data
                volume's cache (gated repos: the HF token Secret). Empty: the embedded tiny model.
            base_model_revision: Branch, tag or commit of a hub base_model. Empty: main.
            method: What trains: full, lora or textual_inversion.
            lr_finder: How the LR is measured when fixed_lr is 0: range_test (the LR range test, and a zoom when
                needed), prodigy_step (a Prodigy run of finetune_epochs at lr 1.0; the fine-tune trains at the step
                size d x lr it ended on, times 4 on SDXL's and SD3's full fine-tune), or auto, the default
                (prodigy_step for full and lora on an SD3 or Flux base model and for full on SDXL, range_test
                otherwise; read off the model by resolve-config).
            resolution: Training resolution in pixels, a multiple of 8 (512 for SD 1.x, 1024 for SDXL): each image
                trains at about resolution^2 pixels in the aspect-ratio bucket nearest its own (a square crop with
                data.bucketing off in base_config).
            batch_size: Images per micro-batch per GPU.
            grad_accum: Micro-batches per optimizer update (effective batch = batch_size x grad_accum x GPUs).
            ramp: LR range test ramp: exp (geometric, the usual choice for a wide range) or linear (Smith 2017).
            lr_min: LR range test start (a value surely too low to learn), e.g. 1e-7. 0: the method's default
                (full 1e-7; lora and textual_inversion 1e-6).
            lr_max: LR range test end (a value surely too high), e.g. 1e-2. 0: the method's default (full 1e-2;
                lora and textual_inversion 1.0).
            range_test_epochs: Epochs the LR range test ramps over.
            finetune_epochs: Epochs of the constant-LR fine-tune; longer than needed, the step window is found in it.
            val_split: Share of images held out for validation loss (0.2 = 20 %, rounded up, at least one image).
            split_seed: Seed of the train/validation split; the same seed and files give the same split.
            seed: Seed of training (weights, noise, shuffling).
            fixed_lr: A learning rate chosen by hand; skips LR discovery (the range tests or the Prodigy run of
                lr_finder). 0: find it by measurement.
            retrain: Retrain on train + validation for the recommended epochs, and register that model. Off: the
                fine-tune's checkpoint at the recommended length is registered (its validation loss was measured).
            retrain_epochs: Epochs of the full-data retrain, with retrain on. 0: the epochs the fine-tune
                recommends.
            prompts: Prompts of the evaluation grid (one row each, fixed seeds), as a JSON list of strings.
            mlflow_experiment: MLflow experiment the runs are logged under. Where KFP's MLflow integration is on,
                the experiment it names the pods ($MLFLOW_EXPERIMENT_ID) wins.
            mlflow_ui_url: The MLflow UI's address as your browser opens it (e.g. https://mlflow.example.org), which
                the run's MLflow links point at (register-model's result). Empty: the tracking URI the pods log to,
                which a browser outside the cluster cannot open when it is a Service's name (mlflow.mlflow.svc).
            base_config: Every other setting, as the JSON of a rangefinder config (`rangefinder compile --config`
                fills it in, and sets the other parameters' defaults to its values). The other parameters override
                it, each at its default too (the form sends every one): give those whose field base_config sets
                otherwise the value it sets (resolve-config warns of each it replaced).
        """
        status = step(c.record_status(mlflow_experiment=mlflow_experiment,
                                      pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                                      pipeline_job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER), "record_status",
                      "record-final-status-in-mlflow")
        with dsl.ExitHandler(status, name="run-and-record"):
            resolved = step(c.resolve_config(
                base_config=base_config, dataset_dir=dataset_dir, base_model=base_model,
                base_model_revision=base_model_revision, method=method, lr_finder=lr_finder,
                resolution=resolution, batch_size=batch_size, grad_accum=grad_accum, ramp=ramp, lr_min=lr_min,
                lr_max=lr_max, range_test_epochs=range_test_epochs, finetune_epochs=finetune_epochs,
                val_split=val_split, split_seed=split_seed, seed=seed, fixed_lr=fixed_lr, retrain=retrain,
                retrain_epochs=retrain_epochs, prompts=prompts, mlflow_experiment=mlflow_experiment,
                mlflow_ui_url=mlflow_ui_url, pipeline_job_id=dsl.PIPELINE_JOB_ID_PLACEHOLDER,
                pipeline_job_name=dsl.PIPELINE_JOB_NAME_PLACEHOLDER, dataset_uri=dataset_uri,
            ), "resolve_config")
            config_json = resolved.outputs["config_json"]
            rest = dict(fixed_lr=resolved.outputs["fixed_lr"], lr_finder=resolved.outputs["lr_finder"],
                        retrain=resolved.outputs["retrain"],
                        mlflow_parent_run_id=resolved.outputs["mlflow_parent_run_id"])
            with dsl.If(dataset_uri != "", name="import-dataset"):
                imported = dsl.importer(artifact_uri=dataset_uri, artifact_class=dsl.Dataset, reimport=False)
                # After resolve-config (the branches read its config_json), whose check of the URI is then the run's
                # one line for a path or a password typed there.
                imported.set_display_name("dataset-importer")
                prepared = step(c.prepare_dataset(config_json=config_json, dataset=imported.output),
                                "prepare_dataset")
                train_and_evaluate(config_json=config_json, split=prepared.outputs["split"], **rest)
            with dsl.Else(name="dataset-folder"):
                prepared = step(c.prepare_dataset(config_json=config_json), "prepare_dataset")
                # Named as the other branch's: KFP names a second call of one sub-pipeline "train-and-evaluate-2",
                # which is what the UI's graph showed for this, the usual branch.
                train_and_evaluate(config_json=config_json, split=prepared.outputs["split"],
                                   **rest).set_display_name("train-and-evaluate")

    return rangefinder_finetune


def compile_pipeline(cfg: Optional[RangefinderConfig], package_path: str) -> str:
    """Write the IR YAML of the pipeline built from `cfg`; returns the path.

    The package is read back before it is handed on: one that carries a URL with credentials in it (the config
    refuses those when it is read; this catches any other way in) is removed and refused, since anyone who can
    see the pipeline in Kubeflow can read its YAML.
    """
    from kfp import compiler

    from rangefinder.errors import ConfigError
    from rangefinder.formats.atomic import atomic_path, sweep_dead_writers
    from rangefinder.tracking.redaction import CREDENTIALS_FIX, url_with_credentials

    if cfg is not None:
        from rangefinder.training.families import check_pipeline_settings
        from rangefinder.training.optimizers import check_optimizer

        check_pipeline_settings(cfg)  # with resolve-config's preflight, where the base model is here to read
        if cfg.distributed.num_nodes > 1 and not cfg.kubernetes.data_pvc:
            raise ConfigError("distributed.num_nodes > 1 needs kubernetes.data_pvc: the nodes share the run's data, "
                              "caches and outputs through it (a ReadWriteMany volume)")
        # The training pods are the machines that train: without a GPU, every training step would fail on the cluster.
        check_optimizer(cfg.training, cfg.kubernetes.gpu_count > 0, instead="kubernetes.gpu_count is 0: give the "
                        "training pods a GPU (kubernetes.gpu_count), or choose training.optimizer: adamw")

    # Written beside and renamed when whole and checked (kfp writes where it is told: a full disk or a Ctrl-C
    # part-way left a truncated package in place of the one there before); the suffix tells kfp the format.
    pipeline = build_pipeline(cfg)
    sweep_dead_writers(package_path)  # what a compile killed part-way left beside the package, which stayed for ever
    with atomic_path(package_path, suffix=Path(package_path).suffix) as tmp:
        compiler.Compiler().compile(pipeline, package_path=str(tmp))
        _header_on_comment_lines(pipeline, str(tmp))
        leaked = url_with_credentials(tmp.read_text(encoding="utf-8"))
        if leaked:  # the temporary file is removed as the block raises
            raise ConfigError(f"the compiled pipeline would carry credentials in the URL {leaked}; remove them from "
                              f"the config and {CREDENTIALS_FIX}")
    return package_path


def _header_on_comment_lines(pipeline, package_path: str) -> None:
    """The package's header comment written again with each string parameter's default printable (formats.text's
    escapes): KFP writes a default into it as it is (kfp 2.14, pipeline_spec_builder.extract_comments_from_pipeline_
    spec), so a line break in one (a U+2028 in a prompt pasted from a web page, which the base config's JSON keeps,
    a newline in a folder's name) ended the comment, and the rest of the value was read as YAML: the package did not
    load, in the Kubeflow UI or anywhere. The spec below the header keeps every value whole."""
    from google.protobuf import json_format  # type: ignore[import-untyped]  # no stubs in the pinned set
    from kfp.compiler.pipeline_spec_builder import extract_comments_from_pipeline_spec

    from rangefinder.formats.atomic import write_text
    from rangefinder.formats.text import printable

    spec = json_format.MessageToDict(pipeline.pipeline_spec)
    written = extract_comments_from_pipeline_spec(spec, pipeline.description)
    for param in spec["root"].get("inputDefinitions", {}).get("parameters", {}).values():
        if isinstance(param.get("defaultValue"), str):
            param["defaultValue"] = printable(param["defaultValue"])
    header = extract_comments_from_pipeline_spec(spec, pipeline.description)
    # Read as written: a universal-newline read makes a default's carriage return a newline, the header no longer
    # matches what KFP wrote, and the package was left with the raw break.
    with open(package_path, encoding="utf-8", newline="") as f:
        text = f.read()
    if header != written and text.startswith(written):
        write_text(package_path, header + text[len(written):])
