#!/bin/bash
# The device call of bench/gpu_session.py (issue 38): the branch's changed files laid over the checkout that travels,
# the wheels the device image lacks installed into /tmp/site, then the session with its own time budget.
# Usage on the device: bash .gpu/bench/gpu_session.sh BUDGET_SECONDS [PARTS] (a warm machine keeps /tmp/site, /tmp/gs)
set -o pipefail
# Since 2026-11-27 the call runs main's own files: .gpu (a branch's files) is laid over them only where it exists.
# The wheels: every package of the project's venv the image lacks (`pip download --no-deps --only-binary=:all:
# --python-version 3.12 ...` per the device README; kfp-server-api has no wheel: `pip wheel --no-deps` it), 83
# wheels, 48 MiB. The tree that travels must stay under 64 MiB with them: move bench/results/*, docs/figures and the
# SDXL/SD3/Flux tiny models aside for the call (the SD 1.5-sized model borrows only tiny-sd's tokenizer). With
# --wholerun-model sdxl keep the tiny SDXL (the SDXL-sized model borrows its tokenizers; 7.3 MB) and move tests/ aside
# too: by 2026-11-29's sizes that travels 65.7 MB of the 67.1 allowed.
if [ -d .gpu ]; then cp -r .gpu/src/. src/ && cp -r .gpu/bench/. bench/ || exit 1; fi
t0=$(date +%s)
[ -d /tmp/site/mlflow ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1 || { tail -20 $OUT/pip.txt; exit 1; }
echo "wheels installed in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.limit --format=csv >> $OUT/pip.txt 2>&1
python3 -m bench.gpu_session --out $OUT --work /tmp/gs --budget "${1:-440}" ${2:+--parts $2} 2>&1 | tee $OUT/log.txt
