#!/usr/bin/env bash
# The GPU engine's checks and benchmark in one command on the H200 (bench/README.md, GPU).
#
#   bench/gpu_engine.sh [tests] [bench] [serve] [quick] [mla_moe_tests] [mla_tests] [mla_moe]
#                       [moe_parts] [ds_step] [ds_serve] [pd_ipc] [served] [spec] [gc_pause]
#                       [startup] [sdpa] [mla_paths] [mla_engine_tests] [moe_probe]
#                       [spec_tests] [spec_diag] [overlap] [moe_fp8] [fp8_tests] [ds_step_fp8] [ds_serve_fp8]
#
# Unpacks the bundle (../shared/gpu/README.md), restores TileLang's kernel cache when a
# previous run left one in .tlcache/ (saved again to $OUT/tlcache.tar.xz at the end), then
# runs what is asked: the CUDA tests of the engine, the full benchmark with transformers
# (JSON to $OUT/gpu_engine.json), ferry serve --device cuda end to end, or a quick
# benchmark of two decode points; for DeepSeek-V3-class models: the MLA and MoE kernels'
# CUDA tests with the engine's MoE/MLA CUDA tests (mla_tests: the MLA kernel's alone;
# mla_engine_tests: the engine's MLA/MoE CUDA tests alone), their
# benchmark (bench/mla_moe_speed.py; MLA_MOE_SECTIONS picks sections), a MoE prefill stage
# by stage (bench/moe_prefill_parts.py) and its TileLang gate/up kernel in variants
# (bench/moe_gemm_probe.py) and with FP8 expert weights (bench/moe_fp8.py; fp8_tests: the FP8
# kernels' and FP8 engine's CUDA tests), the whole decode step of dummy:deepseek-v3-4l (with
# --quantization fp8: ds_step_fp8), and ferry serve answering it (ds_serve_fp8: FP8; aggregated:
# two copies of its 74 GB do not fit one GPU); aggregated vs 1P+1D over CUDA IPC on one GPU
# at the 8B shape (bench/pd_serving.py; lengths in words: 128 words is ~700 tokens of the dummy
# models' byte tokenizer, 390 words ~2k); the served path at load: TPOT p50 of ferry serve
# (aggregated, 8B shape, decode-heavy, concurrency 64) against the engine's own batch-64
# step (schedule + runner + update) in the same run; the first 64 requests warm the server up
# (kernel compiles) and the second point, under the same key, is the one recorded (its
# prompts are the first's: ~half its prompt tokens come from the prefix cache); ds_serve
# keeps the server's log in $OUT/logs; speculative
# decoding's CUDA tests (graphs, sync-free steps, the drafters on the device) and its arms
# (bench/spec_decode_gpu.py; SPEC_FLAGS adds flags; spec_diag: its diagnoses alone);
# overlap on vs off for plain, penalized and structured
# requests (bench/overlap.py); a full garbage collection of the 8B engine before
# and after freezing its startup (bench/gc_pause.py); the start-up of dummy:deepseek-v3-4l
# with an empty kernel cache and again with the one it left, and its first requests
# (bench/startup.py; STARTUP_FLAGS adds flags, e.g. --profile-first); SDPA's backends on the MLA prefill's shapes (bench/sdpa_backends.py);
# a chunk's MLA attention decompressed against absorbed by chunk length (bench/mla_paths.py).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
tar -xJf .gpu/site.tar.xz -C /tmp
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=/tmp/tlcache
export TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}'  # the key a CPU-built cache has
mkdir -p "$TILELANG_CACHE_DIR"
[ -f .tlcache/tlcache.tar.xz ] && tar -xJf .tlcache/tlcache.tar.xz -C "$TILELANG_CACHE_DIR"
COMMIT=$(cat .tlcache/commit 2>/dev/null || echo unknown)
nvidia-smi --query-gpu=name,memory.used,clocks.sm,clocks.mem --format=csv,noheader
status=0
for step in "$@"; do
  start=$(date +%s)
  step_limit="LIMIT_$step"  # seconds a step may take: LIMIT_<step>, else STEP_TIMEOUT
  LIMIT="timeout ${!step_limit:-${STEP_TIMEOUT:-3600}}"
  case $step in
    tests)
      python3 -m pytest -q -n 16 --noconftest -p no:cacheprovider tests/kernels -k "${KERNELS_K:-}" \
        2>&1 | tee "$OUT/kernel_tests.log" | tail -8 || status=1
      python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py \
        tests/engine/test_cuda_sync_free.py tests/engine/test_cuda_model.py \
        2>&1 | tee "$OUT/tests.log" | tail -25 || status=1 ;;
    quick)
      python3 -m bench.gpu_engine --points 1x1024,64x1024 --eager-points 1x1024 \
        --prefill 2048 --repeats 10 --commit "$COMMIT" --out "$OUT/quick.json" \
        2>&1 | tee "$OUT/quick.log" | grep -v Warning | tail -20 || status=1 ;;
    bench)
      python3 -m bench.gpu_engine --hf --commit "$COMMIT" --out "$OUT/gpu_engine.json" \
        2>&1 | tee "$OUT/bench.log" | grep -v Warning | tail -30 || status=1 ;;
    mla_moe_tests)
      $LIMIT python3 -m pytest -q -p no:cacheprovider tests/kernels/test_mla_moe_cuda.py \
        tests/kernels/test_mla_moe_references.py tests/engine/test_cuda_mla_moe_kernels.py \
        "tests/engine/test_cuda_graphs.py::test_cuda_graph_decode_of_moe_models_matches_eager" \
        tests/kvstore/test_transport_cuda_ipc.py 2>&1 | tee -a "$OUT/steps.log" | tail -25 || status=1 ;;
    mla_engine_tests)
      $LIMIT python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_mla_moe_kernels.py \
        2>&1 | tee -a "$OUT/steps.log" | tail -15 || status=1 ;;
    mla_tests)
      $LIMIT python3 -m pytest -q -n 8 -p no:cacheprovider tests/kernels/test_mla_moe_cuda.py \
        -k mla 2>&1 | tee -a "$OUT/steps.log" | tail -15 || status=1 ;;
    moe_parts)
      $LIMIT python3 -m bench.moe_prefill_parts --commit "$COMMIT" --out "$OUT" \
        2>&1 | tee -a "$OUT/steps.log" | tail -24 || status=1 ;;
    moe_fp8)
      $LIMIT python3 -m bench.moe_fp8 --commit "$COMMIT" --out "$OUT" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v TileLang | tail -8 || status=1 ;;
    fp8_tests)
      $LIMIT python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_cuda.py \
        tests/kernels/test_fp8_references.py tests/engine/test_fp8_experts.py \
        tests/engine/test_cuda_mla_moe_kernels.py 2>&1 | tee -a "$OUT/steps.log" | tail -15 || status=1 ;;
    moe_probe)
      $LIMIT python3 -m bench.moe_gemm_probe --commit "$COMMIT" --out "$OUT" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v TileLang | tail -40 || status=1 ;;
    mla_moe)
      $LIMIT python3 -m bench.mla_moe_speed --commit "$COMMIT" --out "$OUT" \
        --sections "${MLA_MOE_SECTIONS:-mla,moe,router}" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v Warning | tail -40 || status=1 ;;
    ds_step|ds_step_fp8)
      quant=none; [ "$step" = ds_step_fp8 ] && quant=fp8
      $LIMIT python3 -m bench.gpu_engine --preset deepseek-v3-4l --quantization $quant \
        --points 1x1024,64x1024,256x1024 --eager-points "$([ $quant = none ] && echo 1x1024)" \
        --skinny-ab "" --prefill 4096 --profile-prefill --engine-step "" --repeats 10 \
        --commit "$COMMIT" --out "$OUT/gpu_engine_deepseek_v3_4l$([ $quant = fp8 ] && echo _fp8).json" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v Warning | tail -12 || status=1 ;;
    ds_serve|ds_serve_fp8)
      quant=none; [ "$step" = ds_serve_fp8 ] && quant=fp8
      $LIMIT python3 -m bench.pd_serving --model dummy:deepseek-v3-4l --topologies aggregated \
        --concurrency 1 8 --num-requests 4 16 --input-len 256 --output-len 64 --logs "$OUT/logs" \
        --serve-flags "--device cuda --dtype bfloat16 --max-model-len 4096 --kv-cache-memory-gb 8 --quantization $quant" \
        --commit "$COMMIT" --out "$OUT/serve_deepseek_v3_4l$([ $quant = fp8 ] && echo _fp8).json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -8 || status=1 ;;
    pd_ipc)
      $LIMIT python3 -m bench.pd_serving --model dummy:llama3-8b --topologies aggregated pd-ipc \
        --workloads 128x256 390x128 --concurrency 1 16 64 --num-requests 4 32 128 \
        --serve-flags "--device cuda --dtype bfloat16 --max-model-len 4096 --kv-cache-memory-gb 16" \
        --commit "$COMMIT" --out "$OUT/pd_ipc_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -14 || status=1 ;;
    served)
      $LIMIT python3 -m bench.gpu_engine --points 64x1024 --eager-points "" --skinny-ab "" \
        --prefill "" --engine-step 64x1024 --repeats 10 --commit "$COMMIT" \
        --out "$OUT/served_engine_step.json" 2>&1 | tee -a "$OUT/steps.log" | tail -6 || status=1
      $LIMIT python3 -m bench.pd_serving --model dummy:llama3-8b --topologies aggregated \
        --workloads 128x256 --concurrency 64 64 --num-requests 64 128 \
        --serve-flags "--device cuda --dtype bfloat16 --max-model-len 4096 --kv-cache-memory-gb 16" \
        --commit "$COMMIT" --out "$OUT/served_c64_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -4 || status=1 ;;
    spec_tests)
      $LIMIT python3 -m pytest -q -p no:cacheprovider tests/engine/test_cuda_graphs.py \
        tests/engine/test_cuda_sync_free.py tests/engine/test_piecewise_graphs.py \
        tests/engine/test_cuda_device_drafters.py tests/engine/test_cuda_mla_moe_kernels.py \
        tests/bench/test_spec_decode_bench.py 2>&1 | tee -a "$OUT/steps.log" | tail -25 || status=1 ;;
    spec)
      $LIMIT python3 -m bench.spec_decode_gpu ${SPEC_FLAGS:-} --out "$OUT/spec_decode_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -12 || status=1 ;;
    spec_diag)
      $LIMIT python3 -m bench.spec_decode_gpu --diagnose-only --out "$OUT/spec_diag.json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -6 || status=1 ;;
    overlap)
      $LIMIT python3 -m bench.overlap --commit "$COMMIT" --out "$OUT/overlap_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | tail -8 || status=1 ;;
    startup)
      $LIMIT python3 -m bench.startup --model dummy:deepseek-v3-4l --commit "$COMMIT" ${STARTUP_FLAGS:-} \
        --serve-flags "--device cuda --dtype bfloat16 --max-model-len 4096 --kv-cache-memory-gb 8" \
        --out "$OUT/startup_h200.json" 2>&1 | tee -a "$OUT/steps.log" | grep -v Warn | tail -3 || status=1 ;;
    mla_paths)
      $LIMIT python3 -m bench.mla_paths --out "$OUT/mla_paths_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v Warn | tail -30 || status=1 ;;
    sdpa)
      $LIMIT python3 -m bench.sdpa_backends --out "$OUT/sdpa_backends_h200.json" \
        2>&1 | tee -a "$OUT/steps.log" | grep -v Warn | tail -22 || status=1 ;;
    gc_pause)
      $LIMIT python3 -m bench.gc_pause --device cuda --model dummy:llama3-8b --dtype bfloat16 \
        --out "$OUT/gc_pause_h200.json" 2>&1 | tee -a "$OUT/steps.log" | tail -2 || status=1 ;;
    serve)
      python3 -m pytest -q -x -p no:cacheprovider tests/server/test_serve_cuda.py \
        2>&1 | tee "$OUT/serve.log" | tail -15 || status=1 ;;
  esac
  echo "== $step: $(( $(date +%s) - start )) s"
done
tar -cJf "$OUT/tlcache.tar.xz" -C "$TILELANG_CACHE_DIR" . && ls -la "$OUT/tlcache.tar.xz"
exit $status
