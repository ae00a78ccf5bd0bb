/* What the kernel's variants share, compiled for the baseline CPU: which variants this
 * CPU runs, the ABI's answers, and the context (int4_kernel_team.h): the working
 * buffers, grown when a call needs more, and the thread team.
 *
 * The team: pthreads, not OpenMP (a second OpenMP runtime would fight torch's). Threads
 * 1.. wait on a condition variable between jobs (no spinning while the engine is idle)
 * and run their part of each job posted; the caller's thread is thread 0. The engine's
 * thread tuner picks the count (torch_threads.py), since a second thread pays only while
 * a core is free for it.
 */
#include <immintrin.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "int4_kernel_team.h"

long omni_abi(int what) {
    switch (what) {
    case OMNI_ABI_VERSION_Q: return OMNI_ABI_VERSION;
    case OMNI_ABI_GROUP_Q: return OMNI_GROUP;
    case OMNI_ABI_BLOCK_Q: return OMNI_BLOCK;
    case OMNI_ABI_MAX_HD_Q: return OMNI_MAX_HD;
    case OMNI_ABI_MAX_GROUP_Q: return OMNI_MAX_GROUP;
    case OMNI_ABI_MAX_TOPK_Q: return OMNI_MAX_TOPK;
    case OMNI_ABI_LAYER_SIZE_Q: return (long)sizeof(omni_layer);
    case OMNI_ABI_LAYER_ATTN_NORM_Q: return (long)offsetof(omni_layer, attn_norm);
    case OMNI_ABI_LAYER_MLP_NORM_Q: return (long)offsetof(omni_layer, mlp_norm);
    case OMNI_ABI_LAYER_W_Q: return (long)offsetof(omni_layer, w);
    case OMNI_ABI_LAYER_SCALE_Q: return (long)offsetof(omni_layer, scale);
    case OMNI_ABI_LAYER_LO_Q: return (long)offsetof(omni_layer, lo);
    default: return -1;
    }
}

/* __builtin_cpu_supports checks the OS saves the registers too (XCR0), not only CPUID. */
#define LACKS(name)                                                               \
    if (!__builtin_cpu_supports(name)) {                                          \
        const size_t used = strlen(out);                                          \
        if (used + strlen(name) + 3 <= (size_t)size)                              \
            strcat(strcat(out, used ? ", " : ""), name);                          \
    }

int omni_cpu_lacks(int variant, char *out, int size) {
    if (size < 1) return -1;
    out[0] = '\0';
    __builtin_cpu_init();
    switch (variant) {
    case OMNI_AVX512_VNNI:
        LACKS("avx512f") LACKS("avx512bw") LACKS("avx512vl") LACKS("avx512dq")
        LACKS("avx512vnni") LACKS("fma") LACKS("f16c")
        return 0;
    case OMNI_AVX2:
        LACKS("avx2") LACKS("fma") LACKS("f16c")
        return 0;
    default: return -1;
    }
}
#undef LACKS

/* ---- the context ---- */

omni_ctx *omni_ctx_new(void) {
    omni_ctx *ctx = NULL;
    if (posix_memalign((void **)&ctx, 64, sizeof(omni_ctx)) != 0) return NULL;
    memset(ctx, 0, sizeof(omni_ctx));
    pthread_mutex_init(&ctx->step_mu, NULL);
    pthread_mutex_init(&ctx->mu, NULL);
    pthread_cond_init(&ctx->cv, NULL);
    ctx->started = 1;
    ctx->pid = getpid();
    return ctx;
}

static void free_buffers(omni_ctx *ctx) {
    free(ctx->qkv), free(ctx->q), free(ctx->attn), free(ctx->gate_up);
    for (int t = 0; t < OMNI_MAX_TEAM; t++) {
        omni_scratch *s = ctx->scratch + t;
        free(s->x), free(s->act), free(s->sx), free(s->scores), free(s->xq);
    }
}

void omni_ctx_free(omni_ctx *ctx) {
    if (ctx == NULL) return;
    if (ctx->pid == getpid()) { /* a forked child's copy has no threads to end */
        pthread_mutex_lock(&ctx->mu);
        ctx->stopping = 1;
        atomic_fetch_add(&ctx->job, 1);
        pthread_cond_broadcast(&ctx->cv);
        pthread_mutex_unlock(&ctx->mu);
        for (int t = 1; t < ctx->started; t++) pthread_join(ctx->tids[t], NULL);
    }
    free_buffers(ctx);
    free(ctx);
}

void omni_take(omni_ctx *ctx) {
    /* A forked child has none of the team's threads (fork copies the calling thread
     * only), and its locks are as the fork found them: a team of one, locks anew. */
    const pid_t pid = getpid();
    if (ctx->pid != pid) {
        pthread_mutex_init(&ctx->step_mu, NULL);
        pthread_mutex_init(&ctx->mu, NULL);
        pthread_cond_init(&ctx->cv, NULL);
        ctx->started = 1;
        ctx->sleepers = 0;
        atomic_store(&ctx->job, 0);
        atomic_store(&ctx->bar_count, 0);
        ctx->pid = pid;
    }
    pthread_mutex_lock(&ctx->step_mu);
}

