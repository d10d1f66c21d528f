#!/usr/bin/env bash
# Several gpu_suite.sh stage lists at once, one lane per GPU of a multi-GPU host, so a
# 10-minute device call does the work of several; everything comes back as one archive.
#
#   LANES="0|env,tests|tests/test_pallas.py;1|check,operator;2|sweep||causal128,d64" \
#     TAG=a bash benchmarks/gpu_lanes.sh
#
# A lane is "gpus|stages|pytest files|sweep parts" (CUDA_VISIBLE_DEVICES, STAGES,
# PYTEST_ARGS, SWEEP_SELECT); lanes are separated by ';'. Each lane runs in its own process
# with its own compile cache and output folder under $OUT/$TAG, and is stopped after
# LANE_TIMEOUT seconds so the archive is always written. Lanes share the host's CPUs and
# PCIe, not a GPU: timings taken in one lane are taken while the other GPUs are busy
# (the docs say so beside every figure measured this way).
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn-out}
TAG=${TAG:-lanes}
RES=/tmp/jaxattn-lanes/$TAG
LANE_TIMEOUT=${LANE_TIMEOUT:-560}
rm -rf "$RES"; mkdir -p "$RES" "$OUT"
source benchmarks/wheels.sh && install_wheels  # once, before the lanes start
i=0
pids=()
IFS=';' read -r -a lanes <<< "${LANES:?set LANES}"
for lane in "${lanes[@]}"; do
  IFS='|' read -r gpus stages pyargs sweep <<< "$lane"
  [[ -z "$gpus" ]] && continue
  echo "lane $i: GPUs $gpus, stages $stages${pyargs:+, tests $pyargs}${sweep:+, sweep $sweep}"
  CUDA_VISIBLE_DEVICES=$gpus OUT="$RES/lane$i" STAGES=$stages PYTEST_ARGS=${pyargs:-tests} \
    SWEEP_SELECT=$sweep JAX_COMPILATION_CACHE_DIR=/tmp/jaxattn-jax-cache-$i \
    timeout -k 5 "$LANE_TIMEOUT" bash benchmarks/gpu_suite.sh > "$RES/lane$i.log" 2>&1 &
  pids+=($!)
  i=$((i + 1))
done
status=0
for j in "${!pids[@]}"; do
  wait "${pids[$j]}"; rc=$?
  echo "== lane $j rc=$rc"; tail -n ${TAIL_LINES:-12} "$RES/lane$j.log"
  status=$((status | rc))
done
tar -C /tmp/jaxattn-lanes -czf "$OUT/results-$TAG.tgz" "$TAG"
ls -la "$OUT"
exit $status
