#!/usr/bin/env bash
# One command for the GPU machine: build everything, run the GPU tests, the sanitizers and the
# benchmarks, and leave logs and results under $OUT.
#
#   scripts/device.sh [phase ...]      phases: build test check sanitize bench-decode
#                                      bench-replay overhead (default: all, in that order);
#                                      also prebuilt, build-lib, bench-direct, bench-tpw,
#                                      bench-variant,
#                                      bench-pdl,
#                                      bench-replay-bpc1, profile, test-replay,
#                                      profile-replay, profile-replay-peer,
#                                      profile-source,
#                                      profile-replay-source, profile-decode-source,
#                                      test-decode, test-stream, profile-memory,
#                                      trace-stream, bench-bulk, test-prefill,
#                                      sanitize-prefill, bench-prefill, sass-hopper,
#                                      profile-prefill, prefill-sass,
#                                      test-layer, sanitize-layer, bench-layer, profile-layer,
#                                      test-verify, bench-verify, bench-verify-variants,
#                                      test-replay-verify, bench-replay-verify,
#                                      test-state-format, ab-prefill,
#                                      test-quant-decode, bench-quant-decode,
#                                      ab-replay-verify, profile-replay-verify
#
# Expects the wheels it needs in .whl/ (apache-tvm-ffi, fla-core), and for a build GoogleTest's
# sources in .deps/googletest and the nvidia-cutlass wheel (CuTe's headers) in .deps/ (all
# carried; see docs/DEVICE.md), and a CUDA toolkit with nvcc. Every phase
# appends to $OUT/<phase>.log; the bench phases also write their JSON results to $OUT. Exits
# non-zero on the first failing phase.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
BUILD=${BUILD:-build-device}
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(build test check sanitize bench-decode bench-replay overhead)

