/* The int4 matmul of int4_kernel_avx512.c for CPUs with AVX2 but no AVX512-VNNI (AMD Zen 2/3,
 * most Intel client CPUs): the same packed layout, the same two int8 parts per
 * activation, the same results to float rounding. And the rest of a decode step's
 * parts, each as int4_kernel_avx512.c computes it in 8 lanes instead of 16: RMS norm,
 * the SiLU gate, the attention with its RoPE and K/V write (for a decode step's rows and
 * for a prefill chunk's) and the LM head's shortlist and exact pass. The matmul runs on
 * the context's team of threads; the others on the caller's. Not the whole step in one
 * call: fast_llama calls the parts, a layer at a time.
 *
 * Without VPDPBUSD, u8 x s8 products go through VPMADDUBSW (pairs summed to int16,
 * saturating) and VPMADDWD (int16 pairs to int32). A pair is at most 2 * 15 * 127 =
 * 3,810, so a group's 8 such pairs per output lane (4 steps, low and high nibbles)
 * add up to at most 30,480 in int16: no saturation, one VPMADDWD per group. A 16-column
 * block is two halves of 8 columns (one 256-bit register each), done one after the other.
 *
 * Compiled with AVX2's -m flags (setup.py); called only where omni_cpu_lacks says the
 * CPU has them.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "int4_kernel_scalar.h"
#include "int4_kernel_team.h"

#define GROUP OMNI_GROUP
#define NB OMNI_BLOCK
#define MR 4
#define RES 254
#define PREFETCH 2048

static float hmax8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    return _mm_cvtss_f32(m);
}

/* As int4_kernel_avx512.c's quantize_rows: [k] hi then [k] lo int8 per row, sx = d / RES. */
static void quantize_rows(const float *x, int m_rows, int k, int two, int8_t *xq, float *sx,
                          float *sumx) {
    const int groups = k / GROUP;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < m_rows; m++) {
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)m * k + (size_t)g * GROUP;
            __m256 v[4];
            __m256 amax = _mm256_setzero_ps();
            for (int i = 0; i < 4; i++) {
                v[i] = _mm256_loadu_ps(xg + 8 * i);
                amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
            }
            float d = hmax8(amax) / 127.0f;
            __m256 vd = _mm256_set1_ps(d);
            __m256 inv = _mm256_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m256 inv_lo = _mm256_set1_ps(d > 0.0f ? RES / d : 0.0f);
            int32_t hi[GROUP], lo[GROUP];
            for (int i = 0; i < 4; i++) {
                __m256i h = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
                __m256 r = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(h), vd, v[i]);
                __m256i l = two ? _mm256_cvtps_epi32(_mm256_mul_ps(r, inv_lo)) : _mm256_setzero_si256();
                _mm256_storeu_si256((__m256i *)(hi + 8 * i), h);
                _mm256_storeu_si256((__m256i *)(lo + 8 * i), l);
            }
            int8_t *qh = xq + (size_t)m * 2 * k + (size_t)g * GROUP, *ql = qh + k;
            int hsum = 0, lsum = 0;
            for (int i = 0; i < GROUP; i++) {
                qh[i] = (int8_t)hi[i];
                ql[i] = (int8_t)lo[i];
                hsum += hi[i];
                lsum += lo[i];
            }
            sx[m * groups + g] = d / RES;
            sumx[m * groups + g] = (d / RES) * (float)(RES * hsum + lsum);
        }
    }
}

