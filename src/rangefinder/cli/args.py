"""Argument types with bounds, shared by the commands: a value outside them is one error line before anything
runs, not a traceback (or an hour of work) later. `rangefinder --help` stays fast: nothing heavy is imported."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rangefinder.errors import RangefinderError

# The seeds every generator here takes (config.MAX_SEED; numpy's global seeding refuses more).
MAX_SEED = 2**32 - 1
# Pixels on a side: far above any Stable Diffusion model (SDXL trains at 1024) and any image this tool makes, and
# low enough that one RGB image still fits in memory (8192^2 x 3 bytes = 192 MiB).
MAX_RESOLUTION = 8192


def int_in(lo: int, hi: int | None = None, *, multiple_of: int = 1, what: str = "",
           why: str = "") -> Callable[[str], int]:
    """An argparse type: a whole number in [lo, hi] (hi None: no upper bound), a multiple of `multiple_of`. `what`
    names the value (the subject of "must be from lo to hi"); `why` says why it is a multiple of `multiple_of`."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if v < lo or (hi is not None and v > hi):
            span = f"from {lo} to {hi}" if hi is not None else f"at least {lo}"
            raise argparse.ArgumentTypeError(f"{v} is out of range: {what or 'it'} must be {span}")
        if v % multiple_of:
            raise argparse.ArgumentTypeError(
                f"{v} is not a multiple of {multiple_of} ({why or what}); try {max(lo, v - v % multiple_of)}")
        return v

    return parse


def float_in(lo: float, hi: float | None = None, *, lo_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in [lo, hi] ((lo, hi] with lo_open)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(v) or v < lo or (lo_open and v == lo) or (hi is not None and v > hi):
            low = f"above {lo:g}" if lo_open else f"at least {lo:g}"
            raise argparse.ArgumentTypeError(f"{text} is out of range: it must be a finite number {low}"
                                             + (f" and at most {hi:g}" if hi is not None else ""))
        return v

    return parse


seed = int_in(0, MAX_SEED, what="a seed")
resolution = int_in(8, MAX_RESOLUTION, multiple_of=8, what="a resolution in pixels", why="the VAE downsamples by 8")


class OneLineParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line (`rangefinder split: error: ...`), as every other bad input gets,
    with a pointer to --help instead of the usage block."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}; see {self.prog} --help\n")


class ExamplesHelpFormatter(argparse.HelpFormatter):
    """argparse's help, with the epilog `examples()` wrote kept line by line: each command whole on its line, as
    the user copies it (argparse fills an epilog into one paragraph)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith(EXAMPLES):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


EXAMPLES = "examples:\n"


def examples(*lines: str) -> dict:
    """`add_parser` keywords for a help that ends in these example lines (a command, or a `# comment` above one)."""
    return {"epilog": EXAMPLES + "".join(f"  {line}\n" for line in lines),
            "formatter_class": ExamplesHelpFormatter}


def refuse_writing_over(out: str | None, out_flag: str, source: str | None, source_flag: str, fix: str) -> None:
    """RangefinderError when `out` is the file `source` names (a link to it too): the command would replace the
    input it read (`compile --config my.yaml --out my.yaml` replaced the config with the package)."""
    if out and source and Path(out).is_file() and Path(source).is_file() and Path(out).samefile(source):
        raise RangefinderError(f"{out_flag} {out} is the {source_flag} file itself, which it would replace; {fix}")


def named_columns(**given: str | None) -> dict[str, str]:
    """The curve columns a command's `--*-column` flags named: contract name -> the file's name (unset ones left
    out, so the contract's own name is read)."""
    return {ours: name for ours, name in given.items() if name is not None}


def curve_source(curve: str, columns: dict[str, str]) -> str:
    """The curve file for a report, and the columns read from it under another name."""
    named = ", ".join(f"{ours} from {theirs!r}" for ours, theirs in columns.items())
    return f"{curve} ({named})" if named else curve


def refuse_plot_over_curve(args: argparse.Namespace) -> None:
    """RangefinderError, before anything is read or written, when a curve command's --plot names its CURVE.csv."""
    if args.plot:
        refuse_writing_over(args.plot, "--plot", args.curve, "CURVE.csv",
                            f"name the plot apart, e.g. {Path(args.plot).with_suffix('.png')}")


def curve_result(args: argparse.Namespace, found: Any, curve: dict, columns: dict[str, str], notes: list[str],
                 plot: Callable[[Any, str], Path], report: Callable[..., dict[str, Path]]) -> dict[str, Any]:
    """What a curve command (analyze-lr, select-steps) returns of what it `found` in CURVE.csv (its bounds, its step
    window): `notes` on how the file was read added to its reading and advice, the columns read under another name
    (for the script that reads the result, and for the report), and the --plot and --report written."""
    found.reading += notes
    found.advice += notes
    result: dict[str, Any] = found.to_dict()
    if columns:
        result["columns"] = columns
    if args.plot:
        result["plot"] = str(plot(found, args.plot))
    if args.report:
        result["report"] = str(report(found, curve, args.report, source=curve_source(args.curve, columns))["html"])
    return result
