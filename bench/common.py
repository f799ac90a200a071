"""What every benchmark here needs: the machine it ran on, peak memory, a table on stdout and JSON on disk."""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Optional

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def machine_info() -> dict[str, Any]:
    """CPU model and count, memory, load, library versions and the UTC time: what a number needs beside it."""
    import torch

    info: dict[str, Any] = {
        "date_utc": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "loadavg_1_5_15": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }
    for lib in ("diffusers", "transformers", "accelerate"):
        try:
            info[lib] = __import__(lib).__version__
        except ImportError:
            info[lib] = None
    info["cpu_model"] = _cpu_model()
    info["memory_total_gib"] = _memory_total_gib()
    if torch.cuda.is_available():
        info["cuda_device"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    return info


def _cpu_model() -> Optional[str]:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or None


def _memory_total_gib() -> Optional[float]:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def current_rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc; 0 where it is not there)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class PeakMemory:
    """Peak memory over a block of code: CUDA allocator peak on a GPU, else the process' resident set, sampled.

    On CPU the process-wide high-water mark (ru_maxrss) never comes down, so it cannot tell two runs of one process
    apart; a thread samples the resident set every few milliseconds instead. `peak_bytes` is the highest sample,
    `added_bytes` that minus the resident set when the block began (what the block itself needed, roughly: freed
    memory the allocator keeps counts as still in use).
    """

    def __init__(self, device: str = "cpu", interval_s: float = 0.005) -> None:
        self.device, self.interval_s = device, interval_s
        self.peak_bytes = 0
        self.start_bytes = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def added_bytes(self) -> int:
        return max(0, self.peak_bytes - self.start_bytes)

    def __enter__(self) -> PeakMemory:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start_bytes = torch.cuda.memory_allocated()
            return self
        self.start_bytes = self.peak_bytes = current_rss_bytes()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.is_set():
            self.peak_bytes = max(self.peak_bytes, current_rss_bytes())
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc: object) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()
            self.peak_bytes = torch.cuda.max_memory_allocated()
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_bytes = max(self.peak_bytes, current_rss_bytes())


@contextmanager
def torch_threads(n: Optional[int]) -> Iterator[None]:
    """Run with n intra-op threads (None: leave torch's choice)."""
    import torch

    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class Stopwatch:
    """Wall seconds of a block; synchronises CUDA first so queued kernels are counted where they belong."""

    def __init__(self, device: str = "cpu") -> None:
        self.device, self.seconds = device, 0.0

    def __enter__(self) -> Stopwatch:
        self._sync()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self._sync()
        self.seconds = time.perf_counter() - self._t0

    def _sync(self) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize()


def quiet_libraries() -> None:
    """Keep the benchmark's own table readable: the libraries' info messages and cast warnings are not results."""
    import logging

    for name in ("diffusers", "transformers"):
        try:
            __import__(f"{name}.utils", fromlist=["logging"]).logging.set_verbosity_error()
        except (ImportError, AttributeError):
            pass
    logging.getLogger("mlflow").setLevel(logging.WARNING)


# A result whose indented text would be larger than this is written compact (no indent, no spaces): the merged
# versus reports run to several MB each indented, and the repository's working tree has to stay under the 64 MiB
# that travels to a device machine for bench/gpu_session.py. `python -m json.tool FILE` indents one to read.
COMPACT_ABOVE = 256 * 1024


def write_json(path: Path, obj: Any) -> Path:
    """Write under a temporary name, then rename: a killed benchmark never leaves a half result. Indented, or compact
    above COMPACT_ABOVE characters."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    text = json.dumps(obj, indent=2, default=str)
    if len(text) > COMPACT_ABOVE:
        text = json.dumps(obj, separators=(",", ":"), default=str)
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path


def default_out(name: str) -> Path:
    return RESULTS_DIR / f"{name}.json"


def smoke_out(name: str) -> Path:
    """Where a --smoke run writes by default: outside the repository, never over a real result."""
    import tempfile

    return Path(tempfile.gettempdir()) / "rangefinder-bench" / f"{name}.smoke.json"


def fmt(v: Any, digits: int = 4) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if v != v:  # NaN
            return "nan"
        if v == 0:
            return "0"
        return f"{v:.{digits}g}"
    return str(v)


def table(rows: Sequence[dict[str, Any]], columns: Sequence[str], title: Optional[str] = None,
          headers: Optional[Sequence[str]] = None) -> str:
    """A plain aligned text table (also valid Markdown), columns in the given order, headed by `headers` (default:
    the column keys)."""
    cells = [[fmt(r.get(c)) for c in columns] for r in rows]
    heads = list(headers) if headers is not None else list(columns)
    widths = [max([len(h)] + [len(row[i]) for row in cells]) for i, h in enumerate(heads)]
    lines = []
    if title:
        lines.append(title)
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(heads, widths, strict=True)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells:
        lines.append("| " + " | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) + " |")
    return "\n".join(lines)


def mib(n_bytes: Optional[float]) -> Optional[float]:
    return None if n_bytes is None else round(n_bytes / 2**20, 1)


def median_of(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median of the values that are not None; None if none is."""
    got = [x for x in values if x is not None]
    return statistics.median(got) if got else None


def by_method(rows: Sequence[dict[str, Any]], methods: Sequence[str]) -> dict[str, list[dict[str, Any]]]:
    """A probe's rows grouped as its tallies read them: each of `methods` in order, then "all"; empty groups left
    out."""
    groups = {m: [r for r in rows if r["method"] == m] for m in methods}
    groups["all"] = list(rows)
    return {name: rs for name, rs in groups.items() if rs}


