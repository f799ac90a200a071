"""The Dockerfiles: hadolint-clean, and built the way the issue asks (read, not built: no Docker engine in CI).

hadolint runs once over all of them, next to a canary it must flag. The rest reads each Dockerfile's instructions:
pinned bases, multi-stage with no build tools or pip in the final stage, the pinned constraints used for every
install, torch 2.13.0 from the CUDA index matching the CUDA base, a non-root numeric user, writable caches, and a
.dockerignore that lets in exactly what the builds copy.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

from tests.manifests.manifest_support import REPO, find_tool

DOCKERFILES = sorted((REPO / "images").glob("Dockerfile.*"))
CANARY = "FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp && pip install requests\n"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, arguments)

    def args_of(self, instruction: str) -> list[str]:
        return [a for i, a in self.instructions if i == instruction]


def parse(path) -> list[Stage]:
    """Instructions per stage, continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))
    stages: list[Stage] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        instruction, _, args = line.strip().partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            parts = args.split()
            stages.append(Stage(parts[0], parts[2] if len(parts) > 2 and parts[1].upper() == "AS" else None))
        elif stages:
            stages[-1].instructions.append((instruction, args.strip()))
    return stages


def test_the_three_images_are_there():
    assert [p.name for p in DOCKERFILES] == ["Dockerfile.cpu", "Dockerfile.mlflow", "Dockerfile.trainer"]


# ---------------------------------------------------------------------------------------------------------------
# hadolint


