"""Run the whole pipeline on this machine through `kfp.local` (SubprocessRunner, no containers).

The same compiled DAG as on a cluster runs step by step in subprocesses of this Python (the `rangefinder` package is
installed here, so `use_venv=False`). GPU and Kubernetes settings have no meaning locally and kfp.local ignores them.
Everything lands under one output folder: the pipeline root (every step's artifacts), the MLflow store
`sqlite:///<out>/mlflow.db` unless `MLFLOW_TRACKING_URI` is set, and `<out>/mlflow-spool/` with what a step could not
log to an MLflow server that stopped answering (`rangefinder relog` logs it later). What kfp.local prints (step
logs, inputs, outputs) passes through `redact` on its way to the terminal or `pipeline.log`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Optional

from rangefinder.config import RangefinderConfig
from rangefinder.data.dataset import check_out_outside_dataset
from rangefinder.errors import QUICK_EXIT_ENV, STEP_ERROR_PREFIX, ConfigError, RangefinderError, public_name
from rangefinder.formats.atomic import atomic_dir, usable_folder, write_json
from rangefinder.formats.digest import file_sha256
from rangefinder.launch.processes import THREADS_ENV
from rangefinder.pipelines.component_support import ONLY_WRITES, step_write_problem
from rangefinder.pipelines.progress import StepProgress, step_name
from rangefinder.tracking.redaction import RedactingWriter, redact, safe_uri
from rangefinder.tracking.spool import SPOOL_ENV
from rangefinder.tracking.target import ui_link
from rangefinder.training.disk import AGAIN_ENV, disk_problem
from rangefinder.training.outdir import OutDirLock


@dataclass
class LocalRun:
    out_dir: Path
    run_dir: Path  # the pipeline root folder of this run: one sub-folder per task
    tracking_uri: str
    experiment_id: Optional[str] = None  # the MLflow experiment the steps logged to; None when MLflow did not answer
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)  # task name -> output parameters
    artifacts: dict[str, dict[str, str]] = field(default_factory=dict)  # task name -> output name -> path
    reports: list[Path] = field(default_factory=list)  # copies under OUT/reports/, named to open in a browser
    # What OUT/reports/ held that an earlier run did not write there (a user's file; a report changed since), kept
    reports_kept: list[Path] = field(default_factory=list)
    log: Optional[Path] = None  # OUT/pipeline.log when this run's steps logged there (not with --verbose)
    earlier_runs: Optional[str] = None  # where the earlier runs' folders beside run_dir are, their size (earlier_runs)
    ui_url: Optional[str] = None  # the MLflow UI's address as the browser opens it (tracking.ui_url), for the link

    def task(self, prefix: str) -> Optional[str]:
        """The task whose name starts with `prefix` and that really ran (kfp.local suffixes repeated names)."""
        names = sorted(n for n in self.outputs if n == prefix or n.startswith(prefix + "-"))
        return names[-1] if names else None

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        lr_task = self.task("choose-lr")
        if lr_task:
            lr = self.outputs[lr_task]
            out.update(lr_source=lr.get("source"), lr_low=lr.get("lr_low"), lr_high=lr.get("lr_high"),
                       lr_mid=lr.get("lr_mid"))
        ft = self.task("finetune")
        if ft:
            out.update(recommended_epochs=self.outputs[ft].get("recommended_epochs"),
                       recommended_updates=self.outputs[ft].get("recommended_updates"),
                       still_improving=self.outputs[ft].get("still_improving"),
                       lr_used=self.outputs[ft].get("lr_used"),
                       halving_kept=self.outputs[ft].get("halving_kept") or None)
            if self.outputs[ft].get("chosen_update"):  # the kept checkpoint: the model registered without retrain
                out.update(chosen_update=self.outputs[ft]["chosen_update"],
                           chosen_epoch=self.outputs[ft].get("chosen_epoch"),
                           chosen_rule=self.outputs[ft].get("chosen_rule") or None)
            out["mixed_precision"] = self.outputs[ft].get("mixed_precision")
        rt = self.task("retrain-full")
        if rt:
            out["retrained_epochs"] = self.outputs[rt].get("epochs")
        for score, by_column in self.prompt_scores().items():
            out[f"prompt_{score}"] = by_column
        reg = self.task("register-model")
        if reg:
            out["registered_model"] = self.outputs[reg].get("model_uri")
        out["reports"] = [str(p) for p in self.reports]
        if self.reports_kept:
            out["reports_kept"] = [f"{p} (not written by this run; left as it was)" for p in self.reports_kept]
        out["pipeline_root"] = str(self.run_dir)
        if self.earlier_runs:
            out["earlier_runs"] = self.earlier_runs
        if self.log is not None and self.log.is_file():  # an earlier run's log is not this run's
            out["log"] = str(self.log)
        out["mlflow"] = safe_uri(self.tracking_uri)
        if self.experiment_id is not None:
            # The UI lands on its GenAI view otherwise; this link opens the runs table (tracking.target.ui_link).
            command, link = ui_link(self.tracking_uri, self.experiment_id, self.ui_url)
            if command:
                out["mlflow_ui"] = command
            out["mlflow_link"] = link
        spools = unlogged_spools(self.out_dir)
        if spools:
            # A step's warning says this too, in the log; the table is what a person reads.
            out["mlflow_not_logged"] = [f"{p} (when MLflow answers: rangefinder relog {p})" for p in spools]
        return out

    def prompt_scores(self) -> dict[str, dict[str, float]]:
        """How well each column of the sample grid follows the prompts (data.prompt_score), as the grid's report
        shows it: {"colour": {"base": ..., "chosen": ..., "final": ...}, "shape": {...}}; empty when the grid did
        not run or its prompts are not the synthetic data's."""
        from rangefinder.steps.sample_images import column_slug

        task = self.task("sample-images")
        manifest = next((Path(p) / "grid.json" for p in self.artifacts.get(task or "", {}).values()
                         if (Path(p) / "grid.json").is_file()), None)
        if manifest is None:
            return {}
        scores = json.loads(manifest.read_text()).get("scores") or []
        return {k: {column_slug(s["column"]): round(float(s[k]), 3) for s in scores} for k in ("colour", "shape")
                if scores}


