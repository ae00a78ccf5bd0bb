/* What the kernel's C files share beyond int4_kernel.h: the context's insides (the
 * working buffers and the thread team). Python holds a context by pointer only. */
#ifndef OMNI_INT4_KERNEL_TEAM_H
#define OMNI_INT4_KERNEL_TEAM_H

#include <pthread.h>
#include <stdatomic.h>
#include <sys/types.h>

#include "int4_kernel.h"

/* A job for the team: thread ``tid`` does its part of ``args``. */
typedef void (*omni_job)(void *args, int tid);

/* One thread's working buffers: each grows to what a call needs and stays. */
typedef struct {
    float *x, *act, *sx, *scores;
    int8_t *xq;
    size_t x_cap, act_cap, sx_cap, scores_cap, xq_cap; /* in bytes */
} omni_scratch;

/* The bytes a call needs: per thread, and shared (each thread writes its own part). */
typedef struct {
    size_t x, act, sx, scores, xq; /* per thread */
    size_t qkv, q, attn, gate_up;  /* shared */
} omni_needs;

struct omni_ctx {
    /* Written by one thread and watched by the others while they spin: each on a cache
     * line of its own, so a spinning thread's reads do not slow the writer's. */
    _Alignas(64) atomic_ulong job; /* bumped for each job posted (under mu) */
    _Alignas(64) atomic_uint bar_count;
    _Alignas(64) atomic_uint bar_gen;
    _Alignas(64) pthread_mutex_t step_mu; /* one call at a time on this context */
    pthread_mutex_t mu;                   /* the posted job, sleepers */
    pthread_cond_t cv;
    int started;  /* threads in the team, the caller's included */
    int sleepers; /* under mu: threads waiting on cv */
    int stopping; /* under mu: omni_ctx_free tells the team to end */
    omni_job work; /* the posted job, its args and its thread count: read under mu, as a */
    void *args;    /* thread not in the job may wake after it ended (and its args are gone) */
    int threads;
    pid_t pid; /* the process the team belongs to (a forked child has none of its threads) */
    pthread_t tids[OMNI_MAX_TEAM];
    struct omni_member {
        struct omni_ctx *ctx;
        int tid;
    } members[OMNI_MAX_TEAM];
    float *qkv, *q, *attn, *gate_up;
    size_t qkv_cap, q_cap, attn_cap, gate_up_cap;
    omni_scratch scratch[OMNI_MAX_TEAM];
};

/* A matmul's arguments as a job hands them to the team's threads (each variant's
 * omni_*_matmul). */
typedef struct {
    omni_ctx *ctx;
    const float *x;
    int m_rows, k;
    const uint8_t *w;
    const uint16_t *scale, *lo;
    int n;
    float *y;
    int accumulate, two, threads;
} omni_matmul_args;

/* Take the context for one call (after a fork, a fresh team first); then give it back. */
void omni_take(omni_ctx *ctx);
void omni_give(omni_ctx *ctx);
/* With the context taken: start threads until the team has ``threads`` (at most
 * OMNI_MAX_TEAM); returns how many it has, at most ``threads``. */
int omni_team(omni_ctx *ctx, int threads);
/* With the context taken: grow the buffers of threads [0, threads) and the shared ones to
 * ``needs``. 0, or -1: no memory (the buffers it had stay). */
int omni_reserve(omni_ctx *ctx, int threads, const omni_needs *needs);
/* Hand ``job`` to threads 1..threads-1; the caller then does its own part (0). */
void omni_post(omni_ctx *ctx, omni_job job, void *args, int threads);
/* Wait until ``threads`` threads have arrived. */
void omni_barrier(omni_ctx *ctx, int threads);

#endif
