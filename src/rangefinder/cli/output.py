"""How a command's result is shown: `--json`, or a key/value table.

Kept apart from main.py because every command module imports `add_json_flag`, and main.py imports every command
module: sharing it from main.py made the two import each other.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from rangefinder.formats.text import printable


def add_json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def print_table(result: dict[str, Any], out=None) -> None:
    """Key/value rows; nested lists are printed one item per line under their key."""
    out = out or sys.stdout
    width = max((len(k) for k in result), default=0)
    for k, v in result.items():
        if isinstance(v, list):
            print(f"{k:<{width}}  {'' if v else '-'}", file=out)
            for item in v:
                print(f"{'':<{width}}  - {printable(item)}", file=out)
        elif isinstance(v, dict):
            print(f"{k}:", file=out)
            for kk, vv in v.items():
                print(f"  {kk}: {printable(vv)}", file=out)
        elif isinstance(v, float):
            print(f"{k:<{width}}  {v:.6g}", file=out)
        else:
            print(f"{k:<{width}}  {printable(v)}", file=out)