def unlogged_spools(out_dir: Path) -> list[Path]:
    """The spools steps of a local run left under OUT/mlflow-spool: what MLflow did not take."""
    return sorted((Path(out_dir) / "mlflow-spool").glob("*.jsonl"))


def local_tracking_uri(out_dir: Path) -> str:
    """$MLFLOW_TRACKING_URI (refused when it holds credentials), else a SQLite store inside the output folder."""
    from rangefinder.tracking.target import env_tracking_uri, sqlite_uri

    return env_tracking_uri() or sqlite_uri((out_dir / "mlflow.db").resolve(), "--out")


def check_environment_paths(cfg: Optional[RangefinderConfig] = None, out: Optional[Path] = None) -> None:
    """ConfigError for a folder the run will read from the environment ($RANGEFINDER_CACHE, $RANGEFINDER_MLFLOW_SPOOL,
    $RANGEFINDER_WORK, a sqlite MLFLOW_TRACKING_URI) or from `cfg`'s settings the config's checks leave alone
    (training.cache_dir, a sqlite tracking.tracking_uri), where it begins with the home folder of a user this machine
    does not have, and TrackingError for a MLFLOW_TRACKING_URI holding credentials or a MLFLOW_EXPERIMENT_NAME MLflow
    refuses: said before anything is written
    (the demo's dataset and model, --out's lock and pipeline root), where each reader's own check came after them, or
    in a step. With `out`, the run's output folder, TrackingError too where the store in it has no sqlite:/// URI
    (local_tracking_uri)."""
    from rangefinder.config import expand_home
    from rangefinder.models.tiny import default_cache_dir
    from rangefinder.steps.workdir import work_dir
    from rangefinder.tracking.spool import spool_dir
    from rangefinder.tracking.target import env_tracking_uri, resolve_experiment_name, sqlite_path

    default_cache_dir()
    resolve_experiment_name(cfg)  # $MLFLOW_EXPERIMENT_NAME, which MLflow may refuse
    spool_dir()
    work_dir(Path(), "check")  # its key is any: the variable alone is read
    setting = cfg.tracking.tracking_uri if cfg is not None else None
    uri = setting or env_tracking_uri()
    if uri:
        sqlite_path(uri, "tracking.tracking_uri" if setting else "$MLFLOW_TRACKING_URI")
    elif out is not None:
        local_tracking_uri(out)
    if cfg is not None and cfg.training.cache_dir:
        expand_home(cfg.training.cache_dir, "training.cache_dir")