/* Rows [0, mr) against half ``half`` (8 columns) of column block b. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int k, const int n, const int b, const int half, const uint8_t *w,
    const uint16_t *scale, const uint16_t *lo, const int8_t *xq, const float *sx,
    const float *sumx, float *y, const int accumulate, const int two) {
    const int groups = k / GROUP;
    const __m256i low4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i res = _mm256_set1_epi32(RES);
    __m256 accf[MR];
    for (int i = 0; i < mr; i++) accf[i] = _mm256_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m256i sum_hi[MR], sum_lo[MR];
        for (int i = 0; i < mr; i++) {
            sum_hi[i] = _mm256_setzero_si256();
            sum_lo[i] = _mm256_setzero_si256();
        }
        const uint8_t *wg = w + ((size_t)b * groups + g) * 256 + half * 32;
        for (int s = 0; s < 4; s++) {
            _mm_prefetch((const char *)(wg + s * 64 + PREFETCH), _MM_HINT_T0);
            __m256i v = _mm256_loadu_si256((const __m256i *)(wg + s * 64));
            __m256i wl = _mm256_and_si256(v, low4);
            __m256i wh = _mm256_and_si256(_mm256_srli_epi16(v, 4), low4);
            for (int i = 0; i < mr; i++) {
                const int8_t *xs = xq + (size_t)i * 2 * k + (size_t)g * GROUP + s * 8;
                int32_t hi1, hi2, lo1, lo2;
                memcpy(&hi1, xs, 4);
                memcpy(&hi2, xs + 4, 4);
                memcpy(&lo1, xs + k, 4);
                memcpy(&lo2, xs + k + 4, 4);
                sum_hi[i] = _mm256_add_epi16(sum_hi[i], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(hi1)));
                sum_hi[i] = _mm256_add_epi16(sum_hi[i], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(hi2)));
                if (two) {
                    sum_lo[i] = _mm256_add_epi16(sum_lo[i], _mm256_maddubs_epi16(wl, _mm256_set1_epi32(lo1)));
                    sum_lo[i] = _mm256_add_epi16(sum_lo[i], _mm256_maddubs_epi16(wh, _mm256_set1_epi32(lo2)));
                }
            }
        }
        const size_t at = ((size_t)b * groups + g) * NB + half * 8;
        __m256 vs = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scale + at)));
        __m256 vl = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(lo + at)));
        for (int i = 0; i < mr; i++) {
            __m256i dot = _mm256_mullo_epi32(_mm256_madd_epi16(sum_hi[i], ones), res);
            if (two) dot = _mm256_add_epi32(dot, _mm256_madd_epi16(sum_lo[i], ones));
            __m256 rowscale = _mm256_mul_ps(vs, _mm256_set1_ps(sx[i * groups + g]));
            accf[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), rowscale, accf[i]);
            accf[i] = _mm256_fmadd_ps(vl, _mm256_set1_ps(sumx[i * groups + g]), accf[i]);
        }
    }
    for (int i = 0; i < mr; i++) {
        float *out = y + (size_t)i * n + (size_t)b * NB + half * 8;
        _mm256_storeu_ps(out, accumulate ? _mm256_add_ps(_mm256_loadu_ps(out), accf[i]) : accf[i]);
    }
}

static void rows_half(int mr, int k, int n, int b, int half, const uint8_t *w,
                      const uint16_t *scale, const uint16_t *lo, const int8_t *xq,
                      const float *sx, const float *sumx, float *y, int accumulate, int two) {
#define TILE(R, T) \
    case R * 10 + T: tile(R, k, n, b, half, w, scale, lo, xq, sx, sumx, y, accumulate, T); break;
    switch (mr * 10 + (two ? 1 : 0)) {
        TILE(1, 1) TILE(2, 1) TILE(3, 1) TILE(4, 1) TILE(1, 0) TILE(2, 0) TILE(3, 0) TILE(4, 0)
    }
#undef TILE
}

/* Column blocks [b_lo, b_hi) of y = x W^T (or y += x W^T), x quantized into ``mine``
 * (every thread quantizes the whole x: cheaper than a barrier). */
static void multiply(const float *x, int m_rows, int k, const uint8_t *w, const uint16_t *scale,
                     const uint16_t *lo, int n, float *y, int accumulate, int two,
                     const omni_scratch *mine, int b_lo, int b_hi) {
    const int groups = k / GROUP;
    int8_t *xq = mine->xq;
    float *sx = mine->sx, *sumx = sx + (size_t)m_rows * groups;
    quantize_rows(x, m_rows, k, two, xq, sx, sumx);
    for (int b = b_lo; b < b_hi; b++)
        for (int half = 0; half < 2; half++)
            for (int m0 = 0; m0 < m_rows; m0 += MR) {
                const int mr = m_rows - m0 < MR ? m_rows - m0 : MR;
                rows_half(mr, k, n, b, half, w, scale, lo, xq + (size_t)m0 * 2 * k,
                          sx + (size_t)m0 * groups, sumx + (size_t)m0 * groups,
                          y + (size_t)m0 * n, accumulate, two);
            }
}

