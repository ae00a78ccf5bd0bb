/* y[M, N] = x[M, K] @ W[N, K]^T, W in 4 bits per weight in groups of 32 along K
 * (w = q * scale + lo, q in 0..15: the Q4_1 grid), for AVX512-VNNI CPUs.
 *
 * Why our own: torch's CPU int4 kernel (_weight_int4pack_mm_for_cpu) unpacks the
 * weights again for every row of x, so 8 rows cost ~4x one row, and one row reads
 * ~10 GB/s where the memory gives ~20. Here each row of x is quantized per group of
 * 32 to two int8 parts (see quantize_rows; one part is llama.cpp's Q8_1), the weights
 * of a 16-column block are unpacked once per group into registers and multiplied with
 * up to 8 rows by VPDPBUSD (u8 x s8, 64 products an instruction), and the group's
 * int32 sums are scaled into float accumulators:
 *   sum_k w_k x_k ~ scale * sx * sum_k q_k xq_k + lo * sx * sum_k xq_k
 * (xq the two parts joined: RES * hi + lo).
 *
 * Layout (made by int4_kernel.py's pack): for each block b of 16 columns and group g,
 * 256 bytes: 4 steps s of 64 bytes; byte j*4+t of step s holds q[16b+j][32g+8s+t] in
 * its low nibble and q[16b+j][32g+8s+4+t] in its high nibble. Scales and lows are
 * float16, [N/16][K/32][16]. N, K: multiples of 16 and 32.
 *
 * Threads: a matmul, the whole decode step (omni_avx512_decode_layers) and a short
 * prefill chunk's layers (omni_avx512_prefill_layers, each row as a decode step
 * computes it) run on the context's team (int4_kernel_team.c), whose threads split every
 * matmul's column blocks and the attention's rows. Working buffers are the context's:
 * reserved before a call's work starts, so the work itself allocates nothing.
 *
 * Compiled with AVX512-VNNI's -m flags (setup.py); called only where omni_cpu_lacks
 * says the CPU has them.
 */
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "int4_kernel_scalar.h"
#include "int4_kernel_team.h"

#define GROUP OMNI_GROUP
#define NB OMNI_BLOCK
#define MR 4
#ifndef PREFETCH
#define PREFETCH 4096 /* bytes ahead of the weights being read (2048: ~8% slower at 8 rows) */
#endif

/* Each group of 32 values of a row as two int8 parts: x ~ d * hi + (d / RES) * lo, hi
 * the values rounded to steps of d = max|x| / 127, lo the rounding error rounded to
 * steps of d / RES. One part alone is ~8 bits a value: enough to flip SmolLM2's 0.08
 * near-tie on "the capital of France" to "L'Etoile"; the two give ~15 bits (more than
 * bfloat16), for twice the multiplies, which only show from ~4 rows up. Stored per
 * row as [k] hi then [k] lo; ``sx`` is d / RES and ``sumx`` the sum of the parts. */