def run_pipeline_locally(cfg: RangefinderConfig, out_dir: str | Path, *, dataset_uri: str = "",
                         quiet: bool = False) -> LocalRun:
    """Run the pipeline for `cfg` with kfp.local; raise RangefinderError naming the failed step."""
    from rangefinder.training.families import check_pipeline_settings

    check_pipeline_settings(cfg)  # with resolve-config's preflight, before kfp.local starts a step
    check_environment_paths(cfg, Path(out_dir).resolve())
    if cfg.distributed.num_nodes > 1:
        raise ConfigError(
            f"distributed.num_nodes is {cfg.distributed.num_nodes}, but a local run (kfp.local) is single-node: set "
            "num_nodes: 1 here (training.processes_per_node still uses every GPU of this machine), or submit the run "
            "to a cluster with Kubeflow Trainer (`rangefinder submit`)"
        )
    if cfg.training.optimizer == "adamw8bit":  # else the steps fail one by one at the first training, a log later
        import torch

        from rangefinder.training.optimizers import check_optimizer

        check_optimizer(cfg.training, torch.cuda.is_available())
    from kfp import local

    from rangefinder.pipelines.pipeline import PIPELINE_NAME, build_pipeline
    from rangefinder.steps.resolve_config import parameters_from_config

    out = Path(out_dir).resolve()
    data = Path(cfg.data.dataset_dir).expanduser().resolve() if cfg.data.dataset_dir and not dataset_uri else None
    # The validation folder chosen by hand too: its next scan would read the outputs as validation images.
    for folder, setting in ((data, "data.dataset_dir"), (cfg.split.val_dir, "split.val_dir")):
        if folder is not None:
            check_out_outside_dataset(out, folder, flag="--out", setting=setting,
                                      outputs="sample grids, MLflow's artifacts")
    usable_folder(out / "reports", "--out's reports folder")  # now, not once every step has run (_publish_reports)
    tracking_uri = cfg.tracking.tracking_uri or local_tracking_uri(out)
    # One run at a time in --out, taken at its first write: two at once shared pipeline.log and reports/, and each
    # printed the reports the other replaced as its own. Held until this returns (released with the frame when it
    # raises).
    lock = OutDirLock(out)
    root = out / "pipeline-root"
    root.mkdir(parents=True, exist_ok=True)

    before = {p.name for p in root.iterdir()}
    _end_abandoned_runs(tracking_uri, cfg, {name for name in before if name.startswith(PIPELINE_NAME)})
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
    # No pod settings: kfp.local would rerun a failed step on retries, and hand the cluster's environment
    # (data-volume paths, MLflow URI) to the steps.
    pipeline = build_pipeline(cfg, local=True)
    # The steps run in subprocesses that inherit this environment; the caller's is put back afterwards.
    # torch on one CPU thread per step unless the caller says otherwise: the same numbers whatever the core count,
    # and beside another busy process the tiny model's update took 3.7x longer on torch's 2 threads than on 1 (alone,
    # 2 threads were 1.4x faster; bench/RESULTS.md, "Threads of a local run").
    step_env = local_step_env(out, tracking_uri)
    saved = {name: os.environ.get(name) for name in step_env}
    os.environ.update(step_env)
    log_path = out / "pipeline.log"
    log_start = log_path.stat().st_size if log_path.is_file() else 0  # this run's part of an appended log
    run_log = RunLog(log_path) if quiet else None
    if quiet:
        print(f"rangefinder: running the pipeline with kfp.local; step logs in {log_path}", file=sys.stderr)
    try:
        # kfp.local prints every step's log and outputs on stdout; they go to the log file with `quiet`, else to
        # stderr (--verbose), so stdout holds only the result, a --json one too. Either way they pass through
        # redact(). With `quiet`, StepProgress also shows on the terminal a line per step and the training bars.
        with run_log if run_log is not None else contextlib.nullcontext(sys.stderr) as log, \
                _progress(log, quiet) as shown, \
                contextlib.redirect_stdout(RedactingWriter(shown)) as redacted, warnings.catch_warnings():
            try:
                # Known and meant: the pod settings and the image do nothing here (this environment has the package).
                warnings.filterwarnings("ignore", message=r"Task .* have no effect in the current local runner")
                warnings.filterwarnings("ignore", message=r"You may be attemping to run a task that uses custom")
                pipeline(**parameters_from_config(cfg, dataset_uri=dataset_uri))
            finally:
                redacted.flush()
    except KeyboardInterrupt:
        # Ctrl-C: kfp.local stops and the exit handler (record-status) never runs, so nothing else would end the
        # MLflow parent run: it would stay RUNNING in the store for good.
        started = _new_runs(root, before, PIPELINE_NAME)
        if started:
            _end_interrupted_parent(tracking_uri, cfg, started[-1].name)
        raise
    except RuntimeError as e:
        if run_log is not None:
            # A log cut short names no step's error: the disk it could not be written to does.
            run_log.check(out, root, "stopped")
        # kfp.local names a failed task, not always the first to fail, and by its outer name (register-model-2 for the
        # log's register-model-2-2); the log says which failed first and why.
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
        m = re.search(r"Inner task failed: '([^']+)'", text)
        log_hint = f"full log: {log_path}" if quiet else "its error is in the log above"
        where = redact(text)
        if m:
            where = (failure_summary(_read_from(log_path, log_start), m.group(1), root) if quiet
                     else f"step {step_name(m.group(1))} failed")
        raise RangefinderError(f"the local pipeline run stopped: {where} ({log_hint}; artifacts so far under {root})"
                               ) from None
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    if run_log is not None:
        run_log.check(out, root, "ran to its end, but its log is cut short")
    new = _new_runs(root, before, PIPELINE_NAME)
    if not new:
        raise RangefinderError(f"kfp.local wrote no run folder under {root}")
    run = LocalRun(out_dir=out, run_dir=new[-1], tracking_uri=tracking_uri,
                   experiment_id=_experiment_id(tracking_uri, cfg), log=log_path if quiet else None,
                   earlier_runs=earlier_runs(root, [root / n for n in sorted(before) if n.startswith(PIPELINE_NAME)]),
                   ui_url=cfg.tracking.ui_url)
    _collect(run)
    _publish_reports(run)
    lock.release()
    return run


