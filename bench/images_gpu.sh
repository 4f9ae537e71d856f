#!/usr/bin/env bash
# The encode pool on one H200, in at most ~300 s; everything it writes ends up in one
# archive, $OUT/images.tgz (beside it $OUT/tlcache.tar.xz, TileLang's kernel cache):
#   1. vlm_check.json: the tiny random Qwen2.5-VL on CUDA against transformers on the same
#      weights (float32, TF32 off; attention through torch SDPA, TileLang's kernels take
#      bf16/fp16): the vision tower with one and two images, greedy generation with one
#      and two images;
#   2. images_h200.json: the dummy 7B-shape VLM (dummy:qwen2.5-vl-7b, bf16) served with
#      --device cuda, 1 prefill + 1 decode worker on the one GPU, once with an encode
#      worker of its own and once encoding inside the prefill worker (both servers side by
#      side): one image chat each first (its own limit, WARMUP_LIMIT s: kernels compiled
#      there are not timed), then TTFT at concurrency 1 and 16, cold and warm
#      (bench/images.py), and the encode worker's images per busy second.
# TileLang's kernel cache is restored from .tlcache/tlcache.tar.xz when a previous run left
# one there (as bench/gpu_engine.sh does) and saved again to $OUT/tlcache.tar.xz at the end:
# carry it back as .tlcache/tlcache.tar.xz and the first chat compiles nothing.
# Each step has its own time limit and its own result; a failed one does not stop the next.
# From the repository root, with .gpu (and .tlcache, if there is one) carried:
#   tar -xJf .gpu/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD && bash bench/images_gpu.sh
# (DEVICE=cpu MODEL=dummy:qwen2.5-vl-tiny DTYPE=float32 KVGB=0.05 IMAGES_LIMIT=600: the same
# steps on a CPU.)
set -u
OUT=${OUT:-/tmp/ferry-images-gpu}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-dummy:qwen2.5-vl-7b}
DTYPE=${DTYPE:-bfloat16}
KVGB=${KVGB:-6}  # each worker's KV cache (the encode worker's embedding cache)
CHECK_LIMIT=${CHECK_LIMIT:-60}  # s: vlm_check.py
WARMUP_LIMIT=${WARMUP_LIMIT:-90}  # s: each server's first image chat (JIT compiles)
IMAGES_LIMIT=${IMAGES_LIMIT:-150}  # s: bench/images.py besides the first chats
RES="$OUT/images"  # the files that go into images.tgz
mkdir -p "$RES"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/tlcache}
export TILELANG_DEFAULT_TARGET='{"kind":"cuda","arch":"sm_90a"}'  # the key a CPU-built cache has
mkdir -p "$TILELANG_CACHE_DIR"
[ -f .tlcache/tlcache.tar.xz ] && tar -xJf .tlcache/tlcache.tar.xz -C "$TILELANG_CACHE_DIR"
# Pillow decodes the images: from .gpu when the machine lacks it
if ! python3 -c "import PIL" 2>/dev/null; then
  for whl in .gpu/pillow-*.whl; do [ -f "$whl" ] && python3 -m zipfile -e "$whl" /tmp/site; done
fi
started=$(date +%s)
{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  python3 -c "import PIL, torch, transformers; print('Pillow', PIL.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
  echo "tilelang cache: $(find "$TILELANG_CACHE_DIR" -type f | wc -l) files restored"
} > "$RES/env.txt" 2>&1

step=$(date +%s)
timeout "$CHECK_LIMIT" python3 bench/vlm_check.py --device "$DEVICE" --out "$RES/vlm_check.json" \
  > "$RES/vlm_check.log" 2>&1
echo "vlm_check rc=$? in $(( $(date +%s) - step )) s" >> "$RES/env.txt"

step=$(date +%s)
timeout $(( WARMUP_LIMIT + IMAGES_LIMIT )) python3 -m bench.images --model "$MODEL" --together \
  --concurrency 1 16 --num-requests 4 16 --input-len 32 --output-len 8 --image-size 448x448 \
  --threads 4 --warmup-timeout "$WARMUP_LIMIT" --out "$RES/images_h200.json" \
  --serve-flags "--device $DEVICE --dtype $DTYPE --kv-cache-memory-gb $KVGB --max-model-len 4096 --enforce-eager" \
  > "$RES/images.log" 2>&1
echo "images rc=$? in $(( $(date +%s) - step )) s" >> "$RES/env.txt"

tar -cJf "$OUT/tlcache.tar.xz" -C "$TILELANG_CACHE_DIR" . \
  && echo "tilelang cache saved: $(find "$TILELANG_CACHE_DIR" -type f | wc -l) files" >> "$RES/env.txt"
echo "total $(( $(date +%s) - started )) s" >> "$RES/env.txt"
cat "$RES/env.txt"
tail -n 12 "$RES/vlm_check.log" "$RES/images.log"
tar -czf "$OUT/images.tgz" -C "$OUT" images && rm -rf "$RES" && ls -la "$OUT"
