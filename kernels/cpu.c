/* Block-quantized weight products for the CPU (see kernels/cpu_quant.py for the contract).
 *
 * Weights are stored row by row in blocks of 32 consecutive input features:
 *   Q4: { float d; float m; uint8_t qs[16]; }  w[j] = d * q[j] + m, with q[j] the low
 *       nibble of qs[j] for j < 16 and the high nibble of qs[j - 16] above (24 bytes);
 *   Q8: { float d; int8_t qs[32]; }            w[j] = d * qs[j], |qs[j]| <= 127 (36 bytes).
 * Activations are rounded per row and block to 16-bit integers:
 *   { float d; float s; int16_t qs[32]; }      x[j] ~ d * qs[j], d = max|x| / 32767,
 *                                              s = d * sum(qs) (72 bytes),
 * and each block's product is an exact integer dot product (pairs of 16-bit products
 * summed in 32 bits) scaled in float32.
 *
 * Threads: OpenMP over output features. The library links libgomp.so.1, the runtime torch's
 * CPU wheel loads, so both share one thread pool. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FERRY_AVX2 1
#endif

#define QK 32
#define XMAX 32767.0f

typedef struct {
    float d, m;
    uint8_t qs[QK / 2];
} block_q4;

typedef struct {
    float d;
    int8_t qs[QK];
} block_q8;

typedef struct {
    float d, s;
    int16_t qs[QK];
} block_x;

int ferry_block_bytes(int kind) { return kind == 4 ? (int)sizeof(block_q4) : (int)sizeof(block_q8); }

int ferry_act_block_bytes(void) { return (int)sizeof(block_x); }

int ferry_simd(void) {
#ifdef FERRY_AVX2
    return 2;
#else
    return 0;
#endif
}

static inline float silu(float v) { return v / (1.0f + expf(-v)); }

/* 32 values → one activation block (round half away from zero, as roundf). */
static void quantize_block(const float *v, block_x *out) {
    float amax = 0.0f;
    for (int j = 0; j < QK; j++) amax = fmaxf(amax, fabsf(v[j]));
    const float d = amax / XMAX;
    const float id = d > 0.0f ? 1.0f / d : 0.0f;
    int sum = 0;
    for (int j = 0; j < QK; j++) {
        int q = (int)roundf(v[j] * id);
        q = q > 32767 ? 32767 : (q < -32767 ? -32767 : q);
        out->qs[j] = (int16_t)q;
        sum += q;
    }
    out->d = d;
    out->s = d * (float)sum;
}

/* x [M, K] → blocks [M, K/32]. With gated: x is [M, 2K] (gate | up) and what is quantized
 * is silu(gate) * up (the SwiGLU of the fused gate/up projection). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int gated, block_x *out) {
    const int64_t nb = K / QK;
    float tmp[QK];
    for (int64_t i = 0; i < M; i++) {
        for (int64_t b = 0; b < nb; b++) {
            const float *v;
            if (gated) {
                const float *g = x + i * 2 * K + b * QK, *u = g + K;
                for (int j = 0; j < QK; j++) tmp[j] = silu(g[j]) * u[j];
                v = tmp;
            } else {
                v = x + i * K + b * QK;
            }
            quantize_block(v, out + i * nb + b);
        }
    }
}

void ferry_quantize_rows(const float *x, int64_t M, int64_t K, int gated, void *out) {
    quantize_rows(x, M, K, gated, (block_x *)out);
}

#ifdef FERRY_AVX2
static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* sum over the block of w * x as 8 float32 lanes (exact integer sums). */
static inline __m256 dot16(__m256i w0, __m256i w1, const block_x *xb) {
    const __m256i x0 = _mm256_loadu_si256((const __m256i *)xb->qs);
    const __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb->qs + 16));
    const __m256i p = _mm256_add_epi32(_mm256_madd_epi16(w0, x0), _mm256_madd_epi16(w1, x1));
    return _mm256_cvtepi32_ps(p);
}
#endif

/* One block of a Q4 row against rows r < MT of x: acc[r] += d_w d_x (q . x), summ[r] +=
 * m_w s_x. Accumulators are passed by name so that they stay in registers. */