class RunLog:
    """OUT/pipeline.log as a local run writes it (kfp.local's step logs, through StepProgress), appended to. A write
    the file system refused (a full disk) is kept (`refused`) and the log's later writes are dropped: kfp.local logs
    through Python's logging, which printed a "--- Logging error ---" traceback on the terminal for each line it could
    not write, and a step's streamed line raised out of kfp.local mid-step; `check` says it in one line."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.refused: Optional[OSError] = None
        self._file: Optional[IO[str]] = None

    def __enter__(self) -> RunLog:
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def __exit__(self, *exc: object) -> None:
        self._attempt(lambda f: f.close())

    def write(self, text: str) -> int:
        self._attempt(lambda f: f.write(text))
        return len(text)

    def flush(self) -> None:
        self._attempt(lambda f: f.flush())

    def _attempt(self, act: Callable[[IO[str]], object]) -> None:
        if self._file is None or self.refused is not None:
            return
        try:
            act(self._file)
        except OSError as e:
            self.refused = e
            with contextlib.suppress(OSError):  # what is buffered is lost: the disk took none of it
                self._file.close()
            self._file = None

    def check(self, out: Path, root: Path, ended: str) -> None:
        """RangefinderError naming the disk, its free space and the fix when a write of the log was refused (`ended`:
        how the run ended); the refused write itself when it is no storage problem (a bug)."""
        if self.refused is None:
            return
        problem = disk_problem(f"the local run's log {self.path.name}", out, self.refused, again=LOCAL_AGAIN)
        if problem is None:
            raise self.refused
        raise RangefinderError(f"the local pipeline run {ended}: {problem} (the log holds what was written before; "
                               f"artifacts so far under {root})") from None


# What a step's failed write says to do once space is freed (training.disk.AGAIN_ENV): the steps' own words
# ("then run again with --resume") named a flag `run --local` and `demo` do not take.
LOCAL_AGAIN = "then run the same command again (a local pipeline run starts over, in a new pipeline-root/ run folder)"


def local_step_env(out: Path, tracking_uri: str) -> dict[str, str]:
    """The environment a local run's steps run in, beside the caller's (put back afterwards)."""
    return {"MLFLOW_TRACKING_URI": tracking_uri,
            SPOOL_ENV: os.environ.get(SPOOL_ENV) or str(out / "mlflow-spool"),
            THREADS_ENV: os.environ.get(THREADS_ENV) or "1",
            QUICK_EXIT_ENV: "1",  # errors.one_line_errors: a finished step skips the interpreter's teardown
            AGAIN_ENV: LOCAL_AGAIN}


def earlier_runs(root: Path, folders: list[Path]) -> Optional[str]:
    """Where the earlier runs' folders under `root` (`folders`: each run in --out made one, a stopped or failed run
    too) are and how much they hold; None when there are none. They are kept: nothing reads them again (MLflow holds
    its own copy of what the steps logged, and a local run starts over), but their final/ and checkpoints are a
    user's to keep or remove, and each run of a real model added gigabytes there without a word."""
    folders = [f for f in folders if f.is_dir()]
    if not folders:
        return None
    size = 0
    unread: list[OSError] = []
    for folder in folders:
        # A folder os.walk cannot list (its permissions, a failing disk) was left out of the sum without a word, which
        # then understated what the folders hold; one gone meanwhile holds nothing.
        for parent, _, files in os.walk(folder, onerror=unread.append):
            for name in files:
                try:
                    size += os.lstat(os.path.join(parent, name)).st_size
                except OSError as e:
                    unread.append(e)
    unread = [e for e in unread if not isinstance(e, FileNotFoundError)]
    amount = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    one = len(folders) == 1
    runs, their, they = ("run's folder", "its", "it") if one else ("runs' folders", "their", "they")
    remove = "remove it once you no longer need it" if one else "remove those you no longer need"
    missed = ""
    if unread:
        more = f" and {len(unread) - 1} more" if len(unread) > 1 else ""
        missed = f"; {unread[0].filename}{more} could not be read: {unread[0].strerror}"
        amount = f"at least {amount}"
    return (f"{len(folders)} earlier {runs} under {root}, {amount} in all ({their} final/ and checkpoints; MLflow "
            f"keeps its own copy of what {they} logged{missed}): {remove}")


