"""`rangefinder COMMAND --help` says what the command takes: the flags it names are its own, and the choices it
lists are the ones the settings accept."""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import get_args

from rangefinder.cli.main import build_parser
from rangefinder.config import Method, Optimizer, Schedule


def _commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_flag_a_commands_help_names_is_one_it_takes():
    """train's --steps said "see --steps-unit in the config": a flag of `plan` that `train` refuses."""
    for name, parser in _commands().items():
        own = {option for action in parser._actions for option in action.option_strings}
        named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", parser.format_help()))
        assert named <= own, (name, sorted(named - own))


def test_train_help_lists_every_method_schedule_and_optimizer_the_config_takes():
    """--schedule listed seven schedules; training.schedule takes wsd too."""
    text = " ".join(_commands()["train"].format_help().split())
    for choice in (*get_args(Method), *get_args(Schedule), *get_args(Optimizer)):
        assert re.search(rf"(?<![\w-]){re.escape(choice)}(?![\w-])", text), choice


def test_every_flag_with_a_default_says_it():
    """A flag left out takes its default: `plan --batch-size`, `make-dataset --kind`, `sample --steps` and train's
    settings (from training: and validation:) said nothing of theirs, so the help did not say what a run got."""
    from rangefinder.config import TrainingConfig, ValidationConfig

    unsaid = []
    for name, parser in _commands().items():
        for action in parser._actions:
            if action.default in (None, False, [], argparse.SUPPRESS) or action.required or not action.option_strings:
                continue
            said = action.help or ""
            if "default" not in said and f"({action.default}" not in said:  # split's "(0.2)", "(555)" say it too
                unsaid.append(f"{name} {action.option_strings[0]} (default {action.default!r})")
    assert unsaid == []
    train = " ".join(_commands()["train"].format_help().split())
    for section, field in ((TrainingConfig, "method"), (TrainingConfig, "schedule"), (TrainingConfig, "batch_size"),
                           (TrainingConfig, "grad_accum"), (TrainingConfig, "seed"), (TrainingConfig, "lr"),
                           (ValidationConfig, "every_epochs")):
        prefix = "training" if section is TrainingConfig else "validation"
        assert f"{prefix}.{field}; default {section.model_fields[field].default}" in train, field


ROOT = Path(__file__).parents[2]
# Where a user reads a `rangefinder` command to copy: the README, docs/, the generated READMEs, the Makefile.
DOC_FILES = ("README.md", "docs/*.md", "components/README.md", "components/*/README.md", "pipelines/README.md",
             "images/README.md", "manifests/README.md", "bench/README.md", "configs/*.yaml", "Makefile")
BIN = r"(?:\$\(VENV\)/bin/|\.venv/bin/)?"


def _shown_commands() -> list[tuple[str, str, bool]]:
    """(file, command, whole) for each `rangefinder COMMAND ...` the documents show: each line of a code block (and
    each `run:` of a YAML block, a CI job's), whole, to be run as written; and each inline `code` span, which may
    be a fragment (`rangefinder plan --bucket-counts 40,25,35 ...`) whose flags must still be the command's."""
    shown = []
    for pattern in DOC_FILES:
        for path in sorted(ROOT.glob(pattern)):
            name, text = path.relative_to(ROOT).as_posix(), path.read_text()
            blocks = re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S)
            for lang, block in blocks:
                if lang == "yaml":
                    runs = re.findall(r"run: >-\n((?:\s{10,}.*\n)+)", block)
                    shown += [(name, " ".join(r.split()), True) for r in runs if "rangefinder " in r]
                    continue
                text = text.replace(block, "")  # its inline spans are not inline
                for line in block.replace("\\\n", " ").splitlines():
                    m = re.match(rf"\s*{BIN}(rangefinder [a-z].*)", line)
                    if m:
                        shown.append((name, m.group(1), True))
            if name == "Makefile":
                shown += [(name, m, True) for m in re.findall(rf"\t{BIN}(rangefinder [a-z][^\n]*)", text)]
            shown += [(name, m, False) for m in re.findall(rf"`{BIN}(rangefinder [a-z][a-z-]*(?: [^`]*)?)`", text)]
    return shown


