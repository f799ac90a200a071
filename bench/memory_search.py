"""The largest batch a full fine-tune of an SD 1.5-sized model trains at 512 px (bf16) on this GPU, per memory arm.

`python -m bench.memory_search` runs bench.speed_vs_reference.largest_batch (3 engine updates per candidate batch,
ascending, until CUDA runs out of memory) for each arm: eager; training.compile on; gradient checkpointing; 8-bit
AdamW (bitsandbytes); and checkpointing + 8-bit AdamW together. CUDA only: on a machine without one it says so and
exits with status 1 (the batch that fits in CPU memory says nothing about a GPU).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

from bench.common import default_out, machine_info, quiet_libraries, table, write_json

NAME = "memory_search"
ARMS = {
    "eager": {},
    "compile": {"compile": "on"},
    "gradient_checkpointing": {"gradient_checkpointing": True},
    "adamw_8bit": {"use_8bit_adam": True},
    "checkpointing+adamw_8bit": {"gradient_checkpointing": True, "use_8bit_adam": True},
}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.memory_search", description=__doc__.split("\n\n")[0])
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--batches", default="4,8,12,16,24,32,48,64", help="candidate batch sizes, tried ascending")
    p.add_argument("--arms", default=",".join(ARMS), help=f"some of {', '.join(ARMS)}")
    p.add_argument("--out", type=Path, help="JSON output (default bench/results/memory_search.json)")
    p.add_argument("--work-dir", type=Path)
    args = p.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        sys.exit("bench.memory_search needs a CUDA GPU (it searches the largest batch that fits in GPU memory); "
                 "none is visible here. Run it on a GPU machine: python -m bench.memory_search")
    quiet_libraries()
    from bench.fixtures import sd15_setup
    from bench.speed_vs_reference import largest_batch

    candidates = [int(b) for b in args.batches.split(",")]
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="bench-memory-"))
    # Enough training images (after the 0.2 validation split) for the largest batch.
    setup = sd15_setup(work, images=max(40, int(max(candidates) / 0.8) + 8), resolution=args.resolution)
    result: dict[str, Any] = {"benchmark": NAME, "machine": machine_info(), "device": torch.cuda.get_device_name(0),
                              "resolution": args.resolution, "mixed_precision": "bf16", "method": "full", "arms": []}
    for arm in args.arms.split(","):
        print(f"{arm}:", file=sys.stderr)
        best, tried = largest_batch(setup, candidates=candidates, mixed_precision="bf16", device="cuda",
                                    cache_dir=work / "cache", log=lambda m: print(m, file=sys.stderr), **ARMS[arm])
        fits = [t for t in tried if t["fits"]]
        result["arms"].append({"arm": arm, "largest_batch": best, "tried": tried,
                               "peak_mib_at_largest": fits[-1]["peak_mib"] if fits else None})
    out = write_json(args.out or default_out(NAME), result)
    print(table(result["arms"], ["arm", "largest_batch", "peak_mib_at_largest"],
                title=f"Largest full fine-tune batch at {args.resolution} px, bf16, {result['device']}"))
    print(f"\nwritten: {out}")
    return result


if __name__ == "__main__":
    main()
