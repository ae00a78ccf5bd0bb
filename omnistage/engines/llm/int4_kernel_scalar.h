/* The scalar parts the AVX512 and AVX2 variants share, compiled into each with its own
 * flags: RoPE with the K/V write (each variant's prefill and decode rows compute it
 * alike, so their attention reads the same cache bits), the scores' size, and the
 * top-k's heap around each variant's vector compare. */
#ifndef OMNI_INT4_KERNEL_SCALAR_H
#define OMNI_INT4_KERNEL_SCALAR_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "int4_kernel.h"

/* RoPE on each row's q (scaled by 1/sqrt(hd), into q [rows, heads * hd]) and k, and k
 * and v into the cache at the row's position: row r's cache is kcache + r * slot_stride
 * (a decode step: a slot per row; a prefill: 0, every row in one slot). */
static inline void rope_and_store(const float *qkv, int rows, int heads, int kv_heads,
                                  int hd, const float *rope, const int64_t *positions,
                                  float *kcache, float *vcache, int capacity,
                                  size_t slot_stride, float *q) {
    const int width = (heads + 2 * kv_heads) * hd;
    const float scale = 1.0f / sqrtf((float)hd);
    for (int r = 0; r < rows; r++) {
        const int64_t pos = positions[r];
        const float *cs = rope + (size_t)pos * hd;
        const float *row = qkv + (size_t)r * width;
        float *kr = kcache + r * slot_stride, *vr = vcache + r * slot_stride;
        for (int h = 0; h < heads + kv_heads; h++) {
            const float *src = row + (size_t)h * hd;
            float *dst = h < heads ? q + ((size_t)r * heads + h) * hd
                                   : kr + ((size_t)(h - heads) * capacity + pos) * hd;
            const float mul = h < heads ? scale : 1.0f;
            for (int i = 0; i < hd; i += 2) {
                float a = src[i], b = src[i + 1], c = cs[i], s = cs[i + 1];
                dst[i] = (a * c - b * s) * mul;
                dst[i + 1] = (a * s + b * c) * mul;
            }
        }
        for (int h = 0; h < kv_heads; h++)
            memcpy(vr + ((size_t)h * capacity + pos) * hd, row + (size_t)(heads + kv_heads + h) * hd,
                   sizeof(float) * hd);
    }
}

/* The longest a row attends to: ``scores`` holds that many per query head of a group. */
static inline int most_positions(const int64_t *positions, int rows) {
    int most = 0;
    for (int r = 0; r < rows; r++) most = positions[r] + 1 > most ? (int)positions[r] + 1 : most;
    return most;
}

/* Restore the min-heap v (indices ix alongside) of k values below ``at``. */
static inline void sift_down(float *v, int64_t *ix, int k, int at) {
    for (;;) {
        int l = 2 * at + 1, r = l + 1, m = at;
        if (l < k && v[l] < v[m]) m = l;
        if (r < k && v[r] < v[m]) m = r;
        if (m == at) return;
        float tv = v[at];
        int64_t ti = ix[at];
        v[at] = v[m], ix[at] = ix[m];
        v[m] = tv, ix[m] = ti;
        at = m;
    }
}

/* The lanes of x[0, width) above ``floor``, as a bit mask: a variant's vector compare. */
typedef unsigned (*omni_above)(const float *x, float floor);

/* The indices of the k largest values of each row of x [rows, n], unordered (k <= n,
 * k <= OMNI_MAX_TOPK): a min-heap of the best k so far, and ``above`` (``width`` values
 * at a time) against its smallest lets almost every value past without a look. NaN
 * never enters. 0, or -1: k out of range. */
static inline int topk_rows(const float *x, int rows, int n, int k, int64_t *out, int width,
                            omni_above above) {
    if (k < 1 || k > n || k > OMNI_MAX_TOPK) return -1;
    float v[OMNI_MAX_TOPK];
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * n;
        int64_t *ix = out + (size_t)r * k;
        for (int i = 0; i < k; i++) v[i] = xr[i] == xr[i] ? xr[i] : -INFINITY, ix[i] = i;
        for (int i = k / 2 - 1; i >= 0; i--) sift_down(v, ix, k, i);
        int j = k;
        for (; j + width <= n; j += width) {
            unsigned more = above(xr + j, v[0]);
            while (more) {
                const int t = __builtin_ctz(more);
                more &= more - 1;
                if (xr[j + t] > v[0]) {
                    v[0] = xr[j + t], ix[0] = j + t;
                    sift_down(v, ix, k, 0);
                }
            }
        }
        for (; j < n; j++)
            if (xr[j] > v[0]) {
                v[0] = xr[j], ix[0] = j;
                sift_down(v, ix, k, 0);
            }
    }
    return 0;
}

#endif
