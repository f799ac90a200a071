"""Does the LR analysis' quality score say how far its midpoint is from the truth? Curves with known bounds.

`python -m bench.score_calibration` reads range-test curves built from formulas (`rangefinder.analysis.synthetic`:
a descent, a turn up, seeded noise) over a grid of point counts and noise levels, and relates each reading's
quality score to the error of its `lr_mid` against the true midpoint (decades). This isolates what the score is
built to measure: how well the curve is read. `bench.discovery_quality` measures the other error, how far the best
constant LR of a long fine-tune lies from what the short range test says.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from typing import Any, Optional

from bench.common import default_out, machine_info, table, write_json

NAME = "score_calibration"


def run(points: list[int], noises: list[float], seeds: int, bootstrap: int, miss_decades: float) -> dict[str, Any]:
    from bench.discovery_quality import spearman
    from rangefinder.analysis import analyze_lr_curve
    from rangefinder.analysis.synthetic import RangeTestShape, lr_sweep, noisy, true_lr_bounds
    from rangefinder.defaults import MID_POSITION

    shape = RangeTestShape(rise=0.05)
    lo, hi = true_lr_bounds(shape, 1e-7, 1e-2, "exp", start=shape.base)
    true_mid = lo ** (1 - MID_POSITION) * hi ** MID_POSITION
    rows = []
    for n in points:
        lr = lr_sweep(n)
        for sigma in noises:
            for seed in range(seeds):
                b = analyze_lr_curve(lr, noisy(shape.loss(lr), sigma * shape.drop, seed), seed=seed,
                                     bootstrap=bootstrap)
                err = abs(math.log10(b.lr_mid / true_mid)) if b.status == "ok" and b.lr_mid else math.inf
                rows.append({"points": n, "noise": sigma, "seed": seed, "status": b.status,
                             "quality": b.quality, "error_decades": err})
    ok = [r for r in rows if r["status"] == "ok"]
    out: dict[str, Any] = {"n": len(rows), "ok": len(ok), "miss_decades": miss_decades,
                           "spearman_score_error": spearman([r["quality"] for r in ok],
                                                            [r["error_decades"] for r in ok])}
    bands = []
    for lo_q, hi_q in ((0.0, 0.2), (0.2, 0.3), (0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (0.6, 0.7), (0.7, 1.01)):
        sel = [r for r in ok if lo_q <= r["quality"] < hi_q]
        errs = sorted(r["error_decades"] for r in sel)
        bands.append({"score": f"{lo_q:.1f}-{min(hi_q, 1.0):.1f}", "readings": len(sel),
                      "misses": sum(e > miss_decades for e in errs),
                      "miss_share": (sum(e > miss_decades for e in errs) / len(sel)) if sel else None,
                      "median_error_decades": statistics.median(errs) if errs else None})
    out["bands"] = bands
    out["rows"] = rows
    return out


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(prog="python -m bench.score_calibration", description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="10,14,20,30", help="measurements per sweep")
    p.add_argument("--noise", default="0.02,0.05,0.1,0.2,0.3", help="per-point noise as a share of the drop")
    p.add_argument("--seeds", type=int, default=8)
    p.add_argument("--bootstrap", type=int, default=100)
    p.add_argument("--miss-decades", type=float, default=0.2, help="an lr_mid error above this counts as a miss")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    res = run([int(x) for x in args.points.split(",")], [float(x) for x in args.noise.split(",")], args.seeds,
              args.bootstrap, args.miss_decades)
    res = {"benchmark": NAME, "machine": machine_info(), "settings": vars(args), **res}
    out = args.out or default_out(NAME)
    write_json(out, res)
    print(table(res["bands"], ["score", "readings", "misses", "miss_share", "median_error_decades"],
                title=f"lr_mid error vs quality score (miss: > {args.miss_decades:g} decades from the true midpoint)"))
    print(f"\nreadings {res['n']}, ok {res['ok']}; Spearman(score, error) {res['spearman_score_error']:.3f}")
    print(f"written: {out}", file=sys.stderr)
    return res


if __name__ == "__main__":
    main()