def _new_runs(root: Path, before: set[str], pipeline_name: str) -> list[Path]:
    """The run folders kfp.local made under `root` since `before` was read, oldest first."""
    return sorted((p for p in root.iterdir() if p.name not in before and p.name.startswith(pipeline_name)),
                  key=lambda p: p.stat().st_mtime)


def _end_interrupted_parent(tracking_uri: str, cfg: RangefinderConfig, run_name: str) -> None:
    """End the MLflow parent run of the kfp.local run `run_name` (its run folder's name, which resolve-config tags
    it with as kfp.run_name) KILLED, as record-status ends a cancelled run on a cluster. Best effort and bounded: a
    run interrupted before resolve-config made its parent has none, and MLflow may not answer."""
    _end_parents(tracking_uri, cfg, {run_name})


# Why an earlier run's MLflow runs were ended by a later one (the parent's rangefinder.error); its final state is not
# known then (rangefinder.final_state UNKNOWN).
ABANDONED = ("left RUNNING by its command (killed outright: SIGKILL, the OOM killer, a machine that lost power; or "
             "MLflow away when it ended); the next local run in the same --out ended it")


def _end_abandoned_runs(tracking_uri: str, cfg: RangefinderConfig, run_names: set[str]) -> None:
    """End KILLED the MLflow runs of this folder's earlier local runs (`run_names`, their run folders) that are still
    RUNNING, with every run still RUNNING under them: a Ctrl-C or SIGTERM ends a run's own, but a command killed
    outright left its parent RUNNING for good (and, where its steps died with it, their runs), as did one whose exit
    handler found MLflow away. The folder's lock, now held, says none of them goes on. Only with a store that is there
    already: a first run reads nothing."""
    store = Path(tracking_uri.removeprefix("sqlite:///")) if tracking_uri.startswith("sqlite:///") else None
    if run_names and (store is None or store.is_file()):
        _end_parents(tracking_uri, cfg, run_names, note=ABANDONED)


