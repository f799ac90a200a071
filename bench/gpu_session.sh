#!/bin/bash
# The device call of bench/gpu_session.py (issue 38): the branch's changed files laid over the checkout that travels,
# the wheels the device image lacks installed into /tmp/site, then the session with its own time budget.
# Usage on the device: bash .gpu/bench/gpu_session.sh BUDGET_SECONDS [PARTS] (a warm machine keeps /tmp/site, /tmp/gs)
set -o pipefail
cp -r .gpu/src/. src/ && cp -r .gpu/bench/. bench/ || exit 1
t0=$(date +%s)
[ -d /tmp/site/mlflow ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1 || { tail -20 $OUT/pip.txt; exit 1; }
echo "wheels installed in $(( $(date +%s) - t0 )) s"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,power.limit --format=csv >> $OUT/pip.txt 2>&1
python3 -m bench.gpu_session --out $OUT --work /tmp/gs --budget "${1:-440}" ${2:+--parts $2} 2>&1 | tee $OUT/log.txt