export PYTHONUNBUFFERED=1
wheels=$(ls .whl/*.whl .deps/*.whl 2>/dev/null)
if [ -n "$wheels" ]; then
  # shellcheck disable=SC2086  # one word per wheel
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export DELTASTATE_MODULE=$PWD/$BUILD/python/_deltastate.so
export PYTHONPATH=$PWD/python:$PWD/bench:${PYTHONPATH:-}

run() {  # run <phase> <command...>: log to $OUT/<phase>.log, stop on failure
  local phase=$1; shift
  echo "=== $phase: $*" | tee -a "$OUT/$phase.log"
  local t0=$SECONDS
  "$@" 2>&1 | tee -a "$OUT/$phase.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $phase: rc=$rc in $((SECONDS - t0)) s" | tee -a "$OUT/$phase.log"
  [ "$rc" -eq 0 ] || exit "$rc"
}

gtest_sharded() {  # gtest_sharded <phase> <filter>: the GPU suite's matching tests in 4 parallel
  # shards (their CPU references dominate the run time), environment passed through
  local phase=$1 filter=$2 rc=0 s pids=()
  for s in 0 1 2 3; do
    GTEST_TOTAL_SHARDS=4 GTEST_SHARD_INDEX=$s "$BUILD/tests/deltastate_gpu_tests" --gtest_brief=1 \
      --gtest_filter="$filter" > "$OUT/.shard$s" 2>&1 &
    pids+=($!)
  done
  for s in "${pids[@]}"; do wait "$s" || rc=1; done
  cat "$OUT"/.shard? >> "$OUT/$phase.log"; grep -h -E "PASSED|FAILED" "$OUT"/.shard?; rm -f "$OUT"/.shard?
  return $rc
}

ncu_launch() {  # ncu_launch <kernel regex> <launches to skip> <ncu options and command...>:
  # Nsight Compute on one launch of the matching kernel, clocks as they run
  local kernel=$1 skip=$2
  shift 2
  run profile ncu --clock-control none -k "regex:$kernel" --launch-skip "$skip" --launch-count 1 "$@"
}

replay_sass() {  # per-SASS-instruction counters of one ReplaySSM appending step (CSV)
  ncu_launch replay 8 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 bench/profile_decode.py --replay 16 ${PROFILE_ARGS:-} > "$OUT/replay-sass.csv"
}

decode_sass() {  # per-SASS-instruction counters of one plain decode launch (CSV; PROFILE_KERNEL:
  # the kernel's name pattern, default the recurrent op's decode kernels)
  ncu_launch "${PROFILE_KERNEL:-recurrent}" 2 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 bench/profile_decode.py --no-peer ${PROFILE_ARGS:-} > "$OUT/decode-sass.csv"
}

verify_variants() {  # the multi-token kernel's shapes side by side (tuning.h MultiVariant): T = 4,
  # Qwen3-Next, one JSON per shape, "auto" the default choice
  local v
  for v in auto base stage two stage2; do
    if [ "$v" = auto ]; then unset DELTASTATE_CUDA_MULTI_VARIANT
    else export DELTASTATE_CUDA_MULTI_VARIANT=$v; fi
    run bench-verify python3 bench/bench_verify.py --tokens 4 --batches 8,64,256 \
      --dtypes f32,bf16 --models qwen3-next --no-peer --json "$OUT/verify-variant-$v.json"
  done
  unset DELTASTATE_CUDA_MULTI_VARIANT
}

sanitized() {  # sanitized <tool> <filter>: compute-sanitizer on the GPU suite's matching tests
  run sanitize compute-sanitizer --tool "$1" --error-exitcode 3 "$BUILD/tests/deltastate_gpu_tests" \
    --gtest_filter="$2"
}

# The chunk_prefill GPU tests, and their small cases for the sanitizers (GVA, K = V = 64, the
# fallback's odd shape: few CTAs, every kernel path; one TP4 sequence: the Hopper kernels'
# context parallelism).
PREFILL_TESTS='*ChunkPrefill*:*PrefillGpuTest*'
PREFILL_SMALL='*GpuChunkPrefill*gva*:*GpuChunkPrefill*k64*:*GpuChunkPrefill*fallback_gdn_odd*:*GpuChunkPrefill*tp4_dense*'

# The conv update and the fused decode layer step's GPU tests (each fused-step kernel runs them
# forced), and the cluster kernel's small cases for racecheck (clusters of 8, 4 and 6 CTAs).
LAYER_TESTS='*FusedStepGpu*:*FusedReplay*:*ConvUpdateGpu*:*ConvVerifyGpu*'
LAYER_SMALL='*FusedStepGpu*group4*:*FusedStepGpu*kda_cluster4*:*FusedStepGpu*odd_v*'

# The decode-shaped GPU tests (each decode kernel runs them forced).
DECODE_TESTS='*Packed*:*4096*:*Graph*:*Pdl*'

forced_decode_tests() {  # forced_decode_tests <kernel> [tiles per warp]: DECODE_TESTS with one
  # decode kernel forced (and, given, the decode kernel's tiles per warp)
  DELTASTATE_CUDA_DECODE=$1 DELTASTATE_CUDA_DECODE_TPW=${2:-} run test gtest_sharded test \
    "$DECODE_TESTS"
}

# The quantized decode GPU tests (each quantized decode kernel runs them forced).
QUANT_TESTS='*Quantized*:*Quant*:*StateFormat*'

forced_quant_tests() {  # forced_quant_tests <mma|mma2>: QUANT_TESTS on one or two tiles a warp
  DELTASTATE_CUDA_QUANT_DECODE=$1 run test gtest_sharded test "$QUANT_TESTS"
}

stream_sanitized() {  # the streaming kernel forced under memcheck and racecheck (shared-memory
  # stages, bulk copies, mbarriers); B=64 / B=8 so that each CTA walks many tiles through them
  DELTASTATE_CUDA_DECODE=stream sanitized memcheck '*partial_tile*:*B3*:*k64_*:*B64*'
  DELTASTATE_CUDA_DECODE=stream sanitized racecheck '*partial_tile*:*B8*'
}

configure() {  # every CUDA kernel specialization, the Python module in the build tree
  run build cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DDELTASTATE_CUDA=ON -DDELTASTATE_CUDA_ALL_KERNELS=ON -DDELTASTATE_BUILD_PYTHON=ON \
    -DPython_EXECUTABLE="$(command -v python3)" -DDELTASTATE_GTEST_SOURCE="$PWD/.deps/googletest" \
    ${CMAKE_ARGS:-}
}

for phase in "${phases[@]}"; do
  case $phase in
    build)
      run build nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv
      configure
      run build cmake --build "$BUILD" -j "$(nproc)"
      ;;
    prebuilt)  # instead of build, with BUILD=.devrun/prebuilt: unpack the binaries that
      # scripts/prebuild.sh packed on the CPU machine (the Python module, the GPU tests; no CPU
      # tests, CLI or benchmark builds, so not for `test`, `check` or `bench-bulk`)
      run build cat "$BUILD/COMMIT"
      run build find "$BUILD" -name '*.xz' -exec xz -d {} +
      run build chmod +x "$BUILD/tests/deltastate_gpu_tests"
      ;;
    build-lib)  # the library and the Python module only (benchmarks, checks)
      configure
      run build cmake --build "$BUILD" -j "$(nproc)" --target deltastate_python
      ;;
    test)
      # every GPU test (4 parallel shards: their CPU references dominate the run time)
      run test gtest_sharded test '*'
      # every decode kernel on every decode-shaped case (the default picks one per call)
      for k in direct stream decode; do forced_decode_tests $k; done
      # the decode kernel with 2 tiles per warp forced (the default picks 2 only for
      # grids of more than one wave, which the suite's cases are not)
      forced_decode_tests decode 2
      # ReplaySSM with one and with two row blocks per CTA forced (the default picks by grid size),
      # and the tensor-core and one-warp kernels forced on their shapes (bf16 checkpoints, K = 128)
      for bpc in 1 2; do
        DELTASTATE_CUDA_REPLAY_BPC=$bpc run test gtest_sharded test '*GpuReplay*'
      done
      DELTASTATE_CUDA_REPLAY_KERNEL=tc run test gtest_sharded test '*GpuReplay*:*FusedReplay*'
      DELTASTATE_CUDA_REPLAY_KERNEL=warp run test gtest_sharded test '*GpuReplay*:*FusedReplay*'
      run test ctest --test-dir "$BUILD" -j 8 --output-on-failure -LE gpu
      run test python3 -m pytest -q python/tests -x
      ;;
    test-verify)  # verify, its commits (states, conv windows) and the recurrent op's multi-token
      # sequences (GPU vs CPU), then the multi-token recurrent cases and every recurrent GPU test on
      # the direct kernel
      run test-verify gtest_sharded test-verify '*VerifyGpu*:*RecurrentMultiToken*:*VerifyCommit*:*VerifyAndCommit*:*ConvCommit*'
      DELTASTATE_CUDA_MULTI=direct run test-verify gtest_sharded test-verify '*RecurrentMultiToken*:*Recurrent*'
      for v in base stage two stage2; do  # each multi-token kernel shape forced
        DELTASTATE_CUDA_MULTI_VARIANT=$v run test-verify gtest_sharded test-verify \
          '*VerifyGpu*:*RecurrentMultiToken*:*VerifyAndCommit*'
      done
      DELTASTATE_CUDA_MULTI_VARIANT=stage2 sanitized racecheck '*VerifyGpu*gdn_odd*:*RecurrentMultiToken*K64*'
      sanitized memcheck '*VerifyGpu*gdn_odd*:*VerifyGpu*kda_odd*:*VerifyAndCommit*:*ConvCommit*'
      sanitized racecheck '*VerifyGpu*gdn_odd*:*RecurrentMultiToken*K64*'
      ;;
    test-state-format)  # quantized and stochastically rounded pools (issue #36): every
      # formatted-state GPU test (CUDA vs the CPU backend, the graph replays), then memcheck and
      # racecheck on the small graph cases (kOdd: every formatted kernel, few CTAs)
      run test-state-format gtest_sharded test-state-format \
        '*Quantized*:*FusedStepFmt*:*FusedReplayFmt*'
      sanitized memcheck '*QuantizedGraphReplay*:*QuantizedVerifyCommitGraph*:*QuantizedReplayGraph*'
      sanitized racecheck '*QuantizedReplayGraph*'
      ;;
    test-replay-verify)  # ReplaySSM verify and its cursor commit: GPU vs CPU over verify/commit
      # steps, a graph-captured loop against eager, bad rows recorded; then memcheck
      run test-replay-verify gtest_sharded test-replay-verify '*ReplayVerify*'
      for kernel in replay factor tc; do  # each verify kernel forced (default: replay)
        DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=$kernel run test-replay-verify gtest_sharded \
          test-replay-verify '*ReplayVerify*'
      done
      DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=factor DELTASTATE_CUDA_REPLAY_VERIFY_BPC=2 \
        run test-replay-verify gtest_sharded test-replay-verify '*ReplayVerify*'
      sanitized memcheck '*ReplayVerifyGpu*odd*:*ReplayVerifyGpuErrors*:*ReplayVerifyCommitGraph*'
      DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=replay sanitized memcheck \
        '*ReplayVerifyGpu*odd*:*ReplayVerifyGpuErrors*:*ReplayVerifyCommitGraph*'
      sanitized racecheck '*ReplayVerifyGpu*odd*:*ReplayVerifyGpu*KgtV*'
      # the tensor-core kernel on its shapes (fp32 checkpoints, K = V = 128)
      DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=tc sanitized memcheck \
        '*ReplayVerifyGpu*f32*:*ReplayVerifyGpu*t7*:*ReplayVerifyCommitGraph*'
      DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=tc sanitized racecheck '*ReplayVerifyGpu*t7*'
      ;;
    test-prefill)  # the chunk_prefill GPU tests: default choice (the Hopper GDN kernels where
      # they apply, errors printed), the Hopper kernels' context parallelism forced on every
      # one-sequence case (segments of 2 chunks), then split, fused and the CUDA-core fallback
      DSTEST_PRINT_ERRORS=1 run test-prefill gtest_sharded test-prefill "$PREFILL_TESTS"
      DELTASTATE_CUDA_PREFILL_CP=2 run test-prefill gtest_sharded test-prefill "$PREFILL_TESTS"
      for kernel in split fused fallback; do
        DELTASTATE_CUDA_PREFILL=$kernel run test-prefill gtest_sharded test-prefill "$PREFILL_TESTS"
      done
      ;;
    sanitize-prefill)  # memcheck and racecheck on the small chunk_prefill cases (the split and
      # the fused tensor-core kernels, the fallback's own case)
      for kernel in hopper split fused; do
        DELTASTATE_CUDA_PREFILL=$kernel sanitized memcheck "$PREFILL_SMALL"
        DELTASTATE_CUDA_PREFILL=$kernel sanitized racecheck "$PREFILL_SMALL"
      done
      ;;
    profile-prefill)  # per-kernel device times of chunk_prefill, ours beside FLA's
      # (PROFILE_PREFILL_CASES), then Nsight Compute on one prep and one scan launch of the Hopper
      # kernels (PROFILE_PREFILL_CASE, default 8x1024)
      run profile-prefill python3 bench/profile_prefill.py --peer \
        --cases "${PROFILE_PREFILL_CASES:-8x1024,4x2048,1x8192,tp4:1x8192}"
      run profile-prefill ncu --clock-control none -k regex:hopper --launch-skip 2 --launch-count 2 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats \
        python3 bench/profile_prefill.py --cases "${PROFILE_PREFILL_CASE:-8x1024}" --reps 1 --rotate 1
      ;;
    prefill-sass)  # per-SASS-instruction counters (stall samples) of one Hopper scan and one
      # prep launch (PROFILE_PREFILL_CASE, default 8x1024), CSV
      for k in scan prep; do
        ncu_launch "hopper_$k" 1 --section SourceCounters --section WarpStateStats --page source \
          --print-source sass --csv python3 bench/profile_prefill.py \
          --cases "${PROFILE_PREFILL_CASE:-8x1024}" --reps 1 --rotate 1 > "$OUT/prefill-$k-sass.csv"
      done
      ;;
    sass-hopper)  # the Hopper prefill kernels' resources and instruction mix (cuobjdump): wgmma,
      # local-memory spills, barriers, to $OUT/sass-hopper.txt
      lib=$BUILD/python/_deltastate.so
      run sass-hopper bash -c "cuobjdump --dump-resource-usage '$lib' | grep -A1 hopper"
      cuobjdump -sass "$lib" | awk '/Function :/ { on = /hopper/ } on' > "$OUT/sass-hopper.txt"
      run sass-hopper bash -c "awk '/Function :/ { f = \$3 } /(HGMMA|STL|LDL|BAR|SYNCS|UTMALDG)/ { \
        split(\$0, w, /[ ;]+/); for (i in w) if (w[i] ~ /^(HGMMA|STL|LDL|BAR|SYNCS|UTMALDG)/) \
        n[f \" \" w[i]]++ } END { for (k in n) print n[k], k }' '$OUT/sass-hopper.txt' | sort -k2"
      ;;
    test-replay)  # the ReplaySSM GPU tests only: default kernel choice, then each variant forced
      for bpc in 0 1 2; do
        DELTASTATE_CUDA_REPLAY_BPC=$bpc run test gtest_sharded test '*GpuReplay*'
      done
      for k in rows tc warp; do
        DELTASTATE_CUDA_REPLAY_KERNEL=$k run test gtest_sharded test '*GpuReplay*:*FusedReplay*'
      done
      ;;
    test-decode)  # the decode-shaped GPU tests with the register decode kernel forced, 1 and 2
      # tiles per warp
      forced_decode_tests decode 1
      forced_decode_tests decode 2
      ;;
    test-quant-decode)  # the quantized GPU tests on each quantized decode kernel, the tensor-core
      # kernels under memcheck
      for k in mma mma2; do forced_quant_tests $k; done
      for k in mma mma2; do
        DELTASTATE_CUDA_QUANT_DECODE=$k sanitized memcheck '*QuantizedPackedDecode*'
      done
      ;;
    bench-quant-decode)  # one and two tiles a warp side by side, alternated twice (QUANT_ARGS:
      # bench_decode.py's options), one JSON per run
      for round in 1 2; do
        for k in mma mma2; do
          DELTASTATE_CUDA_QUANT_DECODE=$k run bench-quant python3 bench/bench_decode.py --no-peer \
            ${QUANT_ARGS:---models qwen3-next --dtypes f8,f8n,i8 --batches 1,8,64,256} \
            --json "$OUT/decode-quant-$k-$round.json"
        done
      done
      ;;
    test-stream)  # the decode-shaped GPU tests with the streaming kernel forced, and its sanitizers
      forced_decode_tests stream
      stream_sanitized
      ;;
    sanitize)
      # memcheck and racecheck on the GPU suite's small cases (every op, generic and fast kernels;
      # the large ones take minutes under the sanitizer).
      sanitized memcheck "${SANITIZE_FILTER:-*k96*:*odd*:*k64_*}"
      sanitized racecheck "${RACECHECK_FILTER:-*k96*:*k64v128*}"
      # the out-of-range guard: no access past the pool on any kernel (an index far out of range
      # was an illegal address before it)
      sanitized memcheck '*Guard*'
      DELTASTATE_CUDA_DECODE=decode sanitized memcheck '*PackedGuard*'
      DELTASTATE_CUDA_DECODE=stream sanitized memcheck '*PackedGuard*:*GraphGuard*'
      stream_sanitized
      # ReplaySSM with two row blocks per CTA forced where it applies (whole heads: K=64 V=256,
      # Qwen3-Next with fp32 and bf16 checkpoints), and V=200's partial last row block (one-block
      # kernel)
      replay='*GpuReplay*v200*:*GpuReplay*k64v256*:*GpuReplay*gdn_qwen_f32_bf16act_L16*'
      replay+=':*GpuReplay*gdn_qwen_bf16ckpt*'
      DELTASTATE_CUDA_REPLAY_BPC=2 sanitized memcheck "$replay"
      DELTASTATE_CUDA_REPLAY_BPC=2 sanitized racecheck "$replay"
      # the tensor-core kernel (bf16 checkpoints, K = 128, whole heads)
      DELTASTATE_CUDA_REPLAY_KERNEL=tc sanitized memcheck '*GpuReplay*bf16ckpt*'
      DELTASTATE_CUDA_REPLAY_KERNEL=tc sanitized racecheck '*GpuReplay*bf16ckpt*'
      # the one-warp kernel (GDN, bf16 checkpoints and inputs, L <= 16), its bad-row guard too
      DELTASTATE_CUDA_REPLAY_KERNEL=warp sanitized memcheck \
        '*GpuReplay*gdn_qwen_bf16ckpt*:*GpuReplayGuard*gdn_qwen_bf16ckpt*'
      DELTASTATE_CUDA_REPLAY_KERNEL=warp sanitized racecheck '*GpuReplay*gdn_qwen_bf16ckpt*'
      # the decode kernel's shared-memory tile (2 tiles per warp forced)
      DELTASTATE_CUDA_DECODE=decode DELTASTATE_CUDA_DECODE_TPW=2 sanitized memcheck \
        '*partial_tile*:*B3*:*k64_*'
      DELTASTATE_CUDA_DECODE=decode DELTASTATE_CUDA_DECODE_TPW=2 sanitized racecheck '*partial_tile*'
      ;;
    check)
      run check python3 -m pytest -q python/tests/test_gpu_bench_shapes.py
      ;;
    bench-decode)
      run bench-decode python3 bench/bench_decode.py --json "$OUT/decode-h200.json" ${BENCH_ARGS:-}
      ;;
    bench-prefill)  # chunked prefill beside FLA (PREFILL_ARGS: --ops, --cases, --reps, --no-peer)
      run bench-prefill python3 bench/bench_prefill.py --json "$OUT/prefill-h200.json" ${PREFILL_ARGS:-}
      # PREFILL_VARIANTS="split fused": each kernel forced, without the peers (an A/B)
      for kernel in ${PREFILL_VARIANTS:-}; do
        DELTASTATE_CUDA_PREFILL=$kernel run bench-prefill python3 bench/bench_prefill.py \
          --json "$OUT/prefill-h200-$kernel.json" --no-peer ${PREFILL_ARGS:-}
      done
      ;;
    bench-variant)  # ours only, under the caller's environment (a forced kernel or variant), to
      # $OUT/$VARIANT.json (A/B comparisons within one call)
      run bench-decode python3 bench/bench_decode.py --no-peer --json "$OUT/${VARIANT:-variant}.json" \
        ${BENCH_ARGS:-}
      ;;
    ab-prefill)  # prebuilt sets side by side in one call: AB="dirA dirB ..." (scripts/prebuild.sh
      # outputs, carried), each set's Python module in turn, ROUNDS (2) times, ours only, to
      # $OUT/ab-<set>-<round>.json; PREFILL_ARGS replaces the cases (default: KDA 8x1024, 1x8192)
      for d in ${AB:?AB names the prebuilt sets}; do
        run ab-prefill find "$d" -name '*.xz' -exec xz -d {} +
        run ab-prefill cat "$d/COMMIT"
      done
      for r in $(seq "${ROUNDS:-2}"); do
        for d in $AB; do
          # shellcheck disable=SC2086  # PREFILL_ARGS: one word per option
          DELTASTATE_MODULE=$(cd "$d" && pwd)/python/_deltastate.so run ab-prefill python3 \
            bench/bench_prefill.py --no-peer --no-accuracy \
            ${PREFILL_ARGS:---ops kda --reps 3 --replays 5 --cases 8x1024,1x8192} \
            --json "$OUT/ab-$(basename "$d")-$r.json"
        done
      done
      ;;
    bench-direct)  # the register kernel forced everywhere, for the kernel-choice threshold
      DELTASTATE_CUDA_DECODE=direct run bench-direct python3 bench/bench_decode.py --no-peer \
        --json "$OUT/decode-direct.json" ${BENCH_ARGS:-}
      ;;
    bench-tpw)  # the decode kernel with 1 and 2 tiles per warp forced (TPW_DTYPES, default fp32)
      for tpw in 1 2; do
        DELTASTATE_CUDA_DECODE=decode DELTASTATE_CUDA_DECODE_TPW=$tpw run bench-tpw \
          python3 bench/bench_decode.py --no-peer --dtypes ${TPW_DTYPES:-f32} \
          --json "$OUT/decode-tpw$tpw.json" ${BENCH_ARGS:-}
      done
      ;;
    bench-replay)
      run bench-replay python3 bench/bench_replayssm.py --json "$OUT/replayssm-h200.json" ${REPLAY_ARGS:-}
      ;;
    bench-verify)  # the multi-token recurrent op and verify beside FLA (VERIFY_ARGS adds options:
      # --models, --dtypes, --tokens, --batches, --modes, --no-peer, --flashinfer), then the
      # recurrent op on the direct kernel (DELTASTATE_CUDA_MULTI=direct) for the before/after
      run bench-verify python3 bench/bench_verify.py --json "$OUT/verify-h200.json" ${VERIFY_ARGS:-}
      DELTASTATE_CUDA_MULTI=direct run bench-verify python3 bench/bench_verify.py --modes recurrent \
        --no-peer --json "$OUT/verify-direct.json" ${VERIFY_ARGS:-}
      verify_variants
      ;;
    bench-replay-verify)  # ReplaySSM verify + commit per step over whole cursor cycles (T = 4,
      # L = 8 and 16, fp32 and bf16 checkpoints) beside the intermediate-state verify
      run bench-replay-verify python3 bench/bench_replayssm_verify.py \
        --json "$OUT/replayssm-verify-h200.json" ${REPLAY_VERIFY_ARGS:-}
      ;;
    ab-replay-verify)  # the ReplaySSM verify kernels forced in turn (RV_KERNELS, default
      # "replay tc"), ROUNDS (2) times, ours only (REPLAY_VERIFY_ARGS, default fp32, L = 8 and 16,
      # B = 8, 64, 256), to $OUT/rv-<kernel>-<round>.json
      for r in $(seq "${ROUNDS:-2}"); do
        for kernel in ${RV_KERNELS:-replay tc}; do
          # shellcheck disable=SC2086  # REPLAY_VERIFY_ARGS: one word per option
          DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=$kernel run ab-replay-verify python3 \
            bench/bench_replayssm_verify.py --json "$OUT/rv-$kernel-$r.json" \
            ${REPLAY_VERIFY_ARGS:---dtypes f32 --lens 8,16 --batches 8,64,256 --no-inter}
        done
      done
      ;;
    profile-replay-verify)  # Nsight Compute on one ReplaySSM verify launch per kernel forced
      # (RV_KERNELS): Qwen3-Next fp32, T = 4, L = 16, B = 64, six eager steps; launch 3 appends
      # on 6 committed records (RV_SKIP: 4 is the fold of 10)
      for kernel in ${RV_KERNELS:-replay tc}; do
        DELTASTATE_CUDA_REPLAY_VERIFY_KERNEL=$kernel ncu_launch replay_verify "${RV_SKIP:-3}" \
          --section SpeedOfLight --section Occupancy --section WarpStateStats \
          --section LaunchStats --section SchedulerStats --section MemoryWorkloadAnalysis \
          python3 bench/bench_replayssm_verify.py --profile-steps 6 --dtypes f32 --lens 16 \
          --batches 64
      done
      ;;
    bench-verify-variants)  # only the A/B loop over the multi-token kernel's shapes (above)
      verify_variants
      ;;
    bench-pdl)  # small batches with programmatic dependent launch (ours only; B <= 64), the
      # next grid let in by the launcher's rule (auto), early (1) or at exit (2), beside pdl=False
      run bench-pdl python3 bench/bench_decode.py --no-peer --dtypes f32 \
        --batches ${PDL_BATCHES:-1,2,4,8,16,64} --json "$OUT/decode-nopdl.json"
      for trig in auto 1 2; do
        DELTASTATE_CUDA_PDL_TRIGGER=$trig run bench-pdl python3 bench/bench_decode.py --no-peer \
          --pdl --dtypes f32 --batches ${PDL_BATCHES:-1,2,4,8,16,64} --json "$OUT/decode-pdl-$trig.json"
        DELTASTATE_CUDA_PDL_TRIGGER=$trig run bench-pdl python3 bench/bench_replayssm.py --pdl \
          --dtypes f32 --lens 16 --batches ${PDL_BATCHES:-1,8,64} --json "$OUT/replayssm-pdl-$trig.json"
      done
      ;;
    bench-replay-bpc1)  # ReplaySSM with one row block per CTA forced (the kernel-choice threshold)
      DELTASTATE_CUDA_REPLAY_BPC=1 run bench-replay python3 bench/bench_replayssm.py \
        --json "$OUT/replayssm-bpc1.json" ${REPLAY_ARGS:-}
      ;;
    profile)
      # Nsight Compute on one warm launch of our decode kernel (whichever dispatch picks; force one
      # with DELTASTATE_CUDA_DECODE) and of FLA's (PROFILE_ARGS picks the case: --model, --dtype,
      # --B, --no-peer).
      for k in recurrent fused_recurrent; do
        ncu_launch $k 2 \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
          --section InstructionStats \
          python3 bench/profile_decode.py ${PROFILE_ARGS:-}
      done
      ;;
    profile-memory)
      # Nsight Compute's memory tables (DRAM, L2, L1, TMA) of one warm launch of our decode kernel
      # and of a device copy of the same state bytes (the copy-bandwidth yardstick), cold caches;
      # PROFILE_ARGS picks the case (--model, --dtype, --B)
      mem='--section SpeedOfLight --section MemoryWorkloadAnalysis --section MemoryWorkloadAnalysis_Tables'
      mem+=' --section MemoryWorkloadAnalysis_Chart --section LaunchStats --section Occupancy'
      mem+=" --print-details all"
      ncu_launch recurrent 2 \
        $mem python3 bench/profile_decode.py --no-peer ${PROFILE_ARGS:-}
      ncu_launch elementwise 2 \
        $mem python3 bench/profile_decode.py --copy ${PROFILE_ARGS:-}
      ;;
    bench-bulk)  # in-place copies in our kernels' access patterns, no compute: grid-stride 16-byte
      # copies, one tile per warp (the register decode kernel's shape), TMA bulk copies (tile size,
      # stages, CTAs per SM, slots in order or random); BULK_ARGS: --ilp-only (no bulk sweep),
      # --quick, --reps
      run bench-bulk cmake --build "$BUILD" -j "$(nproc)" --target bulk_copy_bench
      run bench-bulk "$BUILD/bulk_copy_bench" ${BULK_ARGS:-}
      ;;
    trace-stream)  # the streaming kernel's per-tile timeline: a separate trace build (build-trace/,
      # DELTASTATE_CUDA_STREAM_TRACE) and bench/stream_trace; TRACE_ARGS picks the case (--model, --B)
      run trace cmake -S . -B build-trace -G Ninja -DCMAKE_BUILD_TYPE=Release -DDELTASTATE_CUDA=ON \
        -DDELTASTATE_CUDA_ALL_KERNELS=ON -DDELTASTATE_CUDA_STREAM_TRACE=ON -DDELTASTATE_BUILD_TESTS=OFF \
        -DDELTASTATE_BUILD_TOOLS=OFF
      run trace cmake --build build-trace -j "$(nproc)" --target stream_trace
      run trace build-trace/stream_trace ${TRACE_ARGS:-}
      ;;
    profile-replay)
      # Nsight Compute on ReplaySSM launches: an appending step (cursor 8) and the flush step
      # (cursor L-1) of a ring of PROFILE_L (default 16); PROFILE_ARGS as above.
      L=${PROFILE_L:-16}
      for skip in 8 $((L - 1)); do
        ncu_launch replay $skip \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
          python3 bench/profile_decode.py --replay "$L" ${PROFILE_ARGS:-}
      done
      ;;
    profile-replay-peer)
      # The same two steps of SGLang's Triton ReplaySSM (SGLANG_PEER: its reference file or
      # folder, carried, never committed; bench/profile_decode.py --sglang), run after ours in
      # the same process, on its own copies of the pool and rings
      L=${PROFILE_L:-16}
      for skip in 8 $((L - 1)); do
        ncu_launch fused_recurrent_linear_replayssm $skip \
          --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
          --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
          python3 bench/profile_decode.py --replay "$L" --sglang "${SGLANG_PEER:-build-peers/sglang}" \
          ${PROFILE_ARGS:-}
      done
      ;;
    profile-replay-source)  # per-instruction counters of one ReplaySSM appending step only
      replay_sass
      ;;
    profile-source)
      # Per-instruction counters (SASS with executed instructions and stall samples, CSV) of one
      # ReplaySSM appending step and one plain decode launch (PROFILE_ARGS picks the case).
      replay_sass
      decode_sass
      ;;
    profile-decode-source)  # per-instruction counters of one plain decode launch only
      decode_sass
      ;;
    overhead)
      run overhead python3 bench/measure_overhead.py
      ;;
    # ---- the conv update and the fused decode layer step ----
    test-layer)  # the GPU tests with each fused-step plan forced and with the default choice
      # (which FusedStepGpuPlans needs), then the Python ones on CUDA tensors
      DELTASTATE_CUDA_FUSED=cluster run test-layer gtest_sharded test-layer "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED=cta run test-layer gtest_sharded test-layer "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED=chain run test-layer gtest_sharded test-layer "$LAYER_TESTS"
      run test-layer gtest_sharded test-layer "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED_TPW=2 run test-layer gtest_sharded test-layer '*FusedStepGpu*'
      # the ReplaySSM chain's decode with two row blocks per CTA (the default picks by grid size)
      DELTASTATE_CUDA_FUSED=chain DELTASTATE_CUDA_REPLAY_BPC=2 \
        run test-layer gtest_sharded test-layer '*FusedReplay*'
      # the conv on its vector kernel wherever that applies (the default takes it for grids of
      # two CTAs per SM up, which few of the suite's cases are) and on its scalar kernel
      for conv in vector scalar; do
        DELTASTATE_CUDA_CONV=$conv run test-layer gtest_sharded test-layer \
          '*ConvUpdateGpu*:*FusedStepGpu*:*FusedReplay*'
      done
      run test-layer python3 -m pytest -q python/tests/test_fused_step.py \
        python/tests/peer/test_causal_conv1d_update.py
      ;;
    sanitize-layer)  # memcheck with each fused-step kernel; racecheck (the CTA kernel's shared
      # conv outputs and barriers; the cluster kernel's DSMEM and cluster barriers, small cases)
      DELTASTATE_CUDA_FUSED=cluster sanitized memcheck "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED=cta sanitized memcheck "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED=chain sanitized memcheck "$LAYER_TESTS"
      DELTASTATE_CUDA_FUSED=cta sanitized racecheck '*FusedStepGpu*'
      DELTASTATE_CUDA_FUSED=cluster sanitized racecheck "$LAYER_SMALL"
      DELTASTATE_CUDA_FUSED_TPW=2 sanitized memcheck "$LAYER_SMALL"
      DELTASTATE_CUDA_FUSED_TPW=2 sanitized racecheck "$LAYER_SMALL"
      ;;
    profile-layer)  # each kernel's device time per layer step (torch.profiler; PROFILE_LAYER_ARGS)
      run profile-layer python3 bench/profile_layer_step.py ${PROFILE_LAYER_ARGS:---cases \
        qwen3-next:f32:1,qwen3-next:f32:8,qwen3-next:bf16:256,kimi-linear:bf16:256 --peer}
      ;;
    bench-layer)  # the fused step beside our unfused chain and the peer chain (LAYER_ARGS:
      # --models, --dtypes, --batches, --no-peer, --pdl)
      run bench-layer python3 bench/bench_layer_step.py --json "$OUT/layer-step-h200.json" \
        ${LAYER_ARGS:-}
      # the fused step on its CTA kernel (the A/B of the cluster kernel; no peer chain)
      DELTASTATE_CUDA_FUSED=cta run bench-layer python3 bench/bench_layer_step.py --no-peer \
        --json "$OUT/layer-step-cta-h200.json" ${LAYER_ARGS:-}
      # the cluster kernel with two tiles per warp at the batches where packed decode takes two
      DELTASTATE_CUDA_FUSED_TPW=2 run bench-layer python3 bench/bench_layer_step.py --no-peer \
        --batches 8,64,256 --json "$OUT/layer-step-tpw2-h200.json" ${LAYER_TPW2_ARGS:-}
      ;;
    *)
      echo "unknown phase $phase" >&2; exit 2 ;;
  esac
done