def _end_parents(tracking_uri: str, cfg: RangefinderConfig, run_names: set[str], note: Optional[str] = None) -> None:
    """End KILLED the MLflow parent runs of the kfp.local runs `run_names` still RUNNING (final state CANCELED); with
    `note` (why, as the parent's rangefinder.error), also the runs still RUNNING under them, and the final state
    UNKNOWN. Best effort and bounded: MLflow may not answer, and then the runs stay as the store has them."""
    from mlflow import MlflowClient

    from rangefinder.tracking.runs import TAG_CREATED_BY, TAG_KFP_RUN_NAME
    from rangefinder.tracking.target import bound_http_requests, check_tracking_server, sqlite_path

    bound_http_requests()
    try:
        if sqlite_path(tracking_uri) is not None:
            # Opened under its folder's lock: a Ctrl-C in the run's first seconds finds a step making a new store,
            # and a second opening ran MLflow's migrations beside the step's.
            check_tracking_server(tracking_uri)
        client = MlflowClient(tracking_uri=tracking_uri)
        exp_id = _experiment_id(tracking_uri, cfg)
        if exp_id is None:
            return
        running = client.search_runs([exp_id], filter_string="attributes.status = 'RUNNING'", max_results=5000)
        ended = [r.info.run_id for r in running if r.data.tags.get(TAG_KFP_RUN_NAME) in run_names
                 and r.data.tags.get(TAG_CREATED_BY) == "rangefinder"]
        for run_id in ended:
            client.set_tag(run_id, "rangefinder.final_state", "UNKNOWN" if note else "CANCELED")
            if note:
                client.set_tag(run_id, "rangefinder.error", note)
            client.set_terminated(run_id, status="KILLED")
        below = set(ended) if note else set()
        while below:  # the steps' runs, and theirs (the halving candidates, the cooldown)
            under = [r.info.run_id for r in running if r.data.tags.get("mlflow.parentRunId") in below]
            for run_id in under:
                client.set_terminated(run_id, status="KILLED")
            below = set(under)
    except Exception:  # MLflow gone too: the runs stay as the store has them
        return


def _experiment_id(tracking_uri: str, cfg: RangefinderConfig) -> Optional[str]:
    """The id of the experiment the steps logged to ($MLFLOW_EXPERIMENT_ID, else the named one), or None when it
    cannot be read now: the link is a convenience, and the run's results are already in hand."""
    from mlflow import MlflowClient

    from rangefinder.tracking.target import bound_http_requests, resolve_experiment_name

    if os.environ.get("MLFLOW_EXPERIMENT_ID"):
        return os.environ["MLFLOW_EXPERIMENT_ID"]
    bound_http_requests()
    try:
        exp = MlflowClient(tracking_uri=tracking_uri).get_experiment_by_name(resolve_experiment_name(cfg))
    except Exception:  # a server gone since the last step: the summary says what was not logged
        return None
    return exp.experiment_id if exp is not None else None


@contextlib.contextmanager
def _progress(log: Any, quiet: bool) -> Iterator[Any]:
    """The stream kfp.local prints into: with `quiet`, the log file seen through StepProgress (the terminal's view)."""
    if not quiet:
        yield log
        return
    progress = StepProgress(log, sys.stderr)
    try:
        yield progress
    finally:
        progress.close()


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


MAX_CAUSE_LINES = 6
_FAILED = re.compile(r"Task '([^']+)' finished with status FAILURE")