#define RES 254
static void quantize_rows(const float *x, int m_rows, int k, int two, int8_t *xq, float *sx,
                          float *sumx) {
    const int groups = k / GROUP;
    for (int m = 0; m < m_rows; m++) {
        for (int g = 0; g < groups; g++) {
            const float *xg = x + (size_t)m * k + (size_t)g * GROUP;
            __m512 a = _mm512_loadu_ps(xg), b = _mm512_loadu_ps(xg + 16);
            float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
            float d = amax / 127.0f;
            __m512 vd = _mm512_set1_ps(d);
            __m512 inv = _mm512_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
            __m512 inv_lo = _mm512_set1_ps(d > 0.0f ? RES / d : 0.0f);
            __m512i ha = _mm512_cvtps_epi32(_mm512_mul_ps(a, inv));
            __m512i hb = _mm512_cvtps_epi32(_mm512_mul_ps(b, inv));
            /* What the first part missed (at most d / 2), in steps of d / RES. */
            __m512 ra = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(ha), vd, a);
            __m512 rb = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(hb), vd, b);
            /* One part only (``two`` 0): the second is zero and never read. */
            __m512i la = two ? _mm512_cvtps_epi32(_mm512_mul_ps(ra, inv_lo)) : _mm512_setzero_si512();
            __m512i lb = two ? _mm512_cvtps_epi32(_mm512_mul_ps(rb, inv_lo)) : _mm512_setzero_si512();
            int8_t *hi = xq + (size_t)m * 2 * k + (size_t)g * GROUP;
            int8_t *lo = hi + k;
            _mm_storeu_si128((__m128i *)hi, _mm512_cvtsepi32_epi8(ha));
            _mm_storeu_si128((__m128i *)(hi + 16), _mm512_cvtsepi32_epi8(hb));
            _mm_storeu_si128((__m128i *)lo, _mm512_cvtsepi32_epi8(la));
            _mm_storeu_si128((__m128i *)(lo + 16), _mm512_cvtsepi32_epi8(lb));
            sx[m * groups + g] = d / RES;
            /* The sum of the quantized values, not of x: the rounding errors then cancel
             * in lo * sum + scale * sum(q * xq) as in sum((q * scale + lo) * xq), where
             * the exact sum would leave lo * sum(errors) (measured: 2.4x the error). */
            int hsum = _mm512_reduce_add_epi32(_mm512_add_epi32(ha, hb));
            int lsum = _mm512_reduce_add_epi32(_mm512_add_epi32(la, lb));
            sumx[m * groups + g] = (d / RES) * (float)(RES * hsum + lsum);
        }
    }
}

/* Rows [0, mr) of x against nb (1 or 2) column blocks from block b. The two parts of
 * x feed separate int32 accumulators, and with few rows two blocks go side by side:
 * VPDPBUSD takes ~5 cycles before its result can be added to again, so one
 * accumulator per row would leave the core waiting at one or two rows. */
static inline __attribute__((always_inline)) void tile(
    const int mr, const int nb, const int k, const int n, const int b, const uint8_t *w,
    const uint16_t *scale, const uint16_t *lo, const int8_t *xq, const float *sx,
    const float *sumx, float *y, const int accumulate, const int two) {
    const int groups = k / GROUP;
    const __m512i low4 = _mm512_set1_epi8(0x0F);
    __m512 accf[2][MR];
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < mr; i++) accf[j][i] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i acc_hi[2][MR], acc_lo[2][MR];
        for (int j = 0; j < nb; j++)
            for (int i = 0; i < mr; i++) {
                acc_hi[j][i] = _mm512_setzero_si512();
                acc_lo[j][i] = _mm512_setzero_si512();
            }
        for (int s = 0; s < 4; s++) {
            for (int j = 0; j < nb; j++) {
                const uint8_t *ws = w + ((size_t)(b + j) * groups + g) * 256 + s * 64;
                /* The hardware prefetcher alone left one row at ~half the memory's speed. */
                _mm_prefetch((const char *)(ws + PREFETCH), _MM_HINT_T0);
                __m512i v = _mm512_loadu_si512((const void *)ws);
                __m512i wl = _mm512_and_si512(v, low4);
                __m512i wh = _mm512_and_si512(_mm512_srli_epi16(v, 4), low4);
                for (int i = 0; i < mr; i++) {
                    const int8_t *xs = xq + (size_t)i * 2 * k + (size_t)g * GROUP + s * 8;
                    int32_t hi1, hi2, lo1, lo2;
                    memcpy(&hi1, xs, 4);
                    memcpy(&hi2, xs + 4, 4);
                    memcpy(&lo1, xs + k, 4);
                    memcpy(&lo2, xs + k + 4, 4);
                    acc_hi[j][i] = _mm512_dpbusd_epi32(acc_hi[j][i], wl, _mm512_set1_epi32(hi1));
                    acc_hi[j][i] = _mm512_dpbusd_epi32(acc_hi[j][i], wh, _mm512_set1_epi32(hi2));
                    if (two) {
                        acc_lo[j][i] = _mm512_dpbusd_epi32(acc_lo[j][i], wl, _mm512_set1_epi32(lo1));
                        acc_lo[j][i] = _mm512_dpbusd_epi32(acc_lo[j][i], wh, _mm512_set1_epi32(lo2));
                    }
                }
            }
        }
        for (int j = 0; j < nb; j++) {
            const size_t at = ((size_t)(b + j) * groups + g) * NB;
            __m512 vs = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(scale + at)));
            __m512 vl = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(lo + at)));
            for (int i = 0; i < mr; i++) {
                /* |dot| <= 15 * 32 * (127 * RES + 127): fits int32. */
                __m512i dot = _mm512_add_epi32(
                    _mm512_mullo_epi32(acc_hi[j][i], _mm512_set1_epi32(RES)), acc_lo[j][i]);
                __m512 rowscale = _mm512_mul_ps(vs, _mm512_set1_ps(sx[i * groups + g]));
                accf[j][i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), rowscale, accf[j][i]);
                accf[j][i] = _mm512_fmadd_ps(vl, _mm512_set1_ps(sumx[i * groups + g]), accf[j][i]);
            }
        }
    }
    for (int j = 0; j < nb; j++)
        for (int i = 0; i < mr; i++) {
            float *at = y + (size_t)i * n + (size_t)(b + j) * NB;
            _mm512_storeu_ps(at, accumulate ? _mm512_add_ps(_mm512_loadu_ps(at), accf[j][i]) : accf[j][i]);
        }
}

