"""bench.common's result writer, on real files."""

import json

from bench.common import COMPACT_ABOVE, write_json


def test_a_small_result_is_indented_and_a_large_one_compact_and_both_read_back(tmp_path):
    small = {"cases": [{"method": "lora", "loss": 0.0812}]}
    text = write_json(tmp_path / "small.json", small).read_text()
    assert text.startswith("{\n  ") and json.loads(text) == small
    large = {"cases": [{"method": "lora", "curve": [[i, 0.1 + i * 1e-6] for i in range(COMPACT_ABOVE // 20)]}]}
    text = write_json(tmp_path / "large.json", large).read_text()
    assert "\n" not in text.rstrip("\n") and ", " not in text and json.loads(text) == large
    assert len(text) < len(json.dumps(large, indent=2))
    assert not list(tmp_path.glob(".*.tmp"))  # nothing left half-written


def test_every_saved_result_is_under_the_limit_indented_or_written_compact():
    """The repository's results stay small enough to travel to a device machine: each one indented, or compact."""
    from pathlib import Path

    for path in sorted((Path(__file__).parents[2] / "bench" / "results").glob("*.json")):
        text = path.read_text()
        indented = text.startswith("{\n")
        assert not indented or len(text.rstrip("\n")) <= COMPACT_ABOVE, f"{path.name}: re-write it compact"


def test_the_tracked_tree_fits_what_a_device_run_carries():
    """A device run copies the working tree, at most 64 MiB: the tracked files keep a margin under it."""
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    root = Path(__file__).parents[2]
    if shutil.which("git") is None or not (root / ".git").exists():
        pytest.skip("not a git checkout")
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True,
                           timeout=60).stdout.split(b"\0")
    paths = [root / n.decode() for n in names if n]
    size = sum(path.stat().st_size for path in paths if path.is_file())
    assert size < 60 * 2**20, f"tracked files: {size / 2**20:.1f} MiB; the device carries 64 MiB in all"
