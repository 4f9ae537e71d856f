#!/usr/bin/env bash
# Expert parallelism on one H200, in at most ~150 s (bench/README.md, "Expert parallelism"):
#
#   bench/ep_gpu.sh        (from the repository root, PYTHONPATH holding the bundle)
#
# 1. bench.ep_step on dummy:deepseek-v3-4l at EP 1: each engine's first MoE layer checked
#    against the torch reference, then decode steps at batch 1 and 64, the plain engine
#    against the same model through the one-rank dispatcher (graphed and eager) and the
#    all-to-all dispatcher over a one-rank NCCL group (eager); the dispatched engine then
#    records a routing trace of 200 steps at batch 64 (JSON: $OUT/ep_step_h200.json).
# 2. bench.eplb_replay of that trace at EP 8, 32 and 64 with one redundant slot per rank,
#    and the Zipf table ($OUT/eplb_replay_h200.json).
# Restores TileLang's kernel cache from .tlcache/ when there is one. Each part runs under
# its own time limit; a part that fails says so and the next still runs.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT/trace"
export PYTHONUNBUFFERED=1 TILELANG_CACHE_DIR=/tmp/tlcache
export TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}'  # the key a CPU-built cache has
mkdir -p "$TILELANG_CACHE_DIR"
[ -f .tlcache/tlcache.tar.xz ] && tar -xJf .tlcache/tlcache.tar.xz -C "$TILELANG_CACHE_DIR"
COMMIT=${COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
status=0
timeout "${LIMIT_STEP:-120}" python3 -m bench.ep_step --device cuda --model dummy:deepseek-v3-4l \
  --batches 1,64 --context 256 --steps 30 --trace "$OUT/trace" --trace-steps 200 \
  --commit "$COMMIT" --out "$OUT/ep_step_h200.json" || { echo "ep_step: exit $?"; status=1; }
if [ -f "$OUT/trace/ep1.rtrace" ]; then
  timeout "${LIMIT_REPLAY:-25}" python3 -m bench.eplb_replay "$OUT/trace/ep1.rtrace" \
    --ranks 8,32,64 --window 100 --interval 50 --commit "$COMMIT" \
    --out "$OUT/eplb_replay_h200.json" || { echo "eplb_replay: exit $?"; status=1; }
else
  echo "no routing trace: eplb_replay skipped"; status=1
fi
exit $status