/* Column blocks outermost, so a block's weights (a few KB) are read from memory once
 * and stay in L1 while each tile of up to 4 rows uses them; a call per (rows, blocks)
 * shape with constant arguments, so the accumulators are registers (at most 12 of 32:
 * more rows or blocks at once spilled them, measured 2x slower at 4 rows). */
static void rows_blocks(int mr, int nb, int k, int n, int b, const uint8_t *w,
                        const uint16_t *scale, const uint16_t *lo, const int8_t *xq,
                        const float *sx, const float *sumx, float *y, int accumulate, int two) {
#define TILE(R, B, T) \
    case R * 100 + B * 10 + T: tile(R, B, k, n, b, w, scale, lo, xq, sx, sumx, y, accumulate, T); break;
    switch (mr * 100 + nb * 10 + (two ? 1 : 0)) {
        TILE(1, 1, 1) TILE(1, 2, 1) TILE(2, 1, 1) TILE(2, 2, 1) TILE(3, 1, 1) TILE(4, 1, 1)
        TILE(1, 1, 0) TILE(1, 2, 0) TILE(2, 1, 0) TILE(2, 2, 0) TILE(3, 1, 0) TILE(4, 1, 0)
    }
#undef TILE
}

/* Two blocks side by side where a tile has one or two rows (see tile): the unit a
 * thread's share of the blocks is counted in. */
static inline int block_unit(int m_rows) { return m_rows <= 2 ? 2 : 1; }

/* Column blocks [b_lo, b_hi) of the matmul below, x already quantized (xq, sx, sumx). */
static void matmul_blocks(int m_rows, int k, const uint8_t *w, const uint16_t *scale,
                          const uint16_t *lo, int n, float *y, int accumulate, int two,
                          const int8_t *xq, const float *sx, const float *sumx, int b_lo,
                          int b_hi) {
    const int groups = k / GROUP, nb = block_unit(m_rows);
    for (int b = b_lo; b < b_hi; b += nb) {
        const int here = b + nb <= b_hi ? nb : 1;
        for (int m0 = 0; m0 < m_rows; m0 += MR) {
            const int mr = m_rows - m0 < MR ? m_rows - m0 : MR;
            rows_blocks(mr, here, k, n, b, w, scale, lo, xq + (size_t)m0 * 2 * k,
                        sx + (size_t)m0 * groups, sumx + (size_t)m0 * groups, y + (size_t)m0 * n,
                        accumulate, two);
        }
    }
}

/* x quantized into ``xq``/``sx`` (a thread's scratch), then column blocks [b_lo, b_hi). */
static void quantize_and_multiply(const float *x, int m_rows, int k, const uint8_t *w,
                                  const uint16_t *scale, const uint16_t *lo, int n, float *y,
                                  int accumulate, int two, int8_t *xq, float *sx, int b_lo,
                                  int b_hi) {
    float *sumx = sx + (size_t)m_rows * (k / GROUP);
    quantize_rows(x, m_rows, k, two, xq, sx, sumx);
    matmul_blocks(m_rows, k, w, scale, lo, n, y, accumulate, two, xq, sx, sumx, b_lo, b_hi);
}