/* One thread's share of the column blocks, then a barrier (nothing of *a is read after
 * it: it is on the caller's stack). A block's bits do not depend on the thread count. */
static void matmul_job(void *args, int tid) {
    const omni_matmul_args *a = args;
    omni_ctx *const ctx = a->ctx;
    const int T = a->threads, blocks = a->n / NB;
    multiply(a->x, a->m_rows, a->k, a->w, a->scale, a->lo, a->n, a->y, a->accumulate, a->two,
             ctx->scratch + tid, (int)((long)blocks * tid / T), (int)((long)blocks * (tid + 1) / T));
    omni_barrier(ctx, T);
}

/* As omni_avx512_matmul: on ``threads`` threads of the context's team, each a share of
 * the column blocks (one decode row on one thread read the weights at ~half the
 * memory's speed). 0, or -1: no memory. */
int omni_avx2_matmul(omni_ctx *ctx, const float *x, int m_rows, int k, const uint8_t *w,
                     const uint16_t *scale, const uint16_t *lo, int n, float *y, int accumulate,
                     int two, int threads) {
    if (threads > n / NB) threads = n / NB;
    omni_take(ctx);
    threads = threads > 1 ? omni_team(ctx, threads) : 1;
    omni_needs needs = {0};
    needs.xq = (size_t)m_rows * 2 * k;
    needs.sx = sizeof(float) * (size_t)m_rows * (k / GROUP) * 2;
    const int code = omni_reserve(ctx, threads, &needs);
    if (code == 0 && threads > 1) {
        omni_matmul_args a = {ctx, x, m_rows, k, w, scale, lo, n, y, accumulate, two, threads};
        omni_post(ctx, matmul_job, &a, threads);
        matmul_job(&a, 0);
    } else if (code == 0) {
        multiply(x, m_rows, k, w, scale, lo, n, y, accumulate, two, ctx->scratch, 0, n / NB);
    }
    omni_give(ctx);
    return code;
}

/* ---- a decode step's other parts ---- */

static float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
}

/* e^x for x <= 0, as int4_kernel_avx512.c's exp_neg: 2^i * 2^f, a degree-6 polynomial
 * for 2^f on [-0.5, 0.5]; 2^i built in the exponent bits (i >= -126 after the clamp,
 * so a normal float). */
static inline __m256 exp_neg(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    __m256 t = _mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f));
    __m256 i = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 f = _mm256_mul_ps(_mm256_sub_ps(t, i), _mm256_set1_ps(0.69314718055994531f));
    __m256 p = _mm256_set1_ps(1.0f / 720);
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, f, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(i), _mm256_set1_epi32(127));
    return _mm256_mul_ps(p, _mm256_castsi256_ps(_mm256_slli_epi32(e, 23)));
}

/* out[r] = x[r] / rms(x[r]) * weight, rows of ``hidden`` (a multiple of 8) floats. */
void omni_avx2_rms_norm(const float *x, int rows, int hidden, const float *weight, float eps,
                        float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * hidden;
        __m256 acc = _mm256_setzero_ps();
        for (int i = 0; i < hidden; i += 8) {
            __m256 v = _mm256_loadu_ps(xr + i);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        __m256 vi = _mm256_set1_ps(1.0f / sqrtf(hsum8(acc) / hidden + eps));
        for (int i = 0; i < hidden; i += 8)
            _mm256_storeu_ps(out + (size_t)r * hidden + i,
                             _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(xr + i), vi),
                                           _mm256_loadu_ps(weight + i)));
    }
}

/* out[r] = silu(gate) * up, row r of ``gate_up`` being [gate (width), up (width)]. */
void omni_avx2_silu_mul(const float *gate_up, int rows, int width, float *out) {
    const __m256 sign = _mm256_set1_ps(-0.0f), one = _mm256_set1_ps(1.0f);
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * width, *u = g + width;
        float *o = out + (size_t)r * width;
        for (int i = 0; i < width; i += 8) {
            __m256 v = _mm256_loadu_ps(g + i);
            /* silu(v) = v / (1 + e^-v), with e^-|v| so the exponent never overflows:
             * sigmoid is 1 / (1 + e) for v >= 0, e / (1 + e) for v < 0. */
            __m256 e = exp_neg(_mm256_or_ps(v, sign));
            __m256 neg = _mm256_cmp_ps(v, _mm256_setzero_ps(), _CMP_LT_OQ);
            __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(v, sig), _mm256_loadu_ps(u + i)));
        }
    }
}

