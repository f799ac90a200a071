"""Training updates of the tiny UNet at 1 thread and at torch's default, on an idle machine and beside a busy one.

`python -m bench.threads` times full updates (forward, backward, AdamW) of the embedded tiny model's UNet, batch 4
at the demo's 32 px, at `torch.set_num_threads(1)` and at torch's own default, first alone, then (`--busy N`, default
1) beside N processes that each keep one core busy, as another job on a shared machine does. It is the measurement
behind local runs training on one thread (`RANGEFINDER_TORCH_THREADS`, set to 1 by pipelines.local_run).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from typing import Any

from bench.common import default_out, machine_info, quiet_libraries, smoke_out, table, torch_threads, write_json

NAME = "threads"


def _spin(stop: Any) -> None:
    x = 0
    while not stop.is_set():
        x = (x * 31 + 7) % 1_000_003


def time_updates(unet: Any, updates: int, threads: int) -> float:
    """Median seconds of one update (the first two left out: allocation) at `threads` torch threads."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.AdamW(unet.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)
    seconds = []
    with torch_threads(threads):
        for _ in range(updates + 2):
            z = torch.randn(4, 4, 8, 8, generator=g)
            text = torch.randn(4, 77, unet.config.cross_attention_dim, generator=g)
            t = torch.randint(0, 1000, (4,), generator=g)
            t0 = time.perf_counter()
            loss = F.mse_loss(unet(z, t, encoder_hidden_states=text).sample, z)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            seconds.append(time.perf_counter() - t0)
    return statistics.median(seconds[2:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--updates", type=int, default=30)
    p.add_argument("--busy", type=int, default=1, help="processes keeping a core busy in the second round")
    p.add_argument("--smoke", action="store_true", help="3 updates, no busy round (CI)")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    import torch
    from diffusers import UNet2DConditionModel

    from rangefinder.models.tiny import ensure_tiny_base_model

    quiet_libraries()
    updates, busy_rounds = (3, [0]) if a.smoke else (a.updates, [0, a.busy])
    unet = UNet2DConditionModel.from_pretrained(ensure_tiny_base_model(), subfolder="unet").train()
    default = torch.get_num_threads()
    rows = []
    for busy in busy_rounds:
        stop = multiprocessing.Event()
        spinners = [multiprocessing.Process(target=_spin, args=(stop,), daemon=True) for _ in range(busy)]
        for s in spinners:
            s.start()
        try:
            for threads in sorted({1, default}):
                rows.append({"busy_processes": busy, "threads": threads,
                             "seconds_per_update": time_updates(unet, updates, threads)})
        finally:
            stop.set()
            for s in spinners:
                s.join()
    out = a.out or (smoke_out(NAME) if a.smoke else default_out(NAME))
    write_json(out, {"machine": machine_info(), "default_threads": default, "updates": updates, "rows": rows})
    print(table(rows, ["busy_processes", "threads", "seconds_per_update"], title="tiny UNet update (batch 4, 32 px)"))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