/* The scratch a matmul of ``rows`` rows of ``k`` inputs needs per thread. */
static void matmul_needs(omni_needs *needs, int rows, int k) {
    const size_t xq = (size_t)rows * 2 * k, sx = sizeof(float) * (size_t)rows * (k / GROUP) * 2;
    needs->xq = needs->xq > xq ? needs->xq : xq;
    needs->sx = needs->sx > sx ? needs->sx : sx;
}

/* ---- the rest of a decode step's layer: few calls instead of ~20 small torch ops ---- */

/* out[r] = x[r] / rms(x[r]) * weight, rows of ``hidden`` (a multiple of 16) floats. */
void omni_avx512_rms_norm(const float *x, int rows, int hidden, const float *weight, float eps,
                   float *out) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * hidden;
        __m512 acc = _mm512_setzero_ps();
        for (int i = 0; i < hidden; i += 16) {
            __m512 v = _mm512_loadu_ps(xr + i);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(acc) / hidden + eps);
        __m512 vi = _mm512_set1_ps(inv);
        for (int i = 0; i < hidden; i += 16)
            _mm512_storeu_ps(out + (size_t)r * hidden + i,
                             _mm512_mul_ps(_mm512_mul_ps(_mm512_loadu_ps(xr + i), vi),
                                           _mm512_loadu_ps(weight + i)));
    }
}

/* The indices of the k largest values of each row of x [rows, n], unordered (see
 * topk_rows), 16 values compared at a time (torch.topk on one thread took ~110 us a row
 * of SmolLM2's 49152 logits; this ~10x less). */
static unsigned above16(const float *x, float floor) {
    return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(floor), _CMP_GT_OQ);
}

int omni_avx512_topk(const float *x, int rows, int n, int k, int64_t *out) {
    return topk_rows(x, rows, n, k, out, 16, above16);
}

/* out[r][j] = x[r] . w[ids[r][j]] for int8 rows w = q * scale (a scale per group of 32,
 * float32): the LM head's exact pass over each row's shortlist (see
 * fast_llama.TiedTable). Each weight is q * scale rounded to float32 first, as torch's
 * q.float() * scale; every dot product is on its own, so a row's values do not depend
 * on the other rows (torch's gather, convert and bmm took ~0.4 ms at 8 rows of 64). */
void omni_avx512_q8_dots(const int8_t *q, const float *scale, int k, const float *x,
                         const int64_t *ids, int rows, int per_row, float *out) {
    const int groups = k / GROUP;
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * k;
        for (int j = 0; j < per_row; j++) {
            const int64_t id = ids[(size_t)r * per_row + j];
            const int8_t *qr = q + (size_t)id * k;
            const float *sr = scale + (size_t)id * groups;
            __m512 acc = _mm512_setzero_ps();
            for (int g = 0; g < groups; g++) {
                const __m512 vs = _mm512_set1_ps(sr[g]);
                for (int h = 0; h < GROUP; h += 16) {
                    const __m128i b = _mm_loadu_si128((const __m128i *)(qr + g * GROUP + h));
                    const __m512 w = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs);
                    acc = _mm512_fmadd_ps(w, _mm512_loadu_ps(xr + g * GROUP + h), acc);
                }
            }
            out[(size_t)r * per_row + j] = _mm512_reduce_add_ps(acc);
        }
    }
}

/* e^x for x <= 0 (softmax after subtracting the max): 2^(x log2 e) as 2^i * 2^f with a
 * degree-6 polynomial for 2^f on [-0.5, 0.5] (relative error ~2e-7). */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
    __m512 i = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, i), _mm512_set1_ps(0.69314718055994531f));
    __m512 p = _mm512_set1_ps(1.0f / 720);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, i);
}

/* out[r] = silu(gate) * up, row r of ``gate_up`` being [gate (width), up (width)]. */
void omni_avx512_silu_mul(const float *gate_up, int rows, int width, float *out) {
    for (int r = 0; r < rows; r++) {
        const float *g = gate_up + (size_t)r * 2 * width, *u = g + width;
        float *o = out + (size_t)r * width;
        for (int i = 0; i < width; i += 16) {
            __m512 v = _mm512_loadu_ps(g + i);
            /* silu(v) = v / (1 + e^-v), with e^-|v| so the exponent never overflows. */
            __m512 e = exp_neg(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(v)));
            __m512 one = _mm512_set1_ps(1.0f);
            __mmask16 neg = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_LT_OQ);
            /* sigmoid: 1 / (1 + e) for v >= 0, e / (1 + e) for v < 0 */
            __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
            _mm512_storeu_ps(o + i, _mm512_mul_ps(_mm512_mul_ps(v, sig), _mm512_loadu_ps(u + i)));
        }
    }
}

