"""The method's numbers that both the settings (config.py) and the analysis read: one copy of each.

A plain module that imports nothing of the project, so that config.py (pydantic) and analysis/ (numpy and matplotlib
only) can both use it without either importing the other.
"""

from typing import Final

# Where between the bounds the fine-tune trains, as a share of the way from lr_low to lr_high on the sweep's axis
# (log LR on an exp ramp, so 0.5 is the geometric mean). Not the halfway point: on the tiny model
# (bench/discovery_quality, 6 datasets) the best constant LR of a grid sweep lay at or above lr_high in most cases,
# and validation loss rises more slowly above that optimum than it falls short below it, so erring high costs less.
# 0.75 kept every case within 1% of the grid's best; 0.5 missed by 2-5%.
MID_POSITION = 0.75

# Which point between the bounds lr_mid is (issue 23): "tuned", MID_POSITION of the way from lr_low to lr_high on
# the sweep's axis; "geometric", sqrt(lr_low * lr_high); "arithmetic", (lr_low + lr_high) / 2, the rule of the
# EveryDream2 write-up. The report shows all three.
MIDPOINT_RULES = ("tuned", "geometric", "arithmetic")
MIDPOINT: Final = "tuned"  # Final: a Literal["tuned"] to the type checker, as the settings' field requires

# Under this quality score an ok reading is flagged `low_quality`, and its report advises checking lr_mid with a
# zoomed range test or a short grid before a long run. From bench/score_calibration (curves with known bounds,
# bench/RESULTS.md "Confidence"): under 0.3, 40% of the readings put lr_mid more than 0.2 decades off the truth; at
# or above it, 5%. No case of bench/discovery_quality scored under 0.7, so that bench neither confirms nor moves it.
LOW_QUALITY = 0.3

# A ramp is stopped, and a curve read as diverged, when smoothed validation loss exceeds this multiple of its best
# (or turns NaN/inf).
DIVERGENCE_FACTOR = 4.0

# The step window (analysis.select_step_window) reads a fine-tune's validation curve at this many distinct updates or
# more, update 0's baseline among them: with fewer there is no curve to smooth. The pipeline refuses a fine-tune
# planned to validate at fewer before it trains (planning.check_finetune_validations).
STEP_WINDOW_MIN_UPDATES = 3