def failure_summary(log: str, named: str, root: Optional[Path] = None) -> str:
    """What ended a run, from this run's kfp.local log: the first step that failed with its own error, and the steps
    that failed after it counted (an MLflow server that went away fails every later step that logs; the same error
    again says nothing new). A later step that failed for another reason keeps its own error. `named`: the task
    kfp.local's exception names, for when the log holds no failure; `root`: the run's pipeline root, where kfp's own
    writes of a step's outputs went (step_error)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log)
    failed = list(dict.fromkeys(_FAILED.findall(text))) or [named]
    first = failed[0]
    cause = step_error(log, first, root)
    said = f"step {step_name(first)} failed{f': {cause}' if cause else ''}"
    later = []
    for task in failed[1:]:
        own = step_error(log, task, root)
        # The same cause: the same error, or one of the two begins with the other (the outage in its own words, then
        # what that step could not do because of it: register-model's command for later).
        same = own is None or (cause is not None and (cause.startswith(own) or own.startswith(cause)))
        later.append(step_name(task) if same else f"{step_name(task)} ({own})")
    if later:
        steps = "step" if len(later) == 1 else "steps"
        said += f"; {len(later)} later {steps} failed too: {', '.join(later)}"
    return said


_STEP_ERROR = re.compile(rf"{STEP_ERROR_PREFIX} [\w-]+: error: (.*\S)")


def step_error(log: str, task: str, root: Optional[Path] = None) -> Optional[str]:
    """The error `task` ended with, from kfp.local's log: the exception line of its last traceback and the lines
    after it (module path dropped: `TrackingError: cannot reach ...`), else its last lines; None if not there. A
    write the file system refused outside the step's function (kfp's executor writing executor_output.json or making
    the outputs' folders under `root`, the run's pipeline root) is said as the steps' own writes say it
    (_refused_write)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", log)
    name = re.escape(task)
    # From kfp's "... Executing task 'x'" line to its "... ERROR - Task 'x' finished with status FAILURE" line.
    sections = re.findall(rf"Executing task '{name}'\n(.*?)\n[^\n]*Task '{name}' finished with status FAILURE",
                          text, re.S)
    if not sections:
        return None
    lines = [line.strip() for line in sections[-1].splitlines() if line.strip()]
    # Bad input ends a step with one line and no traceback (rangefinder.errors.one_line_errors): that line is it, also
    # where it follows a progress bar's last state on the log's line (a bar ends in a carriage return, not a newline:
    # a full disk mid-training was told as the bar's last three lines, the error amid them).
    said = [m.group(1) for m in map(_STEP_ERROR.search, lines) if m]
    if said:
        return said[-1][:2000]
    exception = re.compile(r"^(?:[A-Za-z_][\w]*\.)*([A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit|Failure))(?::\s*|$)")
    for i in range(len(lines) - 1, -1, -1):
        m = exception.match(lines[i])
        if m:
            refused = _refused_write(lines[i], step_name(task), root) if root is not None else None
            if refused:
                return refused
            cause = [m.group(1) + ": " + lines[i][m.end():] if lines[i][m.end():] else m.group(1)]
            cause += lines[i + 1: i + MAX_CAUSE_LINES]
            break
    else:
        cause = lines[-3:]
    return " ".join(cause)[:2000] or None


# An OSError's line in a traceback: "OSError: [Errno 28] No space left on device", with ": '/path'" after it where the
# error named its file (open() on a full disk names none: the file is made, its first write fails).
_OS_ERROR = re.compile(r"^(?:[A-Za-z_]\w*\.)*\w*Error: \[Errno (\d+)\] (.*?)(?:: '(.*)')?$")


def _refused_write(line: str, step: str, root: Path) -> Optional[str]:
    """The one line for a traceback's exception `line` when it is a write the file system refused (a full disk, a
    quota, a read-only volume: what only a write raises, component_support.ONLY_WRITES): kfp's executor writes the
    step's executor_output.json and its outputs' folders outside the step's function, where step_errors does not
    reach, and the run quoted "OSError: [Errno 28] No space left on device", naming neither the disk nor the fix.
    Said as disk_problem says a step's own write, under `root` (or where the error named its file), with the free
    space there now and a local run's words for what to do then; None for any other line."""
    m = _OS_ERROR.match(line)
    if m is None or int(m.group(1)) not in ONLY_WRITES:
        return None
    named = Path(m.group(3)) if m.group(3) else None
    error = OSError(int(m.group(1)), m.group(2), *([str(named)] if named else []))
    problem = step_write_problem(step, root, named, error, again=LOCAL_AGAIN)
    return f"{public_name(problem)}: {problem}" if problem else None


# The artifacts a person reads, by output name; KFP names artifact files after the output, without an extension.
REPORT_OUTPUTS = ("report_html", "report_md", "grid", "decision", "report")


# In OUT/reports/: the files the run that made the folder wrote there, with their sha256 (hidden: not a report).
REPORTS_MANIFEST = ".rangefinder-reports.json"