/* One decode step's attention for ``rows`` rows (row r is cache slot r, at position
 * positions[r], attending to positions 0..positions[r]):
 *   qkv [rows, (heads + 2 kv_heads) * hd]: the q/k/v projection, q and k rows permuted
 *     so each head's rotated pairs are adjacent (see fast_llama);
 *   rope [positions, hd/2, 2]: cos and sin per position and pair;
 *   kcache, vcache [slots, kv_heads, capacity, hd]: the layer's cache, where this
 *     step's k (rotated) and v are written;
 *   out [rows, heads * hd].
 * hd: a multiple of 16 up to OMNI_MAX_HD; heads / kv_heads up to OMNI_MAX_GROUP
 * (int4_kernel.py checks both). */
#define MAX_HD OMNI_MAX_HD
#define MAX_GROUP OMNI_MAX_GROUP
/* K rows read ahead of the one in use (see attend). */
#define APF 16
/* Attention of each row (its rotated q from rope_and_store) over positions
 * 0..positions[r] of its cache (kcache + r * slot_stride), into out [rows, heads * hd];
 * ``scores``: most_positions(positions, rows) * heads / kv_heads floats. */
static void attend(const float *q, int rows, int heads, int kv_heads, int hd,
                   const int64_t *positions, const float *kcache, const float *vcache, int capacity,
                   size_t slot_stride, float *out, float *scores) {
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
                /* K ahead and this V row: short streams the hardware prefetcher is slow on. */
                for (int c = 0; c < hd; c += 16) {
                    _mm_prefetch((const char *)(kt + APF * hd + c), _MM_HINT_T0);
                    _mm_prefetch((const char *)(vh + (size_t)t * hd + c), _MM_HINT_T0);
                }
                for (int g = 0; g < group; g++) {
                    const float *qg = q + ((size_t)r * heads + h * group + g) * hd;
                    __m512 acc = _mm512_setzero_ps();
                    for (int i = 0; i < hd; i += 16)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + i), _mm512_loadu_ps(kt + i), acc);
                    scores[(size_t)g * most + t] = _mm512_reduce_add_ps(acc);
                }
            }
            float inv[MAX_GROUP];
            for (int g = 0; g < group; g++) {
                float *sg = scores + (size_t)g * most;
                float top = sg[0];
                for (int t = 1; t < length; t++) top = sg[t] > top ? sg[t] : top;
                __m512 vtop = _mm512_set1_ps(top), vsum = _mm512_setzero_ps();
                int t = 0;
                for (; t + 16 <= length; t += 16) {
                    __m512 e = exp_neg(_mm512_sub_ps(_mm512_loadu_ps(sg + t), vtop));
                    _mm512_storeu_ps(sg + t, e);
                    vsum = _mm512_add_ps(vsum, e);
                }
                if (t < length) {
                    __mmask16 m = (__mmask16)((1u << (length - t)) - 1);
                    __m512 e = exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, sg + t), vtop));
                    _mm512_mask_storeu_ps(sg + t, m, e);
                    vsum = _mm512_add_ps(vsum, _mm512_maskz_mov_ps(m, e));
                }
                inv[g] = 1.0f / _mm512_reduce_add_ps(vsum);
            }
            /* Each v row once, for every query head of the group. */
            __m512 acc[MAX_GROUP][MAX_HD / 16];
            for (int g = 0; g < group; g++)
                for (int c = 0; c < hd / 16; c++) acc[g][c] = _mm512_setzero_ps();
            /* The next K stream's start (this row's next head, or the next row's first),
             * so the loop after this one does not begin on a cold stream. */
            const float *knext = h + 1 < kv_heads ? kh + (size_t)capacity * hd
                                 : r + 1 < rows   ? kcache + (r + 1) * slot_stride
                                                  : NULL;
            for (int u = 0; u < length; u++) {
                const float *vu = vh + (size_t)u * hd;
                if (knext != NULL && u < APF)
                    for (int c = 0; c < hd; c += 16)
                        _mm_prefetch((const char *)(knext + (size_t)u * hd + c), _MM_HINT_T0);
                for (int c = 0; c < hd / 16; c++) {
                    __m512 v = _mm512_loadu_ps(vu + c * 16);
                    for (int g = 0; g < group; g++)
                        acc[g][c] = _mm512_fmadd_ps(_mm512_set1_ps(scores[(size_t)g * most + u]), v, acc[g][c]);
                }
            }
            for (int g = 0; g < group; g++) {
                float *o = out + (size_t)r * heads * hd + (size_t)(h * group + g) * hd;
                for (int c = 0; c < hd / 16; c++)
                    _mm512_storeu_ps(o + c * 16, _mm512_mul_ps(acc[g][c], _mm512_set1_ps(inv[g])));
            }
        }
    }
}