#ifdef FERRY_AVX2
#define Q4_BLOCK(wb, xrow, nb, MT, acc, summ)                                                 \
    do {                                                                                      \
        const __m128i t_ = _mm_loadu_si128((const __m128i *)(wb)->qs);                        \
        const __m128i m4_ = _mm_set1_epi8(0x0F);                                              \
        const __m256i w0_ = _mm256_cvtepu8_epi16(_mm_and_si128(t_, m4_));                     \
        const __m256i w1_ = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(t_, 4), m4_));  \
        for (int r_ = 0; r_ < (MT); r_++) {                                                   \
            const block_x *xb_ = (xrow) + r_ * (nb);                                          \
            acc[r_] = _mm256_fmadd_ps(dot16(w0_, w1_, xb_), _mm256_set1_ps((wb)->d * xb_->d), \
                                      acc[r_]);                                               \
            summ[r_] = _mm_fmadd_ss(_mm_set_ss((wb)->m), _mm_set_ss(xb_->s), summ[r_]);       \
        }                                                                                     \
    } while (0)

#define Q8_BLOCK(wb, xrow, nb, MT, acc)                                                       \
    do {                                                                                      \
        const __m256i w0_ = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(wb)->qs)); \
        const __m256i w1_ =                                                                   \
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)((wb)->qs + 16)));          \
        for (int r_ = 0; r_ < (MT); r_++) {                                                   \
            const block_x *xb_ = (xrow) + r_ * (nb);                                          \
            acc[r_] = _mm256_fmadd_ps(dot16(w0_, w1_, xb_), _mm256_set1_ps((wb)->d * xb_->d), \
                                      acc[r_]);                                               \
        }                                                                                     \
    } while (0)
#endif

/* y[r] for rows r < MT of x (MT a constant after inlining), one Q4 weight row. Two sets
 * of accumulators (even and odd blocks) halve the dependency chains. */
static inline __attribute__((always_inline)) void q4_row(
    const block_q4 *w, const block_x *x, int64_t nb, const int MT, float *out) {
#ifdef FERRY_AVX2
    __m256 a0[4], a1[4];
    __m128 s0[4], s1[4];
    for (int r = 0; r < MT; r++) {
        a0[r] = a1[r] = _mm256_setzero_ps();
        s0[r] = s1[r] = _mm_setzero_ps();
    }
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        Q4_BLOCK(w + b, x + b, nb, MT, a0, s0);
        Q4_BLOCK(w + b + 1, x + b + 1, nb, MT, a1, s1);
    }
    if (b < nb) Q4_BLOCK(w + b, x + b, nb, MT, a0, s0);
    for (int r = 0; r < MT; r++) {
        out[r] = hsum(_mm256_add_ps(a0[r], a1[r])) + _mm_cvtss_f32(_mm_add_ss(s0[r], s1[r]));
    }
#else
    for (int r = 0; r < MT; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const block_q4 *wb = w + b;
            const block_x *xb = x + r * nb + b;
            int32_t dot = 0;
            for (int j = 0; j < QK / 2; j++) {
                dot += (wb->qs[j] & 0x0F) * xb->qs[j] + (wb->qs[j] >> 4) * xb->qs[j + QK / 2];
            }
            total += wb->d * xb->d * (float)dot + wb->m * xb->s;
        }
        out[r] = total;
    }
#endif
}

