"""`rangefinder COMMAND --help` says what the command takes: the flags it names are its own, and the choices it
lists are the ones the settings accept."""

from __future__ import annotations

import argparse
import re
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