/* One decode step's RoPE, K/V write and attention (see above). 0, or -1: no memory. */
int omni_avx512_decode_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
                                 int kv_heads, int hd, const float *rope,
                                 const int64_t *positions, float *kcache, float *vcache,
                                 int capacity, float *out) {
    const size_t stride = (size_t)kv_heads * capacity * hd;
    omni_needs needs = {0};
    needs.q = sizeof(float) * (size_t)rows * heads * hd;
    needs.scores = sizeof(float) * (size_t)most_positions(positions, rows) * (heads / kv_heads);
    omni_take(ctx);
    const int code = omni_reserve(ctx, 1, &needs);
    if (code == 0) {
        rope_and_store(qkv, rows, heads, kv_heads, hd, rope, positions, kcache, vcache, capacity,
                       stride, ctx->q);
        attend(ctx->q, rows, heads, kv_heads, hd, positions, kcache, vcache, capacity, stride, out,
               ctx->scratch[0].scores);
    }
    omni_give(ctx);
    return code;
}

/* ---- a matmul, and a decode step's layers, on the context's team ---- */

/* [lo, hi) of ``count`` things for thread ``tid`` of ``threads``, in whole ``unit``s. */
static void share(int count, int unit, int tid, int threads, int *lo, int *hi) {
    const long units = (count + unit - 1) / unit;
    *lo = (int)(units * tid / threads) * unit;
    *hi = (int)(units * (tid + 1) / threads) * unit;
    if (*hi > count) *hi = count;
    if (*lo > count) *lo = count;
}

/* This thread's share of y = x W^T: its column blocks, x quantized into its own scratch
 * (every thread quantizes the whole x: cheaper than a barrier). */
static void matmul_share(const float *x, int rows, int k, const uint8_t *w, const uint16_t *scale,
                         const uint16_t *lo, int n, float *y, int accumulate, int two,
                         const omni_scratch *mine, int tid, int threads) {
    int b_lo, b_hi;
    share(n / NB, block_unit(rows), tid, threads, &b_lo, &b_hi);
    if (b_lo < b_hi)
        quantize_and_multiply(x, rows, k, w, scale, lo, n, y, accumulate, two, mine->xq, mine->sx,
                              b_lo, b_hi);
}

typedef struct {
    omni_ctx *ctx;
    float *h;
    int rows, layers;
    const omni_layer *ls;
    float *const *kcache, *const *vcache;
    int capacity, hidden, heads, kv_heads, hd, inter;
    float eps;
    const float *rope;
    const int64_t *positions;
    size_t slot_stride; /* a row's cache from the previous row's (0: one slot) */
    int threads;
} step_args;

/* One thread's part of a step: the residual stream ``h`` [rows, hidden] through every
 * layer, in place, with the step's K/V written into the caches (as
 * omni_avx512_decode_attention): what fast_llama's per-op decode does, without a Python
 * round trip between the ~8 calls a layer makes (~3 us each). A barrier wherever a step
 * reads what all threads wrote. Norms and the SiLU gate are small and computed by every
 * thread into its own scratch; the context's shared buffers (qkv, q, attn, gate_up) are
 * written a share by each thread. */