@pytest.fixture(scope="module")
def hadolint_findings(tmp_path_factory) -> dict[str, list[dict]]:
    tool = find_tool("hadolint")
    canary = tmp_path_factory.mktemp("hadolint") / "Dockerfile.canary"
    canary.write_text(CANARY)
    proc = subprocess.run([tool, "--format", "json", "--no-fail", *map(str, DOCKERFILES), str(canary)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    findings: dict[str, list[dict]] = {}
    for f in json.loads(proc.stdout):
        findings.setdefault(f["file"], []).append(f)
    return {"canary": findings.get(str(canary), []),
            **{p.name: findings.get(str(p), []) for p in DOCKERFILES}}


@pytest.mark.parametrize("dockerfile", [p.name for p in DOCKERFILES])
def test_hadolint_passes(hadolint_findings, dockerfile):
    problems = [f"line {f['line']}: {f['code']} {f['message']}" for f in hadolint_findings[dockerfile]]
    assert not problems, "\n".join(problems)


def test_hadolint_flags_the_canary(hadolint_findings):
    codes = {f["code"] for f in hadolint_findings["canary"]}
    assert {"DL3007", "DL3008"} <= codes, codes  # `latest` base; unpinned apt package


def test_every_hadolint_ignore_says_why():
    for path in DOCKERFILES:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if "hadolint ignore=" in line:
                j = i
                while j > 0 and lines[j - 1].startswith("#") and "hadolint" not in lines[j - 1]:
                    j -= 1
                reason = " ".join(lines[j:i])
                assert len(reason.split()) > 8, f"{path.name}:{i + 1}: say why above the ignore"


# ---------------------------------------------------------------------------------------------------------------
# How the images are built


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_multi_stage_with_pinned_bases(path):
    stages = parse(path)
    assert len(stages) >= 2, "build in one stage, copy the result into a clean one"
    for stage in stages:
        repo, _, tag = stage.base.partition(":")
        assert tag and tag != "latest" and "$" not in stage.base, f"unpinned base {stage.base}"
    assert stages[0].base == stages[-1].base, "the venv is copied across: same base, same interpreter path"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_final_stage_has_no_build_tools_and_no_pip(path):
    final = parse(path)[-1]
    runs = " ".join(final.args_of("RUN"))
    for tool in ("build-essential", "gcc", "g++", "make ", "git ", "-dev ", "python3.12-venv", "pip install"):
        assert tool not in runs + " ", f"{tool.strip()} in the final stage"
    # pip itself is removed, so no step can install anything at run time.
    assert "uninstall -y pip" in " ".join(parse(path)[0].args_of("RUN"))
    copies = final.args_of("COPY")
    assert any(c.startswith("--from=builder /opt/venv") for c in copies)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_every_install_uses_the_pinned_constraints(path):
    for stage in parse(path):
        for run in stage.args_of("RUN"):
            for command in re.findall(r"pip install[^&;]*", run):
                assert "--no-deps ." in command or "-c constraints.txt" in command, f"unpinned: {command}"


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_runs_as_a_numeric_non_root_user(path):
    final = parse(path)[-1]
    (user,) = final.args_of("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) >= 10000, f"USER {user}: use a numeric uid Kubernetes can check"
    assert f"--uid {uid}" in " ".join(final.args_of("RUN"))


@pytest.mark.parametrize("name", ["Dockerfile.trainer", "Dockerfile.cpu"])
def test_step_images_hold_the_project_and_writable_caches(name):
    stages = parse(REPO / "images" / name)
    builder, final = stages[0], stages[-1]
    builder_runs = " ".join(builder.args_of("RUN"))
    assert "torch==2.13.0" in builder_runs and "pip install --no-deps ." in builder_runs
    # The package (and kfp, from its dependencies) imports in the builder, before anything ships.
    assert "import rangefinder.pipelines.pipeline, kfp, torch" in builder_runs
    assert {"src/ src/"} <= set(builder.args_of("COPY"))
    env = " ".join(final.args_of("ENV"))
    for var in ("HF_HOME=/cache/huggingface", "RANGEFINDER_CACHE=/cache/rangefinder", "PATH=/opt/venv/bin"):
        assert var in env
    assert "chown -R 10001:10001 /work /cache" in " ".join(final.args_of("RUN"))
    assert final.args_of("WORKDIR") == ["/work"]


@pytest.mark.parametrize("name", ["Dockerfile.trainer", "Dockerfile.cpu"])
def test_step_images_carry_the_commit_they_were_built_from(name):
    """The README tags each run with its git revision (`mlflow.source.git.commit`); a step image holds the package
    installed, with no .git to ask, so the tag was missing from every cluster run. The build passes the commit in,
    and the final stage sets the variable tracking.runs.git_revision reads."""
    import inspect

    from rangefinder.tracking import runs

    final = parse(REPO / "images" / name)[-1]
    assert "GIT_REVISION" in " ".join(final.args_of("ARG"))
    assert "RANGEFINDER_GIT_REVISION=${GIT_REVISION}" in " ".join(final.args_of("ENV"))
    assert 'os.environ.get("RANGEFINDER_GIT_REVISION")' in inspect.getsource(runs.git_revision)
    # Every build command the repository shows passes it: make images, images/README.md, the Dockerfile's own
    # header, and the example CI job.
    image = name.split(".")[1]
    shown = [(REPO / "Makefile").read_text(), (REPO / "images" / "README.md").read_text(),
             (REPO / "images" / name).read_text()]
    for text in shown:
        builds = [line for line in re.sub(r"\\\n#?\s*", " ", text).splitlines()
                  if f"docker build -f images/{name} " in line]
        assert builds and all("--build-arg GIT_REVISION=" in b for b in builds), (image, builds)
    assert "build-args: GIT_REVISION=" in (REPO / ".github" / "workflows" / "images.yml").read_text()


def test_the_trainer_cuda_base_matches_the_torch_wheels():
    text = (REPO / "images" / "Dockerfile.trainer").read_text()
    index = re.search(r"ARG TORCH_INDEX_URL=https://download\.pytorch\.org/whl/cu(\d+)(\d)\b", text)
    assert index, "the trainer installs torch from a CUDA wheel index"
    for stage in parse(REPO / "images" / "Dockerfile.trainer"):
        cuda = re.match(r"nvidia/cuda:(\d+)\.(\d+)\.\d+-", stage.base)
        assert cuda and cuda.groups() == index.groups(), f"{stage.base} vs cu{''.join(index.groups())}"


def test_the_project_pins_torch_as_the_images_do():
    constraints = (REPO / "constraints.txt").read_text().split()
    assert "torch==2.13.0" in constraints


# ---------------------------------------------------------------------------------------------------------------
# .dockerignore


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule for our patterns: the last matching line wins; `!` re-includes; a folder covers its contents."""
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        hit = any(fnmatch.fnmatchcase(p, pat) for p in prefixes)
        if pat.startswith("**/"):
            hit = hit or any(fnmatch.fnmatchcase(p, pat[3:]) for p in parts)
        if hit:
            ignored = not negate
    return ignored


def _dockerignore() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def test_dockerignore_lets_in_what_the_builds_copy():
    patterns = _dockerignore()
    for path in DOCKERFILES:
        for stage in parse(path):
            for copy in stage.args_of("COPY"):
                if copy.startswith("--from="):
                    continue
                *sources, _dest = copy.split()
                for src in sources:
                    assert (REPO / src).exists(), f"{path.name} copies {src}, which does not exist"
                    dropped = _ignored(src.rstrip("/"), patterns)
                    assert not dropped, f"{path.name} copies {src}, but .dockerignore drops it"
                    if (REPO / src).is_dir():
                        assert not _ignored(f"{src.rstrip('/')}/config.py", patterns)


@pytest.mark.parametrize("path", [".venv/bin/python", ".venv-tools/bin/checkov", ".git/config", "mlflow.db",
                                  "mlruns/0/meta.yaml", "tests/conftest.py", "src/rangefinder/__pycache__/x.pyc"])
def test_dockerignore_keeps_out_local_state(path):
    assert _ignored(path, _dockerignore())


# ---------------------------------------------------------------------------------------------------------------
# The Python the builds run inline, run here against the real pyproject.toml and torch


def _inline_python(path, marker: str) -> str:
    """The `python -c "..."` program in a RUN instruction that contains `marker`."""
    (code,) = [c for stage in parse(path) for run in stage.args_of("RUN")
               for c in re.findall(r'python -c "((?:[^"\\]|\\.)*)"', run) if marker in c]
    return code


@pytest.mark.parametrize("name, extras", [("Dockerfile.trainer", ["cuda"]), ("Dockerfile.cpu", [])])
def test_the_requirements_the_build_installs_are_the_project_dependencies(name, extras):
    import tomllib

    code = _inline_python(REPO / "images" / name, "import tomllib")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True).stdout
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    expected = project["dependencies"] + [d for e in extras for d in project["optional-dependencies"][e]]
    assert out.splitlines() == expected


def test_the_torch_build_guards_tell_cpu_from_cuda():
    # Here torch is the CPU build: the CPU image's guard passes and the trainer's refuses it.
    cpu_guard = _inline_python(REPO / "images" / "Dockerfile.cpu", "torch.version.cuda is None")
    subprocess.run([sys.executable, "-c", cpu_guard], check=True, capture_output=True)
    trainer_guard = _inline_python(REPO / "images" / "Dockerfile.trainer", "torch.version.cuda or")
    proc = subprocess.run([sys.executable, "-c", trainer_guard], capture_output=True, text=True,
                          env={**os.environ, "TORCH_INDEX_URL": "https://download.pytorch.org/whl/cu130"})
    assert proc.returncode != 0 and "is not the cu130 build" in proc.stderr