def test_every_rangefinder_command_the_documents_show_is_one_the_cli_takes():
    """Each command the README and docs show names a real command and only its flags, with a value each flag
    takes (`--family sd1|sdxl|sd3|flux`: each of them); a command in a code block parses whole, as a user who copies
    it runs it. A flag renamed in the code and not in the docs fails here."""
    import shlex

    commands = _commands()
    checked, wrong = 0, []
    for name, command, whole in _shown_commands():
        command = re.sub(r"\s+(#|>|\|\|).*$", "", command)  # a comment, a redirect
        words = shlex.split(command.replace("$(", "X_").replace(")", ""))[1:]
        if not words or words[0] not in commands:
            if whole or words[:1] and re.fullmatch(r"[a-z]+(-[a-z]+)+", words[0]):
                wrong.append(f"{name}: {command}: no command {words[:1]}")
            continue
        parser = commands[words[0]]
        own = {option for action in parser._actions for option in action.option_strings}
        wrong += [f"{name}: {command}: {w} is not a flag of {words[0]}" for w in words if w.startswith("--")
                  and w.split("=")[0] not in own]
        if "..." in words or not whole and (len(words) == 1 or words[-1].startswith("--")):
            continue  # the command named, a flag named (`split --out`), or a fragment: its flags are checked above
        alternatives = [w.split("|") if "|" in w else [w] for w in words[1:]]
        for choice in range(max(len(a) for a in alternatives) if alternatives else 1):
            argv = [a[min(choice, len(a) - 1)] for a in alternatives]
            try:
                parser.parse_args(argv)
            except SystemExit:
                if whole or not _only_required_missing(parser, argv):
                    wrong.append(f"{name}: {command}: does not parse as written")
        checked += 1
    assert checked > 20 and wrong == [], "\n".join(wrong)


def _only_required_missing(parser: argparse.ArgumentParser, argv: list[str]) -> bool:
    """An inline span may leave out what a command requires (`rangefinder split --captionless`): it parses once
    placeholders stand in for the required flags and, where the span gave none, the positional argument."""
    required = [w for action in parser._actions if action.required and action.option_strings
                and not set(action.option_strings) & set(argv) for w in (action.option_strings[0], "X")]
    for filled in ([*required, *argv], [*required, "X", *argv]):
        try:
            parser.parse_args(filled)
            return True
        except SystemExit:
            continue
    return False


def test_the_standalone_commands_help_ends_in_examples_each_on_its_line_that_parse():
    """A user of another trainer reads `--help` for what the input looks like: plan, train, analyze-lr and
    select-steps showed no command to copy. Each example is whole on its line and parses as written."""
    import shlex

    commands = _commands()
    for name in ("plan", "train", "analyze-lr", "select-steps"):
        text = commands[name].format_help()
        assert "\nexamples:\n" in text, name
        shown = [line.strip() for line in text.split("\nexamples:\n", 1)[1].splitlines() if line.strip()]
        runs = [shlex.split(line)[1:] for line in shown if line.startswith(f"rangefinder {name} ")]
        assert runs, (name, shown)
        for argv in runs:
            commands[name].parse_args(argv[1:])  # exits (fails the test) on a flag or value it does not take


def test_demo_s_fixed_lr_says_it_skips_whichever_lr_finder_the_family_runs():
    """`demo --lr` said it skips the LR range test; on `--family sdxl`, `sd3` and `flux` lr_finder auto measures the LR
    with a Prodigy run instead, which a fixed LR skips as well (the pipeline's fixed_lr says so)."""
    (lr,) = [a for a in _commands()["demo"]._actions if "--lr" in a.option_strings]
    assert "range test" in (lr.help or "") and "Prodigy run" in (lr.help or ""), lr.help