static void step_part(void *args, int tid) {
    /* Nothing of *s may be read after the last barrier: the caller's thread is free to
     * return then, and *s is on its stack. So everything the loop reads is a copy. */
    const step_args *s = args;
    omni_ctx *const ctx = s->ctx;
    const omni_scratch *mine = ctx->scratch + tid;
    const int rows = s->rows, hidden = s->hidden, inter = s->inter, T = s->threads;
    const int layers = s->layers;
    const int qkv_width = (s->heads + 2 * s->kv_heads) * s->hd, attn_width = s->heads * s->hd;
    float *const qkv = ctx->qkv, *const q = ctx->q, *const attn = ctx->attn;
    float *const gate_up = ctx->gate_up;
    int r_lo, r_hi;
    share(rows, 1, tid, T, &r_lo, &r_hi);
    const size_t stride = s->slot_stride;
    for (int l = 0; l < layers; l++) {
        const omni_layer *L = s->ls + l;
        omni_avx512_rms_norm(s->h, rows, hidden, L->attn_norm, s->eps, mine->x);
        matmul_share(mine->x, rows, hidden, L->w[0], L->scale[0], L->lo[0], qkv_width, qkv, 0, 1,
                     mine, tid, T);
        omni_barrier(ctx, T);
        float *kc = s->kcache[l] + r_lo * stride, *vc = s->vcache[l] + r_lo * stride;
        if (r_lo < r_hi)
            rope_and_store(qkv + (size_t)r_lo * qkv_width, r_hi - r_lo, s->heads, s->kv_heads,
                           s->hd, s->rope, s->positions + r_lo, kc, vc, s->capacity, stride,
                           q + (size_t)r_lo * attn_width);
        /* One slot (a prefill): a row attends to the K/V other threads' rows wrote. */
        if (stride == 0) omni_barrier(ctx, T);
        if (r_lo < r_hi)
            attend(q + (size_t)r_lo * attn_width, r_hi - r_lo, s->heads, s->kv_heads, s->hd,
                   s->positions + r_lo, kc, vc, s->capacity, stride,
                   attn + (size_t)r_lo * attn_width, mine->scores);
        omni_barrier(ctx, T);
        matmul_share(attn, rows, attn_width, L->w[1], L->scale[1], L->lo[1], hidden, s->h, 1, 1,
                     mine, tid, T);
        omni_barrier(ctx, T);
        omni_avx512_rms_norm(s->h, rows, hidden, L->mlp_norm, s->eps, mine->x);
        matmul_share(mine->x, rows, hidden, L->w[2], L->scale[2], L->lo[2], 2 * inter, gate_up, 0,
                     1, mine, tid, T);
        omni_barrier(ctx, T);
        omni_avx512_silu_mul(gate_up, rows, inter, mine->act);
        matmul_share(mine->act, rows, inter, L->w[3], L->scale[3], L->lo[3], hidden, s->h, 1, 1,
                     mine, tid, T);
        omni_barrier(ctx, T);
    }
}

/* What a step of ``s`` needs: per thread its norm and gate outputs, x quantized for the
 * widest matmul input and the attention's scores; shared the four matmuls' outputs. */
static omni_needs step_needs(const step_args *s) {
    const int attn_width = s->heads * s->hd;
    int kmax = s->hidden > s->inter ? s->hidden : s->inter;
    kmax = kmax > attn_width ? kmax : attn_width;
    const size_t f = sizeof(float), rows = (size_t)s->rows;
    omni_needs needs = {0};
    needs.x = f * rows * s->hidden;
    needs.act = f * rows * s->inter;
    matmul_needs(&needs, s->rows, kmax);
    /* A thread's rows attend to at most the step's longest row. */
    needs.scores = f * (size_t)most_positions(s->positions, s->rows) * (s->heads / s->kv_heads);
    needs.qkv = f * rows * (s->heads + 2 * s->kv_heads) * s->hd;
    needs.q = needs.attn = f * rows * attn_width;
    needs.gate_up = f * rows * 2 * s->inter;
    return needs;
}

/* The layers of a decode step (slot_stride: a slot per row) or of a prefill chunk (0)
 * on ``threads`` threads (1: the caller's alone). 0, or -1: no memory for the buffers. */
