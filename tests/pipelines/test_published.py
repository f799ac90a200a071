"""The published files (components/, pipelines/): what the code compiles to, loadable, described, deterministic."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from kfp import components

from rangefinder.pipelines import publish
from rangefinder.pipelines.pipeline import PIPELINE_NAME

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def fresh() -> list[publish.Published]:
    return publish.published_files()


def test_the_committed_files_are_what_the_code_compiles_to(fresh):
    stale = publish.stale_files(REPO, fresh)
    assert not stale, f"{', '.join(stale)} differ from what the code compiles to: run `make components` and commit"
    # Every component is published, and every published folder checked: a step left out of publish.STEPS kept its
    # committed files, stale, with the check passing.
    from kfp.dsl.base_component import BaseComponent

    from rangefinder.pipelines import kfp_components

    defined = {name for name, value in vars(kfp_components).items() if isinstance(value, BaseComponent)}
    checked = {f.path.split("/")[1] for f in fresh if f.path.startswith("components/")}
    committed = {p.name for p in (REPO / "components").iterdir() if p.is_dir()}
    assert defined == checked == committed


def test_a_compile_under_image_overrides_writes_the_same_files(fresh, monkeypatch):
    # The published names are the release's; a developer's registry or image override must not leak into them.
    monkeypatch.setenv("RANGEFINDER_REGISTRY", "registry.example.com/mine")
    monkeypatch.setenv("RANGEFINDER_IMAGE", "registry.example.com/mine/trainer:dev")
    monkeypatch.setenv("RANGEFINDER_CPU_IMAGE", "registry.example.com/mine/cpu:dev")
    assert [(f.path, f.text) for f in publish.published_files()] == [(f.path, f.text) for f in fresh]


def test_check_names_each_differing_file_and_the_fix(fresh, tmp_path, capsys, monkeypatch):
    assert publish.main(["--check", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "components/lr_range_test/component.yaml differs" in err and "run `make components`" in err
    # The files the code compiles to, as the call above compiled them: a compile gives the same files every time
    # (test_a_compile_under_image_overrides_writes_the_same_files compiles them again), so the write and the check
    # after it read the module's compile instead of making two more.
    monkeypatch.setattr(publish, "published_files", lambda: fresh)
    assert publish.main([str(tmp_path)]) == 0
    assert publish.main(["--check", str(tmp_path)]) == 0


@pytest.mark.parametrize("step", publish.STEPS)
def test_each_component_file_loads_and_describes_every_input_and_output(step):
    path = REPO / "components" / step / "component.yaml"
    loaded = components.load_component_from_file(str(path))
    spec = loaded.component_spec
    original = publish.component(step).component_spec
    assert spec.name == step.replace("_", "-")
    assert set(spec.inputs or {}) == set(original.inputs or {})
    assert set(spec.outputs or {}) == set(original.outputs or {})
    # KFP 2.17 leaves the descriptions out of the in-memory spec it reads back (structures.InputSpec
    # .from_ir_component_inputs_dict), so a pipeline that uses the loaded component compiles without them; they are
    # read from the file's IR, which the loaded component keeps.
    ir = loaded.pipeline_spec.components[f"comp-{spec.name}"]
    described = {}
    for definitions in (ir.input_definitions, ir.output_definitions):
        for name, p in [*definitions.parameters.items(), *definitions.artifacts.items()]:
            described[name] = p.description
    assert set(described) == set(spec.inputs or {}) | set(spec.outputs or {})
    undescribed = [n for n, d in described.items() if not d]
    assert not undescribed, f"{step}: no description for {undescribed}"
    readme = (REPO / "components" / step / "README.md").read_text()
    for name in described:
        assert f"| `{name}` |" in readme
    assert f'load_component_from_file("components/{step}/component.yaml")' in readme


@pytest.mark.parametrize("step", publish.STEPS)
def test_each_component_readme_says_kfp_local_runs_it(step):
    # test_reuse.py runs two loaded component.yaml files under kfp.local to the end, and components/README.md says
    # so; a component's own README once said kfp.local could not run it, and sent the reader to the page saying the
    # opposite.
    readme = (REPO / "components" / step / "README.md").read_text()
    assert "cannot run" not in readme
    assert "kfp.local runs it too, in a subprocess of the local Python, which must hold the `rangefinder` package" \
        in readme
    assert "it runs under `kfp.local` to the end" in (REPO / "components" / "README.md").read_text()


@pytest.mark.parametrize("step", [s for s in publish.STEPS if "mlflow_parent_run_id" in
                                  (publish.component(s).component_spec.inputs or {})])
def test_a_loaded_component_needs_no_mlflow_parent_run(step):
    # Outside rangefinder's own pipeline there is no resolve-config to hand one on: the input is optional, its
    # default the empty string the step reads as "none", so a user's pipeline leaves it out.
    path = REPO / "components" / step / "component.yaml"
    loaded = components.load_component_from_file(str(path))
    spec = loaded.component_spec.inputs["mlflow_parent_run_id"]
    assert spec.optional and spec.default == ""
    ir = loaded.pipeline_spec.components[f"comp-{loaded.component_spec.name}"].input_definitions
    assert ir.parameters["mlflow_parent_run_id"].is_optional
    assert ir.parameters["mlflow_parent_run_id"].default_value.string_value == ""
    assert "| `mlflow_parent_run_id` | String | `''` |" in (REPO / "components" / step / "README.md").read_text()


@pytest.mark.parametrize("folder", [f"components/{s}" for s in publish.STEPS] + ["pipelines"])
def test_metadata_has_the_fields_pipelines_components_checks(folder):
    # kubeflow/pipelines-components, scripts/validate_metadata/validate_metadata.py: these required fields in this
    # order, optional tags/ci/links, a known stability, dependencies with name and version, a YYYY-MM-DDT00:00:00Z
    # lastVerified.
    meta = yaml.safe_load((REPO / folder / "metadata.yaml").read_text())
    required = [k for k in meta if k not in ("tags", "ci", "links")]
    assert required == ["name", "stability", "dependencies", "lastVerified"]
    assert meta["stability"] in ("experimental", "alpha", "beta", "stable")
    assert set(meta["dependencies"]) <= {"kubeflow", "external_services"}
    for deps in meta["dependencies"].values():
        assert all(set(d) == {"name", "version"} for d in deps)
    assert {"name": "Pipelines", "version": publish.KFP_VERSION} in meta["dependencies"]["kubeflow"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT00:00:00Z", str(meta["lastVerified"]).replace("+00:00", "Z")
                        .replace(" 00:00:00", "T00:00:00")), meta["lastVerified"]


def test_the_pipeline_file_loads_with_its_defaults_and_run_settings():
    package = REPO / "pipelines" / f"{PIPELINE_NAME}.yaml"
    docs = list(yaml.safe_load_all(package.read_text()))
    assert docs[0]["pipelineInfo"]["name"] == PIPELINE_NAME
    params = docs[0]["root"]["inputDefinitions"]["parameters"]
    assert params["method"]["defaultValue"] == "full" and all(p.get("description") for p in params.values())
    assert docs[1]["platforms"]["kubernetes"]["pipelineConfig"] == {"resourceTtlOnCompletion": 7 * 24 * 3600}
    assert "ghcr.io/rangefinder/rangefinder-trainer:" in package.read_text()


@pytest.mark.parametrize("readme", ["pipelines/README.md", "components/resolve_config/README.md"])
def test_a_list_parameter_s_default_and_description_are_what_the_run_form_takes(readme):
    """The Kubeflow UI's run form takes a LIST parameter as JSON: the README showed the prompts' default in YAML's
    flow style, [a red circle on a blue background, ...], which the form refuses when pasted, and the description
    did not say the value is a JSON list."""
    import json

    from rangefinder.config import RangefinderConfig

    (row,) = [ln for ln in (REPO / readme).read_text().splitlines() if ln.startswith("| `prompts` |")]
    cells = [c.strip() for c in row.strip("|").split(" | ")]
    assert cells[1] in ("LIST", "List"), row
    assert json.loads(cells[2].strip("`")) == RangefinderConfig().sampling.prompts, row
    assert "JSON list" in cells[3], row


@pytest.mark.parametrize("step", publish.STEPS)
def test_each_component_readme_s_example_compiles_into_a_pipeline_that_runs_the_step(step, tmp_path, monkeypatch):
    """The README's example, as a user pastes it from the repository root: it loads the component and runs it in a
    pipeline with every input it needs, and KFP's compiler takes it. The READMEs showed only the load, so which inputs
    a call needs, and how an artifact input is handed in, was to be worked out from the tables."""
    from kfp import compiler

    readme = (REPO / "components" / step / "README.md").read_text()
    (code,) = re.findall(r"```python\n(.*?)```", readme, flags=re.S)
    monkeypatch.chdir(REPO)
    namespace: dict = {}
    # dont_inherit: not this module's `from __future__ import annotations`, which a user's file does not have and under
    # which KFP reads the pipeline's annotations as strings.
    exec(compile(code, f"components/{step}/README.md", "exec", dont_inherit=True), namespace)  # noqa: S102
    package = tmp_path / "example.yaml"
    compiler.Compiler().compile(namespace[f"{step}_example"], package_path=str(package))
    spec = yaml.safe_load(package.read_text())
    executors = {e["container"]["args"][-1] for e in spec["deploymentSpec"]["executors"].values() if "container" in e}
    assert step in executors, executors


@pytest.mark.parametrize("step", publish.STEPS)
def test_each_component_readme_lists_its_outputs_or_says_it_has_none(step):
    """record-status's README showed an Outputs table of headers alone, which reads as outputs left out."""
    readme = (REPO / "components" / step / "README.md").read_text()
    section = readme.split("## Outputs\n\n", 1)[1].split("\n\n", 1)[0]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    outputs = component_outputs(step)
    assert [ln.split("`")[1] for ln in rows] == outputs, section
    assert outputs or section.startswith("None: "), section


def component_outputs(step: str) -> list[str]:
    return list(publish.component(step).component_spec.outputs or {})
