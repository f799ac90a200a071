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


def test_a_probe_given_a_wrong_file_or_part_says_so_in_one_line_before_it_runs(tmp_path, capsys):
    """--from, --against and the like are checked when the command line is read, and so is --part: a missing file, a
    file that is not JSON, JSON without the cases, or a part that is not K/N is one line naming it, exit status 2.
    An --out that holds something other than the probe's own result is said, not overwritten."""
    import pytest

    from bench.timesteps_probe import main as probe

    good = tmp_path / "good.json"
    good.write_text(json.dumps({"cases": []}))
    (tmp_path / "broken.json").write_text('{"cases": [')
    (tmp_path / "other.json").write_text('{"rows": []}')
    wrong = {"missing.json": "no such file", "broken.json": "not JSON", "other.json": "no list of cases",
             ".": "cannot be read"}
    for name, said in wrong.items():
        with pytest.raises(SystemExit) as e:
            probe(["--from", str(tmp_path / name), "--out", str(tmp_path / "o.json")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and said in err and "argument --from" in err and "Traceback" not in err
    for part in ("3/2", "0/1", "1", "a/b"):
        with pytest.raises(SystemExit) as e:
            probe(["--from", str(good), "--out", str(tmp_path / "o.json"), "--part", part])
        assert e.value.code == 2 and "write K/N with 1 <= K <= N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        probe(["--from", str(good), "--out", str(tmp_path / "broken.json")])
    assert "it is not this command's result" in str(e.value.code)
    assert (tmp_path / "broken.json").read_text() == '{"cases": ['
    assert probe(["--from", str(good), "--out", str(tmp_path / "o.json"), "--part", "2/2"])["cases"] == []