static int run_layers(step_args *s, int threads) {
    omni_take(s->ctx);
    s->threads = threads > 1 ? omni_team(s->ctx, threads) : 1;
    const omni_needs needs = step_needs(s);
    const int code = omni_reserve(s->ctx, s->threads, &needs);
    if (code == 0) {
        if (s->threads > 1) omni_post(s->ctx, step_part, s, s->threads);
        step_part(s, 0); /* ends with a barrier all threads pass: the step is done */
    }
    omni_give(s->ctx);
    return code;
}

/* A decode step's layers in one call: row r is slot r, at positions[r]. */
int omni_avx512_decode_layers(omni_ctx *ctx, float *h, int rows, int layers,
                              const omni_layer *ls, float *const *kcache, float *const *vcache,
                              int capacity, int hidden, int heads, int kv_heads, int hd,
                              int inter, float eps, const float *rope, const int64_t *positions,
                              int threads) {
    step_args s = {ctx,    h,  rows,  layers, ls,   kcache,    vcache,
                   capacity, hidden, heads, kv_heads, hd, inter, eps,
                   rope,   positions, (size_t)kv_heads * capacity * hd, 0};
    return run_layers(&s, threads);
}

/* A prefill chunk's layers in one call: ``rows`` tokens of one sequence at ``positions``
 * (ascending), all in one slot (kslot[l], vslot[l]: that slot's cache in layer l), each
 * attending to the slot's positions up to its own (the ones cached before the chunk and
 * the chunk's own). Per row the same arithmetic as a decode step's row. */
int omni_avx512_prefill_layers(omni_ctx *ctx, float *h, int rows, int layers,
                               const omni_layer *ls, float *const *kslot, float *const *vslot,
                               int capacity, int hidden, int heads, int kv_heads, int hd,
                               int inter, float eps, const float *rope, const int64_t *positions,
                               int threads) {
    step_args s = {ctx,    h,  rows,  layers, ls,   kslot,     vslot,
                   capacity, hidden, heads, kv_heads, hd, inter, eps,
                   rope,   positions, 0, 0};
    return run_layers(&s, threads);
}

/* One thread's column blocks, then a barrier: as in step_part, nothing of *a is read
 * after it. */
static void matmul_job(void *args, int tid) {
    const omni_matmul_args *a = args;
    omni_ctx *const ctx = a->ctx;
    const int T = a->threads;
    matmul_share(a->x, a->m_rows, a->k, a->w, a->scale, a->lo, a->n, a->y, a->accumulate, a->two,
                 ctx->scratch + tid, tid, T);
    omni_barrier(ctx, T);
}

/* y = x W^T, or y += x W^T with ``accumulate`` (a residual add for free), on
 * ``threads`` threads, each a share of the column blocks. ``two`` 0 quantizes x to one
 * int8 part only (half the multiplies, ~8 bits): for a pass whose result is only a
 * shortlist (the LM head's, see fast_llama's TiedTable). 0, or -1: no memory. */
int omni_avx512_matmul(omni_ctx *ctx, const float *x, int m_rows, int k, const uint8_t *w,
                       const uint16_t *scale, const uint16_t *lo, int n, float *y, int accumulate,
                       int two, int threads) {
    /* Fewer column units than threads: no share for some; below two units, one thread. */
    const int units = (n / NB + block_unit(m_rows) - 1) / block_unit(m_rows);
    if (threads > units) threads = units;
    omni_take(ctx);
    threads = threads > 1 ? omni_team(ctx, threads) : 1;
    omni_needs needs = {0};
    matmul_needs(&needs, m_rows, k);
    const int code = omni_reserve(ctx, threads, &needs);
    if (code == 0 && threads > 1) {
        omni_matmul_args a = {ctx, x, m_rows, k, w, scale, lo, n, y, accumulate, two, threads};
        omni_post(ctx, matmul_job, &a, threads);
        matmul_job(&a, 0);
    } else if (code == 0) {
        quantize_and_multiply(x, m_rows, k, w, scale, lo, n, y, accumulate, two,
                              ctx->scratch[0].xq, ctx->scratch[0].sx, 0, n / NB);
    }
    omni_give(ctx);
    return code;
}