static inline __attribute__((always_inline)) void q8_row(
    const block_q8 *w, const block_x *x, int64_t nb, const int MT, float *out) {
#ifdef FERRY_AVX2
    __m256 a0[4], a1[4];
    for (int r = 0; r < MT; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int64_t b = 0;
    for (; b + 1 < nb; b += 2) {
        Q8_BLOCK(w + b, x + b, nb, MT, a0);
        Q8_BLOCK(w + b + 1, x + b + 1, nb, MT, a1);
    }
    if (b < nb) Q8_BLOCK(w + b, x + b, nb, MT, a0);
    for (int r = 0; r < MT; r++) out[r] = hsum(_mm256_add_ps(a0[r], a1[r]));
#else
    for (int r = 0; r < MT; r++) {
        float total = 0.0f;
        for (int64_t b = 0; b < nb; b++) {
            const block_q8 *wb = w + b;
            const block_x *xb = x + r * nb + b;
            int32_t dot = 0;
            for (int j = 0; j < QK; j++) dot += wb->qs[j] * xb->qs[j];
            total += wb->d * xb->d * (float)dot;
        }
        out[r] = total;
    }
#endif
}

/* Rows of x in tiles of 4 against weight row n; results to y[i, n] (+ bias[n]). */
static void gemm_row(int kind, const void *w, const block_x *xq, int64_t M, int64_t K,
                     int64_t N, int64_t n, const float *bias, float *y) {
    const int64_t nb = K / QK;
    float out[4];
    for (int64_t i = 0; i < M; i += 4) {
        const int64_t mt = M - i < 4 ? M - i : 4;
        const block_x *xs = xq + i * nb;
        if (kind == 4) {
            const block_q4 *wr = (const block_q4 *)w + n * nb;
            switch (mt) {
                case 1: q4_row(wr, xs, nb, 1, out); break;
                case 2: q4_row(wr, xs, nb, 2, out); break;
                case 3: q4_row(wr, xs, nb, 3, out); break;
                default: q4_row(wr, xs, nb, 4, out); break;
            }
        } else {
            const block_q8 *wr = (const block_q8 *)w + n * nb;
            switch (mt) {
                case 1: q8_row(wr, xs, nb, 1, out); break;
                case 2: q8_row(wr, xs, nb, 2, out); break;
                case 3: q8_row(wr, xs, nb, 3, out); break;
                default: q8_row(wr, xs, nb, 4, out); break;
            }
        }
        const float add = bias ? bias[n] : 0.0f;
        for (int64_t r = 0; r < mt; r++) y[(i + r) * N + n] = out[r] + add;
    }
}

/* y [M, N] = x [M, K] @ W.T (+ bias). kind 4: Q4 weights, 8: Q8. gated: x is [M, 2K] and the
 * product takes silu(gate) * up. Returns 0, or -1 when out of memory. */
int ferry_qgemm(int kind, const float *x, int64_t M, int64_t K, int gated, const void *w,
                int64_t N, const float *bias, float *y, int threads) {
    block_x *xs = (block_x *)malloc((size_t)(M * (K / QK)) * sizeof(block_x));
    if (!xs) return -1;
    quantize_rows(x, M, K, gated, xs);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) gemm_row(kind, w, xs, M, K, N, n, bias, y);
    free(xs);
    return 0;
}

/* W [N, K] back to float32 (the prefill path and the reference). */
void ferry_dequantize(int kind, const void *w, int64_t N, int64_t K, float *out, int threads) {
    const int64_t nb = K / QK;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        for (int64_t b = 0; b < nb; b++) {
            float *o = out + n * K + b * QK;
            if (kind == 4) {
                const block_q4 *wb = (const block_q4 *)w + n * nb + b;
                for (int j = 0; j < QK / 2; j++) {
                    o[j] = wb->d * (float)(wb->qs[j] & 0x0F) + wb->m;
                    o[j + QK / 2] = wb->d * (float)(wb->qs[j] >> 4) + wb->m;
                }
            } else {
                const block_q8 *wb = (const block_q8 *)w + n * nb + b;
                for (int j = 0; j < QK; j++) o[j] = wb->d * (float)wb->qs[j];
            }
        }
    }
}

/* ---- the rest of a decoder layer at decode, float32 ----------------------------------- */

/* out [M, D] = rmsnorm(z) * w with z = x (residual NULL) or z = residual += x (in place).
 * out may be x. Sums in float32 in index order, like torch's CPU mean at these sizes. */
void ferry_rms_norm(float *x, float *residual, const float *w, float eps, int64_t M, int64_t D,
                    float *out) {
    for (int64_t i = 0; i < M; i++) {
        float *z = x + i * D;
        if (residual) {
            float *r = residual + i * D;
            for (int64_t j = 0; j < D; j++) r[j] += z[j];
            z = r;
        }
        float ss = 0.0f;
#pragma omp simd reduction(+ : ss)
        for (int64_t j = 0; j < D; j++) ss += z[j] * z[j];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        float *o = out + i * D;
        for (int64_t j = 0; j < D; j++) o[j] = w[j] * (z[j] * inv);
    }
}

/* Rotate-half RoPE in place on `heads` heads of D at the start of each of T rows of x
 * (row stride `stride` floats), at positions[t], from cos_sin [*, D] (cos half, sin half). */
void ferry_rope(float *x, int64_t T, int64_t stride, int64_t heads, int64_t D,
                const int64_t *positions, const float *cos_sin) {
    const int64_t half = D / 2;
    for (int64_t t = 0; t < T; t++) {
        const float *cs = cos_sin + positions[t] * D;
        for (int64_t h = 0; h < heads; h++) {
            float *v = x + t * stride + h * D;
            for (int64_t j = 0; j < half; j++) {
                const float a = v[j], b = v[j + half], c = cs[j], s = cs[j + half];
                v[j] = a * c - b * s;
                v[j + half] = b * c + a * s;
            }
        }
    }
}