void omni_give(omni_ctx *ctx) { pthread_mutex_unlock(&ctx->step_mu); }

static int grow(void **buffer, size_t *cap, size_t need) {
    if (need <= *cap) return 0;
    void *more = realloc(*buffer, need);
    if (more == NULL) return -1;
    *buffer = more;
    *cap = need;
    return 0;
}

int omni_reserve(omni_ctx *ctx, int threads, const omni_needs *n) {
    int failed = grow((void **)&ctx->qkv, &ctx->qkv_cap, n->qkv) |
                 grow((void **)&ctx->q, &ctx->q_cap, n->q) |
                 grow((void **)&ctx->attn, &ctx->attn_cap, n->attn) |
                 grow((void **)&ctx->gate_up, &ctx->gate_up_cap, n->gate_up);
    for (int t = 0; t < threads; t++) {
        omni_scratch *s = ctx->scratch + t;
        failed |= grow((void **)&s->x, &s->x_cap, n->x) |
                  grow((void **)&s->act, &s->act_cap, n->act) |
                  grow((void **)&s->sx, &s->sx_cap, n->sx) |
                  grow((void **)&s->scores, &s->scores_cap, n->scores) |
                  grow((void **)&s->xq, &s->xq_cap, n->xq);
    }
    return failed ? -1 : 0;
}

/* ---- the team ---- */

/* A spinning barrier: the phases between them last microseconds, far less than a sleep
 * and wake through the kernel. A thread the OS has not scheduled (another process has
 * the core) is waited for with sched_yield, not a hot spin. */
void omni_barrier(omni_ctx *ctx, int threads) {
    const unsigned gen = atomic_load_explicit(&ctx->bar_gen, memory_order_acquire);
    if (atomic_fetch_add_explicit(&ctx->bar_count, 1, memory_order_acq_rel) + 1 ==
        (unsigned)threads) {
        atomic_store_explicit(&ctx->bar_count, 0, memory_order_relaxed);
        atomic_fetch_add_explicit(&ctx->bar_gen, 1, memory_order_release);
        return;
    }
    for (int spins = 0; atomic_load_explicit(&ctx->bar_gen, memory_order_acquire) == gen; spins++) {
        if (spins < 4000)
            _mm_pause();
        else
            sched_yield();
    }
}

/* After a job a thread watches for the next one for TEAM_SPIN_NS before it sleeps: a
 * prefill's matmuls come every ~0.1 ms, and a step's LM head right after its layers,
 * and waking a sleeping thread for each took longer than its share of the work (the
 * caller waited at the barrier for it). It yields the core every 64 pauses, so a
 * process that wants it (the head streaming this step's tokens) runs then, not in the
 * middle of the next step, where the other thread would wait for it at a barrier
 * (served at 8 clients, a pure spin of 0.3 ms: 2.98-3.05x c=1; yielding: 3.18-3.68x). */
#ifndef TEAM_SPIN_NS
#define TEAM_SPIN_NS 300000L
#endif
static long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000L + t.tv_nsec;
}

static void *team_worker(void *arg) {
    const struct omni_member *me = arg;
    omni_ctx *ctx = me->ctx;
    const int tid = me->tid;
    unsigned long seen = 0;
    for (;;) {
        const long until = now_ns() + TEAM_SPIN_NS;
        for (int spins = 0; atomic_load_explicit(&ctx->job, memory_order_acquire) == seen;
             spins++) {
            _mm_pause();
            if ((spins & 63) == 63) {
                if (now_ns() > until) break;
                sched_yield();
            }
        }
        pthread_mutex_lock(&ctx->mu);
        while (atomic_load(&ctx->job) == seen) {
            ctx->sleepers++;
            pthread_cond_wait(&ctx->cv, &ctx->mu);
            ctx->sleepers--;
        }
        if (ctx->stopping) {
            pthread_mutex_unlock(&ctx->mu);
            return NULL;
        }
        seen = atomic_load(&ctx->job);
        omni_job job = tid < ctx->threads ? ctx->work : NULL;
        void *args = ctx->args;
        pthread_mutex_unlock(&ctx->mu);
        if (job != NULL) job(args, tid);
    }
}

void omni_post(omni_ctx *ctx, omni_job job, void *args, int threads) {
    pthread_mutex_lock(&ctx->mu);
    ctx->work = job;
    ctx->args = args;
    ctx->threads = threads;
    atomic_fetch_add_explicit(&ctx->job, 1, memory_order_release);
    if (ctx->sleepers > 0) pthread_cond_broadcast(&ctx->cv);
    pthread_mutex_unlock(&ctx->mu);
}

int omni_team(omni_ctx *ctx, int threads) {
    if (threads > OMNI_MAX_TEAM) threads = OMNI_MAX_TEAM;
    while (ctx->started < threads) {
        const int tid = ctx->started;
        ctx->members[tid].ctx = ctx;
        ctx->members[tid].tid = tid;
        if (pthread_create(&ctx->tids[tid], NULL, team_worker, &ctx->members[tid]) != 0) break;
        ctx->started++;
    }
    return ctx->started < threads ? ctx->started : threads;
}