/* As omni_avx512_topk, 8 values compared at a time. */
static unsigned above8(const float *x, float floor) {
    return (unsigned)_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_loadu_ps(x), _mm256_set1_ps(floor), _CMP_GT_OQ));
}

int omni_avx2_topk(const float *x, int rows, int n, int k, int64_t *out) {
    return topk_rows(x, rows, n, k, out, 8, above8);
}

/* As omni_avx512_q8_dots: out[r][j] = x[r] . w[ids[r][j]], w = q * scale rounded to
 * float32 first; every dot product on its own, so a row's values do not depend on the
 * other rows (torch's bmm's do: a row's logits moved with the batch's size). */
void omni_avx2_q8_dots(const int8_t *q, const float *scale, int k, const float *x,
                       const int64_t *ids, int rows, int per_row, float *out) {
    const int groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * k;
        for (int j = 0; j < per_row; j++) {
            const int64_t id = ids[(size_t)r * per_row + j];
            const int8_t *qr = q + (size_t)id * k;
            const float *sr = scale + (size_t)id * groups;
            __m256 acc = _mm256_setzero_ps();
            for (int g = 0; g < groups; g++) {
                const __m256 vs = _mm256_set1_ps(sr[g]);
                for (int h = 0; h < GROUP; h += 8) {
                    const __m128i b = _mm_loadl_epi64((const __m128i *)(qr + g * GROUP + h));
                    const __m256 w = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), vs);
                    acc = _mm256_fmadd_ps(w, _mm256_loadu_ps(xr + g * GROUP + h), acc);
                }
            }
            out[(size_t)r * per_row + j] = hsum8(acc);
        }
    }
}

/* ---- attention ---- */

/* Torch's attention gives a row other bits in a prefill chunk than in the decode step
 * that computes it alone, and other bits again beside other rows of a batch. A seeded
 * sample then drifts when a retry resumes a request (its delivered tokens prefilled, not
 * decoded as the first replica did). Here each row is computed the same way wherever it
 * is: its own dot products over its own positions, in one order. The arithmetic is
 * int4_kernel_avx512.c's attend, in 8 lanes. */

#define MAX_HD OMNI_MAX_HD
#define MAX_GROUP OMNI_MAX_GROUP

/* Attention of each row (its rotated q from rope_and_store) over positions
 * 0..positions[r] of its cache (kcache + r * slot_stride), into out [rows, heads * hd];
 * ``scores``: most_positions(positions, rows) * heads / kv_heads floats. */
