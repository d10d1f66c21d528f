#!/usr/bin/env bash
# Everything the H200 is needed for, in one call; results land under $OUT.
#
#   STAGES=env,tests,check,operator,bench,bridge bash benchmarks/gpu_suite.sh
#
# env: versions and nvidia-smi; tests: the pytest suite on the GPU (GPU-marked tests
# included; PYTEST_ARGS picks files, e.g. "tests/test_pallas.py tests/test_cp.py", and
# PYTEST_K a -k expression, e.g. PYTEST_K=mosaic); check: the invariance
# matrix + accuracy at GPU sizes (CHECK_ROWS picks rows, e.g. "cp,paged"); operator: the check_operator CLI at Qwen3-8B shapes
# paged: benchmarks/paged_bench.py (PAGED_ARGS), contiguous and paged decode per backend
# (B=8, S=4096); bench: benchmarks/attention_bench.py at the issue's shapes; bridge: the
# torch bridge's overhead (benchmarks/bridge_bench.py); profile: where a bridge call's host
# time goes (benchmarks/bridge_profile.py, PROFILE_ARGS); varlen: packed sequences and left
# padding beside a padded batch and cuDNN (benchmarks/varlen_bench.py); hf: HF transformers decode and
# training steps beside sdpa (benchmarks/hf_bench.py); peers: the invariance matrix of
# every peer (benchmarks/peer_invariance.py); sweep: the published speed sweep (Qwen3-8B
# heads, S 1k-32k causal and non-causal, D=64 and 256 points, chunked prefill, decode up
# to 128k; each part under its own timeout, results kept as they come; SWEEP_SELECT=a,b
# runs only the parts named); variants: the exp2 / row-sum schedule candidates
# (benchmarks/tune.py); launch: the prefill forward's launch options (tile order, tile
# height, warps, stages, row sum, BLOCK_N) beside Pallas mha; cp: distributed CP on every
# GPU of a multi-GPU host (benchmarks/cp_bench.py); mosaic: the first GPU run of the Mosaic
# GPU forward (benchmarks/mosaic_gpu_check.py, MOSAIC_ARGS: accuracy, bits across launch
# variants, batch/chunk invariance; a hang is a barrier bug); mosaicspeed: the forward
# variants' TFLOP/s beside the Pallas backend, Pallas mha and cuDNN; e2e: the Qwen3 rollout /
# training parity example at Qwen3-8B sizes; ncu: Nsight Compute's sections on the longest
# attention kernel of NCU_MODES (fwd, fwdbwd, fold, decode; benchmarks/kernel_probe.py,
# NCU_ARGS), or of each labelled run of NCU_RUNS; grid: issue 26's decode grid (B 1 to 128,
# Skv 1k to 128k) beside the peers, one process per B (GRID_BACKENDS may name a launch
# variant beside the default, e.g. jaxattn:mosaic:splits_per_cta=None); spc: MosaicConfig.splits_per_cta's
# bits against one split a CTA, then (if they hold) the decode steps and paged cache
# beside the default; ablate: the forward with one part taken away at a time
# (benchmarks/ablate.py, ABLATE_ARGS; timed only); points33: issue 33's five points
# (POINTS33="B:S:D:c|n ..."), forward and forward + backward beside JAX and torch cuDNN,
# a process each; fwd33: issue 33's forward sweep (D=128 and 64, causal and not,
# S 1k to 32k) beside torch cuDNN and JAX cuDNN, with launch variants and the backward;
# mprof: where a prefill's time goes per item (benchmarks/mosaic_profile.py, MPROF_*);
# timeline: each kernel's duration and the gap before it in back-to-back calls, through
# CUPTI (benchmarks/kernel_timeline.py, TIMELINE_ARGS, e.g. "--batch=8 --seq_len=4096
# --query_len=4096 --head_dim=64 --configs=c3:compute_wgs=3,c3s:...").
# Each part writes under $OUT; plots are drawn afterwards on any machine with
# `python -m benchmarks.plot --results=$OUT/sweep/*/results.json --out_dir=...`.
set -uo pipefail
OUT=${OUT:-/tmp/jaxattn-out}
STAGES=${STAGES:-env,tests,check,operator,bench,bridge}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# JAX and torch may share the GPU; never let JAX grab 75% up front.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# Compiled executables persist between the calls on one machine (while it stays warm
# between calls): later stages reuse what the tests compiled.
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxattn-jax-cache}
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:-0}
PY=${PY:-python3}
# Wheels carried from benchmarks/fetch_wheels.sh (the device has no registry).
source benchmarks/wheels.sh && install_wheels
status=0
has() { [[ ",$STAGES," == *",$1,"* ]]; }
part() { [[ ",$2," == *",$1,"* ]]; }  # part NAME LIST: NAME is one of LIST's

