/* The int4 matmul of int4_kernel_avx512.c for CPUs with AVX2 but no AVX512-VNNI (AMD Zen 2/3,
 * most Intel client CPUs): the same packed layout, the same two int8 parts per
 * activation, the same results to float rounding. Only the matmul: where this one
 * runs, a decode step's other work stays on torch (see fast_llama).
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
#include <string.h>

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

/* As omni_avx512_matmul, on the caller's thread (``threads`` is ignored); x quantized
 * into the context's scratch. 0, or -1: no memory. */
int omni_avx2_matmul(omni_ctx *ctx, const float *x, int m_rows, int k, const uint8_t *w,
                     const uint16_t *scale, const uint16_t *lo, int n, float *y, int accumulate,
                     int two, int threads) {
    (void)threads;
    const int groups = k / GROUP;
    omni_needs needs = {0};
    needs.xq = (size_t)m_rows * 2 * k;
    needs.sx = sizeof(float) * (size_t)m_rows * groups * 2;
    omni_take(ctx);
    const int code = omni_reserve(ctx, 1, &needs);
    if (code == 0) {
        int8_t *xq = ctx->scratch[0].xq;
        float *sx = ctx->scratch[0].sx, *sumx = sx + (size_t)m_rows * groups;
        quantize_rows(x, m_rows, k, two, xq, sx, sumx);
        for (int b = 0; b < n / NB; b++)
            for (int half = 0; half < 2; half++)
                for (int m0 = 0; m0 < m_rows; m0 += MR) {
                    const int mr = m_rows - m0 < MR ? m_rows - m0 : MR;
                    rows_half(mr, k, n, b, half, w, scale, lo, xq + (size_t)m0 * 2 * k,
                              sx + (size_t)m0 * groups, sumx + (size_t)m0 * groups,
                              y + (size_t)m0 * n, accumulate, two);
                }
    }
    omni_give(ctx);
    return code;
}
