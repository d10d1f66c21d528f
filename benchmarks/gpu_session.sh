#!/usr/bin/env bash
# Everything the H200 is needed for, in one call; results land under $OUT.
#
#   STAGES=env,tests,check,operator,bench,bridge bash benchmarks/gpu_session.sh
#
# env: versions and nvidia-smi; tests: the pytest suite on the GPU (GPU-marked tests
# included); check: the invariance matrix + accuracy at GPU sizes; operator: the
# check_operator CLI at Qwen3-8B shapes (B=8, S=4096); bench: benchmarks/attention_bench.py
# at the shapes; bridge: the torch bridge's overhead (benchmarks/bridge_bench.py).
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn-out}
STAGES=${STAGES:-env,tests,check,operator,bench,bridge}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX and torch may share the GPU; never let JAX grab 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
PY=${PY:-python3}
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }

if has env; then
  { date -u; nvidia-smi; $PY -c 'import jax, jaxlib, sys; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())';
    $PY -c 'import triton; print("triton", triton.__version__)' 2>&1;
    $PY -c 'import torch; print("torch", torch.__version__)' 2>&1; } > "$OUT/env.txt" 2>&1
  tail -5 "$OUT/env.txt"
fi
if has tests; then
  $PY -m pytest -q -p no:cacheprovider ${PYTEST_ARGS:-tests} 2>&1 | tee "$OUT/pytest.txt" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
fi
if has check; then
  $PY -m jaxattn.check --backends=pallas,reference --batch=${CHECK_BATCH:-4} \
      --seq_len=${CHECK_SEQ:-2048} --decode_steps=${CHECK_DECODE:-64} \
      --chunk_sizes=64,100,1000 --json_out="$OUT/check.json" 2>&1 | tee "$OUT/check.txt" | tail -30
  status=$((status | ${PIPESTATUS[0]}))
fi
if has operator; then
  $PY -m jaxattn.check_operator --op attention --candidate pallas --dtype bf16 \
      --batch=${OP_BATCH:-8} --seq_len=${OP_SEQ:-4096} --query_chunk_size=1000 \
      --kv_page_size=128 --decode_steps=${OP_DECODE:-32} --json_out="$OUT/operator.json" 2>&1 \
      | tee "$OUT/operator.txt" | tail -20
  status=$((status | ${PIPESTATUS[0]}))
fi
if has bench; then
  $PY -m benchmarks.attention_bench --out_dir="$OUT/bench" ${BENCH_ARGS:-} 2>&1 \
      | tee "$OUT/bench.txt" | tail -30
  status=$((status | ${PIPESTATUS[0]}))
fi
if has bridge; then
  $PY -m benchmarks.bridge_bench --out_dir="$OUT/bridge" 2>&1 | tee "$OUT/bridge.txt" | tail -8
  status=$((status | ${PIPESTATUS[0]}))
fi
exit $status