/* cache[slots[t]] = src row t (width floats, row stride `stride`); negative slots skipped. */
void ferry_store_kv(const float *src, int64_t T, int64_t stride, int64_t width, float *cache,
                    const int64_t *slots) {
    for (int64_t t = 0; t < T; t++) {
        if (slots[t] >= 0) memcpy(cache + slots[t] * width, src + t * stride, width * 4);
    }
}

/* One query per sequence over its paged context. q: [B, Hq*D] rows of stride q_stride;
 * cache: [blocks, block_size, 2*Hkv*D] (k then v per token); tables [B, max_blocks];
 * out [B, Hq*D]. Softmax in float32 with the running maximum subtracted. */
void ferry_decode_attention(const float *q, int64_t q_stride, int64_t B, int64_t Hq,
                            int64_t Hkv, int64_t D, const float *cache, int64_t block_size,
                            const int32_t *tables, int64_t max_blocks, const int32_t *seq_lens,
                            float scale, float *out, int threads) {
    const int64_t group = Hq / Hkv, width = 2 * Hkv * D;
#pragma omp parallel num_threads(threads)
    {
        int64_t cap = 0;
        float *scores = NULL;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < B * Hq; task++) {
            const int64_t b = task / Hq, h = task % Hq, kvh = h / group;
            const int64_t len = seq_lens[b];
            const float *qv = q + b * q_stride + h * D;
            float *o = out + b * Hq * D + h * D;
            if (len > cap) {
                free(scores);
                cap = len;
                scores = (float *)malloc(cap * sizeof(float));
            }
            const int32_t *table = tables + b * max_blocks;
            float mx = -INFINITY;
            for (int64_t start = 0; start < len; start += block_size) {
                const float *k = cache + (int64_t)table[start / block_size] * block_size * width
                                 + kvh * D;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++, k += width) {
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t j = 0; j < D; j++) dot += qv[j] * k[j];
                    scores[start + t] = dot * scale;
                    mx = fmaxf(mx, dot * scale);
                }
            }
            float total = 0.0f;
            for (int64_t t = 0; t < len; t++) {
                scores[t] = expf(scores[t] - mx);
                total += scores[t];
            }
            const float inv = 1.0f / total;
            for (int64_t j = 0; j < D; j++) o[j] = 0.0f;
            for (int64_t start = 0; start < len; start += block_size) {
                const float *v = cache + (int64_t)table[start / block_size] * block_size * width
                                 + Hkv * D + kvh * D;
                const int64_t n = len - start < block_size ? len - start : block_size;
                for (int64_t t = 0; t < n; t++, v += width) {
                    const float p = scores[start + t] * inv;
#pragma omp simd
                    for (int64_t j = 0; j < D; j++) o[j] += p * v[j];
                }
            }
        }
        free(scores);
    }
}

/* A decode step's kernel calls, recorded once and replayed in one call from Python
 * (kernels/cpu.py, CpuKernels.record): each call is a function id, its integer and
 * pointer arguments in order, and its float arguments in order. */
enum { FERRY_QGEMM, FERRY_RMS_NORM, FERRY_ROPE, FERRY_STORE_KV, FERRY_DECODE_ATTENTION };

typedef struct {
    int64_t fn;
    int64_t i[14];
    float f[2];
} ferry_call;

int ferry_replay(const ferry_call *calls, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        const int64_t *a = calls[k].i;
        const float *f = calls[k].f;
        switch (calls[k].fn) {
        case FERRY_QGEMM:
            if (ferry_qgemm((int)a[0], (const float *)a[1], a[2], a[3], (int)a[4],
                            (const void *)a[5], a[6], (const float *)a[7], (float *)a[8],
                            (int)a[9]))
                return 1;
            break;
        case FERRY_RMS_NORM:
            ferry_rms_norm((float *)a[0], (float *)a[1], (const float *)a[2], f[0], a[3], a[4],
                           (float *)a[5]);
            break;
        case FERRY_ROPE:
            ferry_rope((float *)a[0], a[1], a[2], a[3], a[4], (const int64_t *)a[5],
                       (const float *)a[6]);
            break;
        case FERRY_STORE_KV:
            ferry_store_kv((const float *)a[0], a[1], a[2], a[3], (float *)a[4],
                           (const int64_t *)a[5]);
            break;
        case FERRY_DECODE_ATTENTION:
            ferry_decode_attention((const float *)a[0], a[1], a[2], a[3], a[4], a[5],
                                   (const float *)a[6], a[7], (const int32_t *)a[8], a[9],
                                   (const int32_t *)a[10], f[0], (float *)a[11], (int)a[12]);
            break;
        default:
            return 2;
        }
    }
    return 0;
}
