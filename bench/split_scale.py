"""Splitting large datasets: wall time and peak memory of `rangefinder split` at 10,000 and 100,000 images.

`python -m bench.split_scale` writes synthetic datasets of small files (16x16 PNGs, each a different picture, with a
tag-style `.txt` caption; three images per thousand are copies of a fourth, and one per thousand is too small, so
the duplicate grouping and the skip list do real work), then splits each in a process of its own
(`rangefinder.data.split.split_dataset`: scan, decode and hash every image, group duplicates, shuffle, write the
manifests). Reported per size: the split's wall time and per-image time, the child process' peak resident set
(its own `ru_maxrss` at the end, so the libraries' memory is included), the resident set after the imports, and
their difference: what the split itself held. With small files the decode is cheap, so the time is mostly the
per-file work (stat, read, hash, PIL open) and the memory mostly the per-item records, which is what grows with N.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

from bench.common import default_out, machine_info, smoke_out, table, write_json

NAME = "split_scale"
SIDE = 16


def make_dataset(folder: Path, n: int) -> float:
    """N images with captions under `folder` (reused when already complete); seconds spent writing."""
    import numpy as np
    from PIL import Image

    marker = folder / ".complete"
    if marker.is_file() and marker.read_text() == str(n):
        return 0.0
    shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    tags = ["portrait", "outdoors", "smiling", "red hair", "blue sky", "city", "night", "close-up"]
    for i in range(n):
        sub = folder / f"{i // 1000:03d}"  # 1,000 per folder, as large sets are usually laid out
        if i % 1000 == 0:
            sub.mkdir(parents=True, exist_ok=True)
        side = 4 if i % 1000 == 999 else SIDE  # too small: skipped and listed
        # Per thousand: images 500-502 are copies of image 499 (one group of four identical files).
        source = i - i % 1000 + 499 if i % 1000 in (500, 501, 502) else i
        px = np.zeros((side, side, 3), np.uint8)
        px[0, 0] = (source & 255, (source >> 8) & 255, (source >> 16) & 255)  # every picture different
        px[1:, :] = (37 * source) % 256
        Image.fromarray(px, "RGB").save(sub / f"{i:06d}.png", compress_level=1)
        caption = ", ".join(tags[(i + k) % len(tags)] for k in range(1 + i % 5))
        (sub / f"{i:06d}.txt").write_text(f"photo {i}, {caption}\n")
    marker.write_text(str(n))
    return time.perf_counter() - t0


def child(data: Path, out: Path) -> None:
    """Run in its own process: split `data` into `out`, print one JSON line of what was measured."""
    from rangefinder.data.split import split_dataset

    def rss_kib() -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    before = rss_kib()
    t0 = time.perf_counter()
    split = split_dataset(data, out, min_image_size=SIDE // 2)
    seconds = time.perf_counter() - t0
    s = split.summary
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux: this process' high-water mark
    print(json.dumps({"seconds": seconds, "rss_after_imports_kib": before, "peak_rss_kib": peak, "images": s["images"],
                      "train": s["train_images"], "val": s["val_images"], "skipped": len(s["skipped"]),
                      "duplicate_groups": len(s["duplicates"])}))


def run_size(n: int, work: Path) -> dict[str, Any]:
    data = work / f"data-{n}"
    written = make_dataset(data, n)
    out = work / f"split-{n}"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "bench.split_scale", "--child", str(data), str(out)],
                          capture_output=True, text=True, env=env, cwd=Path(__file__).resolve().parents[1])
    if proc.returncode != 0:
        raise SystemExit(f"split of {n} images failed: {proc.stderr[-2000:]}")
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    peak_kib = measured.pop("peak_rss_kib")
    manifests = sum(p.stat().st_size for p in out.glob("*.json*"))
    return {
        "images_written": n, "seconds_to_write": round(written, 1), **measured,
        "ms_per_image": 1000 * measured["seconds"] / n,
        "peak_rss_mib": peak_kib / 1024, "rss_after_imports_mib": measured["rss_after_imports_kib"] / 1024,
        "split_added_mib": (peak_kib - measured["rss_after_imports_kib"]) / 1024,
        "manifest_mib": manifests / 2**20,
    }


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.split_scale", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[10_000, 100_000])
    p.add_argument("--work-dir", type=Path, help="where the datasets are written (kept and reused; default: a "
                   "temporary folder, removed after)")
    p.add_argument("--smoke", action="store_true", help="one size of 1,000 images (CI)")
    p.add_argument("--out", type=Path)
    p.add_argument("--child", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return {}
    if args.smoke:
        args.sizes = [1000]
    args.out = args.out or (smoke_out(NAME) if args.smoke else default_out(NAME))
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="rangefinder-split-scale-"))
    rows = []
    try:
        for n in sorted(args.sizes):
            rows.append(run_size(n, work))
            print(f"{n} images: {rows[-1]['seconds']:.1f} s, peak {rows[-1]['peak_rss_mib']:.0f} MiB", flush=True)
    finally:
        if args.work_dir is None:
            shutil.rmtree(work, ignore_errors=True)
    result = {"machine": machine_info(), "rows": rows}
    write_json(args.out, result)
    cols = ["images_written", "images", "skipped", "duplicate_groups", "seconds", "ms_per_image", "peak_rss_mib",
            "rss_after_imports_mib", "split_added_mib", "manifest_mib"]
    print(table(rows, cols))
    return result


if __name__ == "__main__":
    main()