static void attend(const float *q, int rows, int heads, int kv_heads, int hd,
                   const int64_t *positions, const float *kcache, const float *vcache,
                   int capacity, size_t slot_stride, float *out, float *scores) {
    const int group = heads / kv_heads;
    const int most = most_positions(positions, rows);
    for (int r = 0; r < rows; r++) {
        const int length = (int)positions[r] + 1;
        const float *kr = kcache + r * slot_stride, *vr = vcache + r * slot_stride;
        for (int h = 0; h < kv_heads; h++) {
            const float *kh = kr + (size_t)h * capacity * hd;
            const float *vh = vr + (size_t)h * capacity * hd;
            /* The group's query heads share this kv head: each k row is read once. */
            for (int t = 0; t < length; t++) {
                const float *kt = kh + (size_t)t * hd;
                for (int g = 0; g < group; g++) {
                    const float *qg = q + ((size_t)r * heads + h * group + g) * hd;
                    __m256 acc = _mm256_setzero_ps();
                    for (int i = 0; i < hd; i += 8)
                        acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kt + i), acc);
                    scores[(size_t)g * most + t] = hsum8(acc);
                }
            }
            float inv[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                float *sg = scores + (size_t)g * most;
                float top = sg[0];
                for (int t = 1; t < length; t++) top = sg[t] > top ? sg[t] : top;
                __m256 vtop = _mm256_set1_ps(top), vsum = _mm256_setzero_ps();
                int t = 0;
                for (; t + 8 <= length; t += 8) {
                    __m256 e = exp_neg(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vtop));
                    _mm256_storeu_ps(sg + t, e);
                    vsum = _mm256_add_ps(vsum, e);
                }
                if (t < length) {
                    /* Lanes [0, length - t) of the last 8: the others neither read nor summed. */
                    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                    const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(length - t), lane);
                    __m256 e = exp_neg(_mm256_sub_ps(_mm256_maskload_ps(sg + t, m), vtop));
                    _mm256_maskstore_ps(sg + t, m, e);
                    vsum = _mm256_add_ps(vsum, _mm256_and_ps(e, _mm256_castsi256_ps(m)));
                }
                inv[g] = 1.0f / hsum8(vsum);
            }
            /* Each v row once, for every query head of the group. */
            __m256 acc[MAX_GROUP][MAX_HD / 8];
            for (int g = 0; g < group; g++)
                for (int c = 0; c < hd / 8; c++) acc[g][c] = _mm256_setzero_ps();
            for (int u = 0; u < length; u++) {
                const float *vu = vh + (size_t)u * hd;
                for (int c = 0; c < hd / 8; c++) {
                    __m256 v = _mm256_loadu_ps(vu + c * 8);
                    for (int g = 0; g < group; g++)
                        acc[g][c] = _mm256_fmadd_ps(_mm256_set1_ps(scores[(size_t)g * most + u]), v,
                                                    acc[g][c]);
                }
            }
            for (int g = 0; g < group; g++) {
                float *o = out + (size_t)r * heads * hd + (size_t)(h * group + g) * hd;
                for (int c = 0; c < hd / 8; c++)
                    _mm256_storeu_ps(o + c * 8, _mm256_mul_ps(acc[g][c], _mm256_set1_ps(inv[g])));
            }
        }
    }
}

/* RoPE, the K/V write and attention of ``rows`` rows whose caches are ``slot_stride``
 * apart (a slot each, or 0: one slot), on the caller's thread. 0, or -1: no memory. */
static int attention(omni_ctx *ctx, const float *qkv, int rows, int heads, int kv_heads, int hd,
                     const float *rope, const int64_t *positions, float *kcache, float *vcache,
                     int capacity, size_t slot_stride, float *out) {
    omni_needs needs = {0};
    needs.q = sizeof(float) * (size_t)rows * heads * hd;
    needs.scores = sizeof(float) * (size_t)most_positions(positions, rows) * (heads / kv_heads);
    omni_take(ctx);
    const int code = omni_reserve(ctx, 1, &needs);
    if (code == 0) {
        rope_and_store(qkv, rows, heads, kv_heads, hd, rope, positions, kcache, vcache, capacity,
                       slot_stride, ctx->q);
        attend(ctx->q, rows, heads, kv_heads, hd, positions, kcache, vcache, capacity, slot_stride,
               out, ctx->scratch[0].scores);
    }
    omni_give(ctx);
    return code;
}

/* As omni_avx512_decode_attention: row r is slot r of the caches, at positions[r]. */
int omni_avx2_decode_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
                               int kv_heads, int hd, const float *rope, const int64_t *positions,
                               float *kcache, float *vcache, int capacity, float *out) {
    return attention(ctx, qkv, rows, heads, kv_heads, hd, rope, positions, kcache, vcache,
                     capacity, (size_t)kv_heads * capacity * hd, out);
}

/* A prefill chunk's: ``rows`` tokens of one sequence at ``positions`` (ascending), in
 * one slot (kslot, vslot: that slot's cache [kv_heads, capacity, hd]), each attending to
 * the slot's positions up to its own; per row the bits of omni_avx2_decode_attention's. */
int omni_avx2_prefill_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
                                int kv_heads, int hd, const float *rope,
                                const int64_t *positions, float *kslot, float *vslot,
                                int capacity, float *out) {
    return attention(ctx, qkv, rows, heads, kv_heads, hd, rope, positions, kslot, vslot,
                     capacity, 0, out);
}
