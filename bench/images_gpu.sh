#!/usr/bin/env bash
# The encode pool on one H200, in about 150 s, results in $OUT:
#   1. vlm_check.json: the tiny random Qwen2.5-VL on CUDA against transformers on the same
#      weights (float32, TF32 off): the vision tower with one and two images, greedy
#      generation with one and two images;
#   2. images_h200.json: the dummy 7B-shape VLM (dummy:qwen2.5-vl-7b, bf16) served with
#      --device cuda, 1 prefill + 1 decode worker on the one GPU, once with an encode
#      worker of its own and once encoding inside the prefill worker (both servers side by
#      side): one image chat each, then TTFT at concurrency 1 and 16, cold and warm
#      (bench/images.py), and the encode worker's images per busy second.
# Each step has its own time limit and its own result; a failed one does not stop the next.
# From the repository root, with .gpu carried:
#   tar -xJf .gpu/site.tar.xz -C /tmp && export PYTHONPATH=/tmp/site:$PWD && bash bench/images_gpu.sh
# (DEVICE=cpu MODEL=dummy:qwen2.5-vl-tiny DTYPE=float32 KVGB=0.05 IMAGES_LIMIT=600: the same
# steps on a CPU.)
set -u
OUT=${OUT:-/tmp/ferry-images-gpu}
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-dummy:qwen2.5-vl-7b}
DTYPE=${DTYPE:-bfloat16}
KVGB=${KVGB:-6}  # each worker's KV cache (the encode worker's embedding cache)
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0
# Pillow decodes the images: from .gpu when the machine lacks it
if ! python3 -c "import PIL" 2>/dev/null; then
  for whl in .gpu/pillow-*.whl; do [ -f "$whl" ] && python3 -m zipfile -e "$whl" /tmp/site; done
fi
{
  date -u
  git rev-parse --short HEAD 2>/dev/null
  python3 -c "import PIL, torch, transformers; print('Pillow', PIL.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader || true
} > "$OUT/env.txt" 2>&1

timeout 30 python3 bench/vlm_check.py --device "$DEVICE" --out "$OUT/vlm_check.json" \
  > "$OUT/vlm_check.log" 2>&1
echo "vlm_check rc=$?" >> "$OUT/env.txt"

timeout "${IMAGES_LIMIT:-115}" python3 -m bench.images --model "$MODEL" --together \
  --concurrency 1 16 --num-requests 4 16 --input-len 32 --output-len 8 --image-size 448x448 \
  --threads 4 --out "$OUT/images_h200.json" \
  --serve-flags "--device $DEVICE --dtype $DTYPE --kv-cache-memory-gb $KVGB --max-model-len 4096 --enforce-eager" \
  > "$OUT/images.log" 2>&1
echo "images rc=$?" >> "$OUT/env.txt"

cat "$OUT/env.txt"
tail -n 12 "$OUT/vlm_check.log" "$OUT/images.log"