def _publish_reports(run: LocalRun) -> None:
    """Copy the reports to OUT/reports/<step>[-<output>].<html|md> (lr-range-test-first.html, finetune.md,
    sample-images-grid.html, ...) so they open with a double click and say what they are.

    The folder is this run's: it is filled beside OUT/reports and takes its place whole (formats.atomic.atomic_dir),
    so an earlier run's report this run did not write (its zoom's, say) does not stay beside this run's, and a reader
    sees the earlier folder or this one, never a mix or a half-written file. What the earlier folder held that its
    run did not write there, by its manifest (REPORTS_MANIFEST: a user's file, a report changed since), is carried
    over as it was and named in the summary; a report this run writes replaces the one of the same name."""
    import shutil

    dest = usable_folder(run.out_dir / "reports", "--out's reports folder")
    earlier = _reports_written(dest)
    written: dict[str, str] = {}
    with _reports_refused(run, dest), atomic_dir(dest.resolve() if dest.is_symlink() else dest) as tmp:
        for task in sorted(run.artifacts):
            for key, path in sorted(run.artifacts[task].items()):
                src = Path(path)
                if key not in REPORT_OUTPUTS or not src.is_file():
                    continue
                head = src.read_bytes()[:64].lstrip().lower()
                ext = ".html" if head.startswith((b"<!doctype html", b"<html")) else ".md"
                stem = _step_name(task, run)
                if key not in ("report_html", "report_md"):
                    stem += f"-{key}"
                if stem + ext in written:  # the same step twice (not in today's DAG): keep kfp.local's task name
                    stem = f"{task}-{key}"
                shutil.copyfile(src, tmp / f"{stem}{ext}")
                written[stem + ext] = file_sha256(tmp / f"{stem}{ext}")
        for old in sorted(dest.iterdir()) if dest.is_dir() else ():
            if old.name == REPORTS_MANIFEST or old.name in written:
                continue
            if old.is_file() and not old.is_symlink() and earlier.get(old.name) == file_sha256(old):
                continue  # the earlier run's report, unchanged: not this run's
            _carry(old, tmp / old.name)
            if not old.name.startswith("."):
                run.reports_kept.append(dest / old.name)
        write_json(tmp / REPORTS_MANIFEST, {"files": written})
    run.reports = sorted(dest / name for name in written)


@contextlib.contextmanager
def _reports_refused(run: LocalRun, dest: Path) -> Iterator[None]:
    """The reports' copy into OUT/reports refused by the file system (a full disk) in one line that says the
    pipeline ran to its end and where its reports are meanwhile: it was "cannot write OUT/reports: disk full", which
    read as a run that failed and named no way to the reports it had made."""
    try:
        yield
    except OSError as e:
        problem = disk_problem("the run's reports", dest, e,
                               again=f"then run the same command again; meanwhile they are in the run's folder "
                                     f"{run.run_dir}")
        if problem is None:
            raise
        raise RangefinderError(f"the local pipeline run ran to its end, but {problem}") from None


def _reports_written(folder: Path) -> dict[str, str]:
    """The files the run that made `folder` wrote there, name -> sha256, by its manifest; none without one (a folder
    from before the manifest, or one unreadable): then everything in it is kept."""
    try:
        files = json.loads((folder / REPORTS_MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {str(k): str(v) for k, v in files.items()} if isinstance(files, dict) else {}


def _carry(src: Path, dst: Path) -> None:
    """`src` at `dst` as well, a folder whole: hard links where the file system allows (no second copy of the bytes),
    else copies; a symbolic link as a link."""
    import shutil

    def link_or_copy(a: str, b: str) -> None:
        try:
            os.link(a, b)
        except OSError:
            shutil.copy2(a, b)

    if src.is_symlink():
        os.symlink(os.readlink(src), dst)
    elif src.is_dir():
        shutil.copytree(src, dst, symlinks=True, copy_function=link_or_copy)
    else:
        link_or_copy(str(src), str(dst))


def _step_name(task: str, run: LocalRun) -> str:
    """kfp.local's task folder without the suffixes it adds inside sub-DAGs (lr-range-test-2-2 -> lr-range-test).
    The range tests are told apart by what they output: the first asks for the zoom, the zoom never asks again."""
    step = step_name(task)
    if step == "lr-range-test":
        tests = [t for t in run.artifacts if step_name(t) == step]
        is_zoom = len(tests) > 1 and not run.outputs.get(task, {}).get("needs_zoom")
        step += "-zoom" if is_zoom else "-first"
    return step


def _collect(run: LocalRun) -> None:
    """Read every task's executor output: parameters, and the paths of its output artifacts."""
    for eo in run.run_dir.rglob("executor_output.json"):
        task = eo.parent.name
        try:
            data = json.loads(eo.read_text())
        except (OSError, json.JSONDecodeError):
            continue
        run.outputs[task] = dict(data.get("parameterValues", {}))
        arts: dict[str, str] = {}
        for name in eo.parent.iterdir():
            if name.name != "executor_output.json":
                arts[name.name] = str(name)
        run.artifacts[task] = arts
