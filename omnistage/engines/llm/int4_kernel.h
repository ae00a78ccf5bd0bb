/* The thinker's int4 kernels: their interface, declared once.
 *
 * One shared library (built by setup.py when the package is installed) holds every ISA
 * variant, each compiled from its own file with its own -m flags: the AVX512-VNNI one
 * (int4_kernel_avx512.c: the matmul, a decode step's parts and the whole step in one
 * call on a team of threads) and the AVX2 one (int4_kernel_avx2.c: the matmul and the
 * step's parts). int4_kernel_team.c, compiled for the baseline CPU, says which variants
 * this CPU runs (omni_cpu_lacks) and holds what they share: a context with the working
 * buffers and the thread team; int4_kernel_scalar.h, their scalar parts, is compiled
 * into each. int4_kernel.py binds these functions through ctypes and, at load, compares
 * omni_abi's answers with its own constants and its copy of omni_layer, refusing a
 * library that disagrees. Change anything here and bump OMNI_ABI_VERSION with
 * int4_kernel.py's ABI_VERSION.
 *
 * Weights: w = q * scale + lo, q in 0..15, a scale and a low per OMNI_GROUP inputs (the
 * Q4_1 grid), packed by int4_kernel.py's pack in blocks of OMNI_BLOCK output columns.
 */
#ifndef OMNI_INT4_KERNEL_H
#define OMNI_INT4_KERNEL_H

#include <stddef.h>
#include <stdint.h>

/* What the library exports (setup.py builds with -fvisibility=hidden: nothing else). */
#define OMNI_API __attribute__((visibility("default")))

#define OMNI_ABI_VERSION 2
#define OMNI_GROUP 32    /* weights per scale along the input dimension */
#define OMNI_BLOCK 16    /* output columns computed together (one AVX512 register) */
#define OMNI_MAX_HD 128  /* the attention's largest head dimension */
#define OMNI_MAX_GROUP 8 /* the attention's most query heads per KV head */
#define OMNI_MAX_TOPK 1024
#define OMNI_MAX_TEAM 64 /* threads in a team, the caller's included */

/* One layer's weights: the norms, and (packed, scale, lo) of qkv, o, gate_up, down. */
typedef struct {
    const float *attn_norm, *mlp_norm;
    const uint8_t *w[4];
    const uint16_t *scale[4], *lo[4];
} omni_layer;

/* What omni_abi answers, by number (-1: a question this library does not know). */
enum {
    OMNI_ABI_VERSION_Q = 0,
    OMNI_ABI_GROUP_Q = 1,
    OMNI_ABI_BLOCK_Q = 2,
    OMNI_ABI_MAX_HD_Q = 3,
    OMNI_ABI_MAX_GROUP_Q = 4,
    OMNI_ABI_MAX_TOPK_Q = 5,
    OMNI_ABI_LAYER_SIZE_Q = 6,
    OMNI_ABI_LAYER_ATTN_NORM_Q = 7, /* offsets of omni_layer's fields */
    OMNI_ABI_LAYER_MLP_NORM_Q = 8,
    OMNI_ABI_LAYER_W_Q = 9,
    OMNI_ABI_LAYER_SCALE_Q = 10,
    OMNI_ABI_LAYER_LO_Q = 11,
};
OMNI_API long omni_abi(int what);

/* The variants, by number. */
enum { OMNI_AVX512_VNNI = 0, OMNI_AVX2 = 1 };

/* The CPU features variant ``variant`` needs and this CPU lacks, comma-separated, into
 * ``out`` (empty: the CPU runs it); -1 for an unknown variant. */
OMNI_API int omni_cpu_lacks(int variant, char *out, int size);

/* The working buffers (grown when a call needs more, never per call) and the thread
 * team; calls on one context run one at a time. NULL: no memory. */
typedef struct omni_ctx omni_ctx;
OMNI_API omni_ctx *omni_ctx_new(void);
OMNI_API void omni_ctx_free(omni_ctx *ctx);

/* ---- AVX512-VNNI (int4_kernel_avx512.c) ---- */

/* y[m_rows, n] = x[m_rows, k] W^T, or y += x W^T with ``accumulate``; ``two`` 0: x to
 * one int8 part (~8 bits), else two (~15); on ``threads`` threads. 0, or -1: no memory. */
OMNI_API int omni_avx512_matmul(omni_ctx *ctx, const float *x, int m_rows, int k,
    const uint8_t *w, const uint16_t *scale, const uint16_t *lo, int n, float *y,
    int accumulate, int two, int threads);
OMNI_API void omni_avx512_rms_norm(const float *x, int rows, int hidden, const float *weight,
    float eps, float *out);
OMNI_API void omni_avx512_silu_mul(const float *gate_up, int rows, int width, float *out);
/* 0, or -1: k outside 1..min(n, OMNI_MAX_TOPK). */
OMNI_API int omni_avx512_topk(const float *x, int rows, int n, int k, int64_t *out);
OMNI_API void omni_avx512_q8_dots(const int8_t *q, const float *scale, int k, const float *x,
    const int64_t *ids, int rows, int per_row, float *out);
OMNI_API int omni_avx512_decode_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
    int kv_heads, int hd, const float *rope, const int64_t *positions, float *kcache,
    float *vcache, int capacity, float *out);
OMNI_API int omni_avx512_decode_layers(omni_ctx *ctx, float *h, int rows, int layers,
    const omni_layer *ls, float *const *kcache, float *const *vcache, int capacity, int hidden,
    int heads, int kv_heads, int hd, int inter, float eps, const float *rope,
    const int64_t *positions, int threads);
OMNI_API int omni_avx512_prefill_layers(omni_ctx *ctx, float *h, int rows, int layers,
    const omni_layer *ls, float *const *kslot, float *const *vslot, int capacity, int hidden,
    int heads, int kv_heads, int hd, int inter, float eps, const float *rope,
    const int64_t *positions, int threads);

/* ---- AVX2 (int4_kernel_avx2.c): as the AVX512 ones; only the matmul on a team ---- */

OMNI_API int omni_avx2_matmul(omni_ctx *ctx, const float *x, int m_rows, int k,
    const uint8_t *w, const uint16_t *scale, const uint16_t *lo, int n, float *y,
    int accumulate, int two, int threads);
OMNI_API void omni_avx2_rms_norm(const float *x, int rows, int hidden, const float *weight,
    float eps, float *out);
OMNI_API void omni_avx2_silu_mul(const float *gate_up, int rows, int width, float *out);
OMNI_API int omni_avx2_topk(const float *x, int rows, int n, int k, int64_t *out);
OMNI_API void omni_avx2_q8_dots(const int8_t *q, const float *scale, int k, const float *x,
    const int64_t *ids, int rows, int per_row, float *out);
OMNI_API int omni_avx2_decode_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
    int kv_heads, int hd, const float *rope, const int64_t *positions, float *kcache,
    float *vcache, int capacity, float *out);
/* As decode_attention for a prefill chunk of one sequence: kslot, vslot are its slot's
 * [kv_heads, capacity, hd]; each row attends to the slot's positions up to its own, with
 * the bits the decode step computing it alone gives. */
OMNI_API int omni_avx2_prefill_attention(omni_ctx *ctx, const float *qkv, int rows, int heads,
    int kv_heads, int hd, const float *rope, const int64_t *positions, float *kslot,
    float *vslot, int capacity, float *out);

#endif