def family_of_case(c: dict[str, Any]) -> str:
    """A saved bench.versus case's family: results from before --family have none, and ran on the SD 1.x model."""
    return str(c.get("family") or "sd1")


CaseKey = tuple[str, str, str, int, str]


def case_lora(c: dict[str, Any]) -> str:
    """A bench.versus case's LoRA rank and alpha where it set them (--lora-rank, --lora-alpha), as "r16 a1": "" for
    the shipped rank 4 and alpha 4, which every case before those flags trained."""
    lora = c.get("lora")
    return f"r{lora['rank']} a{lora['alpha']:g}" if lora else ""


def case_key(c: dict[str, Any]) -> CaseKey:
    """What tells a saved bench.versus case (or a probe's row for it) from another: family, method, kind, seed, and
    the LoRA setting where it set one."""
    return (family_of_case(c), c["method"], c["kind"], int(c["seed"]), case_lora(c))


def _read_bench_json(path: Path, key: str) -> dict[str, Any]:
    """A bench result JSON holding a list under `key`, read and parsed; anything else is an argparse.ArgumentTypeError
    naming the file and what is wrong with it."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"{path}: cannot be read ({getattr(e, 'strerror', None) or e})") from None
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{path}: not JSON ({e.msg}, line {e.lineno}); give a bench result file, "
                                         "as the bench wrote it") from None
    if not isinstance(data, dict) or not isinstance(data.get(key), list):
        raise argparse.ArgumentTypeError(f"{path}: not a bench result (no list of {key}); give the JSON a bench "
                                         "command wrote with --out")
    return data


def _bench_json(path_text: str, key: str) -> Path:
    """An argparse type: the path of a bench result JSON holding a list under `key`, checked when the command line is
    read, so a wrong file is one line naming it, not a traceback after other work."""
    path = Path(path_text)
    _read_bench_json(path, key)
    return path


def results_file(path_text: str) -> Path:
    """An argparse type for a bench result with cases (bench.versus and its probes): see _bench_json."""
    return _bench_json(path_text, "cases")


def rows_file(path_text: str) -> Path:
    """An argparse type for a bench result with rows (bench.lever_probe): see _bench_json."""
    return _bench_json(path_text, "rows")


def part_spec(text: str) -> tuple[int, int]:
    """An argparse type for --part K/N (every Nth case from the Kth, to run N processes side by side): (K, N)."""
    k, sep, n = text.partition("/")
    try:
        part = (int(k), int(n))
    except ValueError:
        part = (0, 0)
    if not sep or not 1 <= part[0] <= part[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: write K/N with 1 <= K <= N, e.g. 1/2 and 2/2 side by side")
    return part


def resumed(out: Path) -> dict[str, Any]:
    """What a killed run left in its --out, to go on from: anything else there is one line, and is not overwritten."""
    try:
        return _read_bench_json(out, "cases")
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"--out {e}: it is not this command's result; move it away, or give another --out") from None


def add_probe_arguments(p: Any, source_required: bool = True) -> None:
    """The arguments every probe of saved bench.versus cases takes (an argparse.ArgumentParser): --from, --out,
    --work-dir, --threads (--from optional for a probe that can also only report)."""
    p.add_argument("--from", dest="source", type=results_file, required=source_required,
                   help="a bench.versus result JSON")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work-dir", type=Path)
    p.add_argument("--threads", type=int, default=1)


def probe_saved_cases(result: dict[str, Any], cases: Sequence[dict[str, Any]], out: Path, work: Optional[Path],
                      threads: int, probe: Callable[[dict[str, Any], Path, Callable[[str], None]], dict[str, Any]],
                      tally: Callable[[list[dict[str, Any]]], dict[str, Any]], prefix: str) -> dict[str, Any]:
    """A probe of saved bench.versus cases (bench.decay_probe, bench.bounds_probe): each case not yet in `out` (a
    killed run goes on where it stopped) through `probe(case, work, log)`, the JSON rewritten with its tally after
    each; `result` is the JSON's head. Returns the finished result."""
    import sys
    import tempfile

    if out.exists():
        result["cases"] = resumed(out)["cases"]
    done = {case_key(r) for r in result["cases"]}
    work = work or Path(tempfile.mkdtemp(prefix=prefix))
    work.mkdir(parents=True, exist_ok=True)

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    with torch_threads(threads):
        for c in cases:
            if case_key(c) in done:
                continue
            result["cases"].append(probe(c, work, log))
            result["tally"] = tally(result["cases"])
            write_json(out, result)
    result["tally"] = tally(result["cases"])
    write_json(out, result)
    return result


def run_probe(name: str, args: Any, cases: Sequence[dict[str, Any]],
              probe: Callable[[dict[str, Any], Path, Callable[[str], None]], dict[str, Any]],
              tally: Callable[[list[dict[str, Any]]], dict[str, Any]]) -> dict[str, Any]:
    """A probe's run from its parsed arguments (add_probe_arguments): the JSON's head (benchmark, source, machine),
    the cases through probe_saved_cases, and the tally printed."""
    head: dict[str, Any] = {"benchmark": name, "source": str(args.source), "machine": machine_info(), "cases": []}
    result = probe_saved_cases(head, cases, args.out, args.work_dir, args.threads, probe, tally,
                               f"{name.replace('_', '-')}-")
    print(json.dumps(result["tally"], indent=1))
    return result