if has env; then
  { date -u; nvidia-smi; $PY -c 'import jax, jaxlib, sys; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())';
    $PY -c 'import triton; print("triton", triton.__version__)' 2>&1;
    $PY -c 'import torch; print("torch", torch.__version__)' 2>&1; } > "$OUT/env.txt" 2>&1
  tail -5 "$OUT/env.txt"
fi
if has tests; then
  # PYTEST_WORKERS: pytest-xdist workers sharing the GPU (addopts asks two: CI's cores).
  timeout ${TESTS_TIMEOUT:-1800} $PY -m pytest -q -p no:cacheprovider -n ${PYTEST_WORKERS:-8} ${PYTEST_ARGS:-tests} \
      ${PYTEST_K:+-k "$PYTEST_K"} 2>&1 \
      | tee "$OUT/pytest.txt" | tail -25
  status=$((status | ${PIPESTATUS[0]}))
fi
if has check; then
  # Default: every backend usable here but triton (mosaic on sm90, pallas, reference).
  # The check compiles a kernel per shape it runs (a decode step per key count, a page
  # size and layout, a CP cut) and runs each for milliseconds, so compiling, on the
  # host's CPU, is most likely its time (not yet profiled): the default backend's ten
  # rows took about 11 minutes in one process on the H200 (2026-12-05: 12 to 130 s a
  # row), more than a device call's 10. So each backend's rows run in groups
  # (CHECK_GROUPS: groups separated by ';', rows by ','; CHECK_ARGS: further flags of
  # jaxattn.check, e.g. --head_dim=256), one process per backend and
  # group, CHECK_JOBS at a time on the host's cores; each writes check-<backend>-<n>.txt
  # and .json, and the stage fails if any process does. CHECK_ROWS (one group) keeps the
  # one-process form, e.g. CHECK_ROWS="decode,paged,cp".
  CHECK_BACKENDS=${CHECK_BACKENDS:-$($PY -c 'from jaxattn.check import usable_backends
print(",".join(b for b in usable_backends() if b != "triton"))')}
  CHECK_GROUPS=${CHECK_ROWS:-${CHECK_GROUPS:-paged;decode;cp;padding;varlen;batch,rerun,chunked,left padding,jax layout}}
  check_one() {  # check_one BACKEND N ROWS: one process, its output in check-BACKEND-N.*
    # (its own compile cache: JAX writes a cache entry in place, unlocked, so two
    # processes compiling one program at once could read a half-written entry)
    JAX_COMPILATION_CACHE_DIR="$JAX_COMPILATION_CACHE_DIR-check-$1-$2" \
    timeout ${CHECK_TIMEOUT:-540} $PY -m jaxattn.check --backends="$1" \
        --batch=${CHECK_BATCH:-4} --seq_len=${CHECK_SEQ:-2048} --decode_steps=${CHECK_DECODE:-64} \
        --chunk_sizes=64,100,1000 --rows="$3" --json_out="$OUT/check-$1-$2.json" ${CHECK_ARGS:-} \
        > "$OUT/check-$1-$2.txt" 2>&1
    local rc=$?
    echo $rc > "$OUT/check-$1-$2.rc"
    echo "== check $1 [$3]: rc=$rc, $(tail -1 "$OUT/check-$1-$2.txt")"
  }
  IFS=';' read -ra check_groups <<< "$CHECK_GROUPS"
  IFS=',' read -ra check_backends <<< "$CHECK_BACKENDS"
  rm -f "$OUT"/check-*.rc "$OUT"/check-*.txt "$OUT"/check-*.json
  for be in "${check_backends[@]}"; do
    for i in "${!check_groups[@]}"; do
      while (( $(jobs -rp | wc -l) >= ${CHECK_JOBS:-8} )); do wait -n; done
      check_one "$be" "$i" "${check_groups[$i]}" &
    done
  done
  wait
  for be in "${check_backends[@]}"; do  # a process that left no status failed
    for i in "${!check_groups[@]}"; do
      status=$((status | $(cat "$OUT/check-$be-$i.rc" 2>/dev/null || echo 1)))
    done
  done
  # Each process's verdict is printed above as it ends; here each backend's accuracy
  # and every promised row whose bits differ.
  for be in "${check_backends[@]}"; do
    echo "$be: $(grep -h -m1 '^accuracy' "$OUT/check-$be-0.txt")"
  done
  grep -h -E 'yes {7}NO ' "$OUT"/check-*.txt | head -40
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
if has grid; then
  # Issue 26's decode grid: B in GRID_BATCHES, Skv 1k to 128k, jaxattn's backends beside
  # JAX cuDNN, torch cuDNN and torch flash; one process per B (each writes its own
  # results). B=128 stops at 32k keys: its K and V alone are 69 GB at 128k, more than the
  # harness's input sets and their generation hold.
  for gb in ${GRID_BATCHES:-1 8 32 128}; do
    lens=${GRID_KV_LENS:-1024,8192,32768,131072}
    [[ $gb -ge 128 ]] && lens=${lens%,131072}
    echo "== grid B=$gb Skv=$lens"
    timeout ${GRID_TIMEOUT:-150} $PY -m benchmarks.attention_bench --modes=decode \
        --decode_batch=$gb --decode_kv_lens=$lens --iters=5 --sample_ms=20 --reps=50 \
        --backends=${GRID_BACKENDS:-jaxattn:mosaic,jaxattn:pallas,cudnn,torch_cudnn,torch_flash} \
        --out_dir="$OUT/grid/b$gb" 2>&1 | grep -v 'Unable to initialize backend' \
        > "$OUT/grid-b$gb.txt"
    rc=${PIPESTATUS[0]}; grep '^|' "$OUT/grid-b$gb.txt" | tail -22; echo "rc=$rc"
    status=$((status | rc))
  done
fi
if has paged; then
  # Paged decode: each backend contiguous and paged (page sizes, layouts), GB/s of K and V.
  timeout ${PAGED_TIMEOUT:-300} $PY -m benchmarks.paged_bench --out_dir="$OUT/paged" \
      ${PAGED_ARGS:-} 2>&1 | grep -v 'Unable to initialize backend' \
      | tee "$OUT/paged.txt" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
fi
if has bridge; then
  $PY -m benchmarks.bridge_bench --out_dir="$OUT/bridge" 2>&1 | tee "$OUT/bridge.txt" | tail -8
  status=$((status | ${PIPESTATUS[0]}))
fi
if has profile; then
  # Where a bridge call's host time goes (benchmarks/bridge_profile.py).
  timeout ${PROFILE_TIMEOUT:-300} $PY -m benchmarks.bridge_profile ${PROFILE_ARGS:-} 2>&1 \
      | grep -v '^[IW][0-9]' > "$OUT/profile.txt"
  grep 'us/call' "$OUT/profile.txt" | tail -60
fi
if has varlen; then
  # Packed sequences and left padding beside the padded batch and cuDNN (varlen_bench.py).
  timeout ${VARLEN_TIMEOUT:-240} $PY -m benchmarks.varlen_bench --out_dir="$OUT/varlen" \
      ${VARLEN_ARGS:-} 2>&1 | grep -v 'Unable to initialize backend' \
      | tee "$OUT/varlen.txt" | tail -22
  status=$((status | ${PIPESTATUS[0]}))
fi
if has hf; then
  # HF transformers: attn_implementation="jaxattn" beside "sdpa" (decode and training).
  $PY -m benchmarks.hf_bench --out_dir="$OUT/hf" 2>&1 | tee "$OUT/hf.txt" | tail -10
  status=$((status | ${PIPESTATUS[0]}))
fi
if has peers; then
  timeout ${PEERS_TIMEOUT:-420} $PY -m benchmarks.peer_invariance --out_dir="$OUT/peers" \
      ${PEERS_ARGS:-} 2>&1 | tee "$OUT/peers.txt" | tail -16
  status=$((status | ${PIPESTATUS[0]}))
fi
if has sweep; then
  # name|timeout|args: each part is its own process (its results survive a later timeout).
  # The D=256 parts' limits cover a cold compile cache (2026-12-05, H100: d256 ran past
  # 90 s cold and took 54 s warm). All parts: about 1110 s, so two device calls (e.g.
  # SWEEP_SELECT=causal128,noncausal128,d64 then the rest).
  SWEEP_PARTS=${SWEEP_PARTS:-"causal128|240|--modes=fwd,fwdbwd --seq_lens=1024,2048,4096,8192,16384,32768 --tokens=32768
noncausal128|180|--modes=fwd,fwdbwd --nocausal --seq_lens=1024,4096,16384,32768 --tokens=32768 --backends=jaxattn:mosaic,jaxattn:pallas,cudnn,pallas_mha,torch_flash,torch_cudnn
d64|90|--modes=fwd,fwdbwd --head_dim=64 --seq_lens=4096,16384 --tokens=32768
d64nc|75|--modes=fwd,fwdbwd --nocausal --head_dim=64 --seq_lens=4096,16384 --tokens=32768 --backends=jaxattn:mosaic,jaxattn:pallas,cudnn,pallas_mha,torch_flash,torch_cudnn
d256|180|--modes=fwd,fwdbwd --head_dim=256 --seq_lens=4096,16384 --tokens=32768
d256nc|150|--modes=fwd,fwdbwd --nocausal --head_dim=256 --seq_lens=4096,16384 --tokens=32768 --backends=jaxattn:mosaic,jaxattn:pallas,cudnn,pallas_mha,torch_flash,torch_cudnn
chunked|90|--modes=chunked --chunk_size=2048 --seq_lens=4096,16384,32768 --batch=1 --backends=jaxattn:mosaic,jaxattn:pallas,cudnn,xla,torch_flash,torch_efficient
decode|120|--modes=decode --decode_batch=8 --decode_kv_lens=1024,4096,16384,65536,131072 --backends=jaxattn:mosaic,jaxattn:pallas,cudnn,xla,torch_flash,torch_cudnn,torch_efficient"}
  while IFS='|' read -r name limit args; do
    [[ -z "$name" ]] && continue
    if [[ -n "${SWEEP_SELECT:-}" && ",$SWEEP_SELECT," != *",$name,"* ]]; then continue; fi
    echo "== sweep $name ($limit s): $args"
    timeout "$limit" $PY -m benchmarks.attention_bench --iters=${SWEEP_ITERS:-5} \
        --sample_ms=30 --out_dir="$OUT/sweep/$name" $args > "$OUT/sweep-$name.txt" 2>&1
    rc=$?; tail -3 "$OUT/sweep-$name.txt"; echo "rc=$rc"
    status=$((status | rc))
  done <<< "$SWEEP_PARTS"
fi
if has ncu; then
  # Nsight Compute on the attention kernels (issue 33: where the time goes per tile). Per
  # mode of NCU_MODES (fwd, fwdbwd; benchmarks/kernel_probe.py at NCU_ARGS' shape): the
  # kernels and their times, then the full section set (stall reasons, issue slots, the
  # source view's samples) on the longest one; clocks left alone (METHOD.md).
  # NCU_RUNS="label=kernel_probe flags;label=..." names each run and its flags (e.g.
  # "dec-pallas=--mode=decode --backend=pallas --batch=8 --seq_len=32768"); without it,
  # each mode of NCU_MODES with NCU_ARGS. NCU_LIST_ONLY=1: the launch list only;
  # NCU_RANK=2: the full set on the second longest kernel (the split decode's fold).
  NCU=${NCU:-$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)}
  runs=${NCU_RUNS:-}
  if [[ -z "$runs" ]]; then
    for m in ${NCU_MODES//,/ }; do runs+="${runs:+;}$m=--mode=$m ${NCU_ARGS:-}"; done
  fi
  IFS=';' read -ra ncu_runs <<< "$runs"
  for run in "${ncu_runs[@]}"; do
    mode=${run%%=*}; probe_args=${run#*=}
    timeout ${NCU_TIMEOUT:-300} "$NCU" --clock-control none --metrics gpu__time_duration.sum --print-units base \
        --csv $PY -m benchmarks.kernel_probe $probe_args \
        > "$OUT/ncu-$mode-kernels.csv" 2> "$OUT/ncu-$mode.log"
    # The longest launch: its name and how many launches of that name come before it
    # (Mosaic GPU names every kernel alike; the program launches the same kernels in the
    # same order every run).
    read -r name skip < <($PY -c '
import csv, re, sys
rows = [r for r in csv.reader(l for l in open(sys.argv[1]) if l.startswith("\""))]
head, rows = rows[0], rows[1:]
n, v = head.index("Kernel Name"), head.index("Metric Value")
# XLA fusions (random inputs, pads, slices) are not the attention kernels.
ours = [i for i in range(len(rows)) if "fusion" not in rows[i][n]] or list(range(len(rows)))
us = [float(r[v].replace(",", "")) / 1e3 for r in rows]
top = max(ours, key=lambda i: us[i])
# The last call: from the last run of the longest kernel name on.
last = [j for j in ours if rows[j][n] == rows[top][n]][-1]
first = max(j for j in range(last + 1) if rows[j][n] == rows[top][n] and
            (j == 0 or rows[j - 1][n] != rows[top][n]))
# NCU_RANK=k: the k-th longest launch from the first of the last runs of the longest
# kernel on (a window that may hold several calls: the fold of the split decode is rank 5 at
# B=1 131072 keys, not 2; 1: the longest).
rank = int(sys.argv[2]) if len(sys.argv) > 2 else 1
mine = sorted((j for j in ours if j >= first), key=lambda j: -us[j])
i = mine[min(rank, len(mine)) - 1]
skip = sum(r[n] == rows[i][n] for r in rows[:i])
print("regex:^" + re.escape(rows[i][n]) + "$", skip)
print("the last call:", "; ".join("%s %.1f us" % (rows[j][n][:40], us[j])
      for j in range(first, len(rows))), file=sys.stderr)' "$OUT/ncu-$mode-kernels.csv" ${NCU_RANK:-1})
    echo "ncu $mode: the longest kernel $name (after $skip of that name)"
    [[ -n "${NCU_LIST_ONLY:-}" ]] && continue  # the launches and their times only
    timeout ${NCU_TIMEOUT:-300} "$NCU" --clock-control none --set full --import-source yes \
        -k "$name" --launch-skip "$skip" --launch-count 1 -f -o "/tmp/ncu-$mode" \
        $PY -m benchmarks.kernel_probe $probe_args >> "$OUT/ncu-$mode.log" 2>&1
    "$NCU" --import "/tmp/ncu-$mode.ncu-rep" --page details > "$OUT/ncu-$mode-details.txt" 2>&1
    if [[ -n "${NCU_SASS:-}" ]]; then  # the source view, per instruction (NCU_SASS=1)
      "$NCU" --import "/tmp/ncu-$mode.ncu-rep" --page source --csv --print-source sass \
          > "$OUT/ncu-$mode-sass.csv" 2>&1 || true
    fi
    grep -E "Duration|Compute \(SM\) Throughput|DRAM Throughput|Issue Slots Busy|No Eligible|Registers Per|Block Limit (Reg|Shared)|Theoretical Occupancy|Achieved Occupancy" \
        "$OUT/ncu-$mode-details.txt" | head -16
  done
fi
if has cp; then
  # Multi-GPU hosts only (nvidia-h200-x2/x4/x8): shard_map CP vs one GPU, tokens/s, bytes.
  NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 timeout ${CP_TIMEOUT:-540} $PY -m benchmarks.cp_bench \
      --out_dir="$OUT/cp" ${CP_ARGS:-} 2>&1 | tee "$OUT/cp.txt" | tail -14
  status=$((status | ${PIPESTATUS[0]}))
fi
if has mosaic; then
  # The Mosaic GPU prototypes (docs/mosaic.md): lowering/interpret tests on this JAX, then
  # the first real run (accuracy, hangs, bits across configs and against Pallas).
  $PY -m pytest -q -p no:cacheprovider tests/test_mosaic_probe.py tests/test_mosaic_bwd_probe.py \
      2>&1 | tee "$OUT/mosaic-pytest.txt" | tail -5
  timeout ${MOSAIC_TIMEOUT:-300} $PY -m benchmarks.mosaic_gpu_check --out_dir="$OUT/mosaic" \
      ${MOSAIC_ARGS:-} 2>&1 | tee "$OUT/mosaic.txt" | tail -20
  status=$((status | ${PIPESTATUS[0]}))
fi
if has spc; then
  # MosaicConfig.splits_per_cta (docs/notes.md "2026-12-05 (third)"): several SPLITs a
  # CTA of the split decode. Its bits against one split a CTA first (a hang is a
  # barrier bug: the timeout ends it), then, only if they hold, the decode steps beside
  # the default (None: fill the CTA slots once; 2; 4) and the paged cache. SPC_PARTS
  # picks parts (bits,decode,paged), so that each call stays under the device's 10
  # minutes.
  SPC_PARTS=${SPC_PARTS:-bits,decode,paged}
  mkdir -p "$OUT/spc"
  rc=0
  if part bits "$SPC_PARTS"; then
    timeout ${SPC_TESTS_TIMEOUT:-300} $PY -m pytest -q -x -n 0 -p no:cacheprovider \
        tests/test_mosaic_backend.py -k splits_per_cta 2>&1 | tee "$OUT/spc/bits.txt" | tail -3
    rc=${PIPESTATUS[0]}; status=$((status | rc))
  fi
  if [[ $rc == 0 ]] && part decode "$SPC_PARTS"; then
    timeout ${SPC_TIMEOUT:-480} $PY -m benchmarks.mosaic_gpu_check --nochecks --peers= \
        --speed_shapes= --decode_rounds=3 --out_dir="$OUT/spc/decode" \
        --decode_speed=${SPC_POINTS:-8:8192,8:32768,8:131072,1:32768,1:131072,2:4096,8:8192:4,16:8192} \
        --decode_variants=${SPC_VARIANTS:-auto:splits_per_cta=None,k2:splits_per_cta=2,k4:splits_per_cta=4} \
        2>&1 | grep -v 'Unable to initialize backend' | tee "$OUT/spc/decode.txt" | tail -40
    status=$((status | ${PIPESTATUS[0]}))
  fi
  if [[ $rc == 0 ]] && part paged "$SPC_PARTS"; then
    timeout ${SPC_PAGED_TIMEOUT:-200} $PY -m benchmarks.paged_bench --out_dir="$OUT/spc/paged" \
        --batches=8,8,1 --kv_lens=8192,32768,131072 --page_sizes=16,64 --layouts=NHD,HND \
        --backends=mosaic --mosaic_variants=auto:splits_per_cta=None 2>&1 \
        | grep -v 'Unable to initialize backend' | tee "$OUT/spc/paged.txt" | tail -30
    status=$((status | ${PIPESTATUS[0]}))
  fi
fi
if has points33; then
  # Issue 33's five points as its table gives them (B S D mask), forward and forward +
  # backward, beside JAX cuDNN and torch cuDNN: one attention_bench process a point.
  for pt in ${POINTS33:-2:4096:128:c 16:1024:128:c 1:16384:128:c 2:4096:64:c 2:4096:128:n}; do
    IFS=: read -r pb ps pd pm <<< "$pt"
    tag=${pt//:/-}
    mask=--causal; modes=fwd,fwdbwd
    [[ $pm == n ]] && { mask=--nocausal; modes=fwd; }
    echo "== point B=$pb S=$ps D=$pd $mask"
    timeout ${POINTS33_TIMEOUT:-120} $PY -m benchmarks.attention_bench --batch=$pb \
        --seq_lens=$ps --head_dim=$pd $mask --modes=$modes --iters=5 --sample_ms=30 \
        --backends=${POINTS33_BACKENDS:-jaxattn:mosaic,cudnn,torch_cudnn} \
        --out_dir="$OUT/points33/$tag" 2>&1 | grep -v 'Unable to initialize backend' \
        > "$OUT/points33-$tag.txt"
    rc=${PIPESTATUS[0]}; grep '^| fwd' "$OUT/points33-$tag.txt"; echo "rc=$rc"
    status=$((status | rc))
  done
fi
if has fwd33; then
  # Issue 33's forward sweep (B * S = 32k tokens, S 1k to 32k) beside torch cuDNN and
  # JAX cuDNN, one process per head dim and mask (FWD33_RUNS: 128c 128n 64c 64n, c
  # causal, n not); FWD33_VARIANTS: the Mosaic forward's launch variants (the default
  # twice: the spread within one process; each variant's bits against the first's are
  # in its rows); FWD33_BWD=1 adds the backward (with the run's mask) with BWD33_VARIANTS.
  mkdir -p "$OUT/fwd33"
  for name in ${FWD33_RUNS:-128c 128n 64c 64n}; do
    d=${name%?}; c=--nospeed_causal; [[ $name == *c ]] && c=--speed_causal
    timeout ${FWD33_TIMEOUT:-150} $PY -m benchmarks.mosaic_gpu_check --nochecks --speed \
        --peers=cudnn,torch_cudnn --iters=${FWD33_ITERS:-5} --speed_head_dim=$d $c \
        --speed_shapes=${FWD33_SHAPES:-32:1024,16:2048,8:4096,4:8192,2:16384,1:32768} \
        --fwd_variants=${FWD33_VARIANTS:-default,default2} \
        ${FWD33_BWD:+--backward_speed --bwd_variants=${BWD33_VARIANTS:-default,default2}} \
        --out_dir="$OUT/fwd33/d$name" 2>&1 | grep -v 'Unable to initialize backend' \
        | tee "$OUT/fwd33/d$name.txt" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if has mprof; then
  # Where a prefill's time goes per item: benchmarks/mosaic_profile.py (Mosaic GPU's
  # on-device profiler over the forward's named scopes), one process per run of
  # MPROF_RUNS (64c 64n 128c ...: head dim, causal or not) at MPROF_SHAPES (B:S,...)
  # for each of MPROF_CONFIGS (name:key=value...); MPROF_ARGS: more flags (--blocks:
  # each key block's ranges too, at small batches).
  mkdir -p "$OUT/mprof"
  for name in ${MPROF_RUNS:-64n}; do
    d=${name%?}; c=--nocausal; [[ $name == *c ]] && c=--causal
    timeout ${MPROF_TIMEOUT:-240} $PY -m benchmarks.mosaic_profile --head_dim=$d $c \
        --shapes=${MPROF_SHAPES:-4:1024,1:4096} --configs=${MPROF_CONFIGS:-default:} \
        ${MPROF_ARGS:-} --out_dir="$OUT/mprof/d$name" 2>&1 | grep -v 'Unable to initialize backend' \
        | tee "$OUT/mprof/d$name.txt" | tail -8
    status=$((status | ${PIPESTATUS[0]}))
  done
fi
if has timeline; then
  # Back-to-back calls' kernels as they ran (durations, gaps, PDL overlap):
  # benchmarks/kernel_timeline.py with TIMELINE_ARGS (a decode step by default).
  # The SM clock, power and throttle reasons are logged beside it every 20 ms
  # (timeline/clk.csv; with --hold_s the binary prints each configuration's wall times).
  # The throttle reasons' field is clocks_event_reasons since driver 535 (an unknown
  # field makes nvidia-smi log nothing); the help is read whole, not piped to grep -q
  # (whose early exit fails the pipe under pipefail).
  mkdir -p "$OUT/timeline"
  reasons=clocks_event_reasons.active
  fields=$(nvidia-smi --help-query-gpu 2>/dev/null)
  [[ $fields == *"$reasons"* ]] || reasons=clocks_throttle_reasons.active
  nvidia-smi --query-gpu=timestamp,clocks.current.sm,power.draw,temperature.gpu,$reasons \
      --format=csv -lms 20 > "$OUT/timeline/clk.csv" 2>&1 &
  clk_pid=$!
  timeout ${TIMELINE_TIMEOUT:-240} $PY -m benchmarks.kernel_timeline ${TIMELINE_ARGS:-} \
      --out_dir="$OUT/timeline" 2>&1 | grep -v 'Unable to initialize backend' \
      | tee "$OUT/timeline.txt" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
  kill $clk_pid 2>/dev/null; wait $clk_pid 2>/dev/null
  # each configuration's hold and timed steps in the clock log
  [[ -s "$OUT/timeline/timeline.json" ]] && $PY -c 'import sys; from benchmarks import report
report.print_clock_windows(*sys.argv[1:])' "$OUT/timeline/timeline.json" "$OUT/timeline/clk.csv" \
      2>&1 | tee -a "$OUT/timeline.txt"
fi
if has ablate; then
  # Where the forward's time goes: benchmarks/ablate.py (ABLATE_ARGS, e.g.
  # "--ablations=exp_free,no_rowmax --runs=64c --shapes=8:4096"): each named part of the
  # kernel taken away in a copy of the package (wrong answers, timed only), a process
  # each between two unedited ones, torch cuDNN beside.
  timeout ${ABLATE_TIMEOUT:-540} $PY -m benchmarks.ablate --out_dir="$OUT/ablate" \
      ${ABLATE_ARGS:-} 2>&1 | grep -v 'Unable to initialize backend' \
      | tee "$OUT/ablate.txt" | tail -30
  status=$((status | ${PIPESTATUS[0]}))
fi
if has mosaicspeed; then
  # The forward variants' TFLOP/s beside the Pallas backend, Pallas mha and cuDNN (no
  # checks); MOSAIC_SPEED_ARGS e.g. "--fwd_variants=pp,pp3:stages=3 --backward_speed".
  timeout ${MOSAIC_TIMEOUT:-300} $PY -m benchmarks.mosaic_gpu_check --nochecks --speed \
      --out_dir="$OUT/mosaic-speed" ${MOSAIC_SPEED_ARGS:-} 2>&1 \
      | grep -v 'Unable to initialize backend' | tee "$OUT/mosaic-speed.txt" | tail -40
  status=$((status | ${PIPESTATUS[0]}))
fi
if has variants; then
  timeout ${VARIANTS_TIMEOUT:-240} $PY -m benchmarks.tune --what=variants 2>&1 \
      | tee "$OUT/variants.txt" | tail -12
  status=$((status | ${PIPESTATUS[0]}))
fi
if has launch; then
  # The prefill forward's launch options beside Pallas mha (benchmarks/tune.py).
  timeout ${LAUNCH_TIMEOUT:-300} $PY -m benchmarks.tune --what=launch ${LAUNCH_ARGS:-} 2>&1 \
      | grep -v 'Unable to initialize backend' | tee "$OUT/launch.txt" | tail -30
  status=$((status | ${PIPESTATUS[0]}))
fi
if has e2e; then
  # E2E_ARGS e.g. "--norollout --measure_cost --cost_layers=4": the cost alone.
  timeout ${E2E_TIMEOUT:-420} $PY -m examples.qwen3_rollout_parity --size=qwen3-8b \
      ${E2E_ARGS:---measure_cost --cost_batch=2 --cost_seq_len=2048} 2>&1 \
      | tee "$OUT/e2e.txt" | tail -12
  status=$((status | ${PIPESTATUS[0]}))
fi
# The device tool brings back at most 8 files from $OUT (and none more than 2 folders
# down): past 7 files, or with a file deeper, everything goes back as one
# $OUT/results.tgz (PACK=0: never).
if [[ ${PACK:-1} != 0 ]] && { (( $(find "$OUT" -type f | wc -l) > 7 )) \
    || [[ -n $(find "$OUT" -mindepth 4 -type f | head -1) ]]; }; then
  tar czf "/tmp/jaxattn-results-$$.tgz" -C "$OUT" . && rm -rf "${OUT:?}"/* \
      && mv "/tmp/jaxattn-results-$$.tgz" "$OUT/results.tgz" \
      && echo "== packed into \$OUT/results.tgz (tar xzf it)"
fi
exit $status
