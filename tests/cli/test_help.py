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
