/* bench_train_step: one LoRA training step (forward with logprobs and entropy, backward to
 * the adapter's gradients) of the policy model on the CPU, in tokens/s and GFLOP/s
 * against the machine's measured sgemm rate. Writes the adapter and the batch for the
 * PyTorch peer (bench/train_peer.py); bench/run_train_bench.sh runs both.
 *
 * usage: bench_train_step --model DIR [--threads N] [--tokens T] [--seqs B] [--rank R]
 *                         [--steps S] [--warmup W] [--sgemm N] [--out DIR]
 *
 * FLOPs of one step are counted as bench/step_flops.h says. */
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "actor/model.h"
#include "bench/step_flops.h"
#include "core/backend.h"
#include "core/rng.h"
#include "core/safetensors.h"
#include "core/status.h"
#include "lora/peft.h"

typedef struct args {
    const char *model, *out;
    int threads, tokens, seqs, rank, steps, warmup, sgemm_n;
} args_t;

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static double now_s(void) { return clock_s(CLOCK_MONOTONIC); }

/* CPU seconds of the whole process (all threads): on a shared machine, a one-thread
 * run's CPU time is the time it would take on an idle core. */
static double cpu_s(void) { return clock_s(CLOCK_PROCESS_CPUTIME_ID); }

static int usage(void) {
    fprintf(stderr, "usage: bench_train_step --model DIR [--threads N] [--tokens T] [--seqs B] "
                    "[--rank R] [--steps S] [--warmup W] [--sgemm N] [--out DIR]\n");
    return 2;
}

static int parse_args(args_t *a, int argc, char **argv) {
    *a = (args_t){NULL, NULL, 1, 512, 4, 16, 10, 2, 2048};
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (i + 1 >= argc)
            return -1;
        const char *v = argv[++i];
        int *n = !strcmp(o, "--threads") ? &a->threads
                 : !strcmp(o, "--tokens") ? &a->tokens
                 : !strcmp(o, "--seqs")   ? &a->seqs
                 : !strcmp(o, "--rank")   ? &a->rank
                 : !strcmp(o, "--steps")  ? &a->steps
                 : !strcmp(o, "--warmup") ? &a->warmup
                 : !strcmp(o, "--sgemm")  ? &a->sgemm_n
                                          : NULL;
        if (!strcmp(o, "--model"))
            a->model = v;
        else if (!strcmp(o, "--out"))
            a->out = v;
        else if (!n || (*n = atoi(v)) < 0)
            return -1;
    }
    if (!a->model || a->threads < 1 || a->tokens < 1 || a->seqs < 1 || a->seqs > a->tokens ||
        a->rank < 1 || a->steps < 1 || a->sgemm_n < 64)
        return -1;
    return 0;
}

/* (N, N) x (N, N) sgemm rates in GFLOP/s: the best of three runs by wall time (*wall) and
 * by process CPU time (*cpu). */
static void sgemm_gflops(int N, double *wall, double *cpu) {
    size_t n = (size_t)N * N;
    float *A = malloc(n * sizeof *A), *B = malloc(n * sizeof *B), *C = malloc(n * sizeof *C);
    *wall = *cpu = 0.0;
    if (A && B && C) {
        rng_fill_uniform(A, n, 1, 1, -1.0f, 1.0f);
        rng_fill_uniform(B, n, 1, 2, -1.0f, 1.0f);
        double best_w = 1e30, best_c = 1e30;
        for (int r = 0; r < 4; r++) {
            double c0 = cpu_s(), t0 = now_s();
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, N, N, N, 1.0f, A, N, B, N,
                        0.0f, C, N);
            double dt = now_s() - t0, dc = cpu_s() - c0;
            if (r > 0) { /* the first run warms the pool and the pages */
                best_w = dt < best_w ? dt : best_w;
                best_c = dc < best_c ? dc : best_c;
            }
        }
        double flops = 2.0 * N * (double)N * N;
        *wall = flops / best_w * 1e-9;
        *cpu = flops / best_c * 1e-9;
    }
    free(A), free(B), free(C);
}

/* The batch as the peer reads it (the golden inputs' layout). */
static int write_batch(const char *path, const model_batch_t *b, const float *dlogp,
                       const float *dent) {
    int64_t sT[1] = {b->T}, sC[1] = {b->B + 1};
    st_item_t it[6] = {
        {"tokens", tensor_view((void *)b->tokens, DT_I32, DEV_CPU, 1, sT)},
        {"positions", tensor_view((void *)b->positions, DT_I32, DEV_CPU, 1, sT)},
        {"cu_seqlens", tensor_view((void *)b->cu_seqlens, DT_I32, DEV_CPU, 1, sC)},
        {"targets", tensor_view((void *)b->targets, DT_I32, DEV_CPU, 1, sT)},
        {"dlogp", tensor_view((void *)dlogp, DT_F32, DEV_CPU, 1, sT)},
        {"dentropy", tensor_view((void *)dent, DT_F32, DEV_CPU, 1, sT)},
    };
    char temp[32];
    snprintf(temp, sizeof temp, "%.9g", (double)b->temperature);
    st_meta_t meta[1] = {{"temperature", temp}};
    return st_write(path, it, 6, meta, 1);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

typedef struct bench {
    model_t *m;
    lora_adapter_t *ad;
    model_batch_t b;
    int32_t *tok, *pos, *tgt, *cu;
    float *logp, *ent, *dlogp, *dent;
} bench_t;

static int bench_setup(bench_t *s, const args_t *a) {
    TRY(model_open(&s->m, a->model, NULL));
    const char *targets[2] = {"attention", "experts"};
    lora_config_t lc = {a->rank, 2.0f * a->rank, 0, 0.0f, 5, 0, targets, 2};
    TRY(lora_adapter_new(&s->ad, &lc, s->m->modules, s->m->n_modules));
    for (int i = 1; i < s->ad->n_tensors; i += 2) /* B != 0: every adapter path computes */
        rng_fill_uniform(s->ad->params + s->ad->tensors[i].offset, s->ad->tensors[i].numel, 5,
                         (uint64_t)i, -0.01f, 0.01f);
    TRY(model_set_adapter(s->m, s->ad));
    int T = a->tokens, B = a->seqs;
    s->tok = malloc(sizeof(int32_t) * (size_t)T);
    s->pos = malloc(sizeof(int32_t) * (size_t)T);
    s->tgt = malloc(sizeof(int32_t) * (size_t)T);
    s->cu = malloc(sizeof(int32_t) * (size_t)(B + 1));
    s->logp = malloc(sizeof(float) * (size_t)T);
    s->ent = malloc(sizeof(float) * (size_t)T);
    s->dlogp = malloc(sizeof(float) * (size_t)T);
    s->dent = malloc(sizeof(float) * (size_t)T);
    if (!s->tok || !s->pos || !s->tgt || !s->cu || !s->logp || !s->ent || !s->dlogp || !s->dent)
        return mo_errorf(MO_ENOMEM, "bench: out of memory");
    for (int i = 0; i <= B; i++)
        s->cu[i] = (int32_t)((int64_t)T * i / B);
    for (int t = 0; t < T; t++) {
        s->tok[t] = (int32_t)(rng_uniform(7, 1, (uint64_t)t) * (float)s->m->V) % s->m->V;
        /* a policy-gradient objective: advantages / T and a small entropy bonus */
        s->dlogp[t] = (2.0f * rng_uniform(7, 2, (uint64_t)t) - 1.0f) / (float)T;
        s->dent[t] = 1e-3f / (float)T;
    }
    model_batch_next_token(s->pos, s->tgt, s->tok, s->cu, B);
    model_batch_t b = {T, B, s->tok, s->pos, s->cu, s->tgt, 1.0f, NULL, NULL};
    s->b = b;
    return MO_OK;
}

static void bench_free(bench_t *s) {
    model_destroy(&s->m);
    lora_adapter_destroy(&s->ad);
    free(s->tok), free(s->pos), free(s->tgt), free(s->cu);
    free(s->logp), free(s->ent), free(s->dlogp), free(s->dent);
}

/* One step; fwd and bwd receive the phases' seconds, cpu the step's CPU seconds, loss
 * the objective. */
static int bench_step(bench_t *s, double *fwd, double *bwd, double *cpu, double *loss) {
    double c0 = cpu_s(), t0 = now_s();
    lora_adapter_zero_grads(s->ad);
    TRY(model_forward(s->m, &s->b, s->logp, s->ent, 1));
    double t1 = now_s();
    TRY(model_backward(s->m, s->dlogp, s->dent));
    double t2 = now_s();
    *cpu = cpu_s() - c0;
    *fwd = t1 - t0;
    *bwd = t2 - t1;
    double L = 0.0;
    for (int t = 0; t < s->b.T; t++)
        L += (double)s->dlogp[t] * s->logp[t] + (double)s->dent[t] * s->ent[t];
    *loss = L;
    return MO_OK;
}

static int write_peer_inputs(const bench_t *s, const char *dir) {
    char path[4096];
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/adapter", dir);
    TRY(peft_save(s->ad, path, NULL));
    snprintf(path, sizeof path, "%s/batch.safetensors", dir);
    return write_batch(path, &s->b, s->dlogp, s->dent);
}

/* Medians of the timed steps, in seconds. */
typedef struct timing {
    double fwd, bwd, step, cpu;
} timing_t;

static double median(double *x, int n) {
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    return x[n / 2];
}

/* warmup + steps steps; t receives the medians of the last `steps`, *loss0 the first
 * step's objective. */
static int time_steps(bench_t *s, const args_t *a, timing_t *t, double *loss0) {
    double *v = calloc(4 * (size_t)a->steps, sizeof *v); /* (4, steps) fwd, bwd, step, cpu */
    if (!v)
        return mo_errorf(MO_ENOMEM, "bench: out of memory");
    int rc = MO_OK, n = a->steps;
    for (int i = 0; rc == MO_OK && i < a->warmup + n; i++) {
        double f = 0.0, b = 0.0, c = 0.0, L = 0.0;
        rc = bench_step(s, &f, &b, &c, &L);
        if (i == 0)
            *loss0 = L;
        int j = i - a->warmup;
        if (j >= 0) {
            v[j] = f;
            v[n + j] = b;
            v[2 * n + j] = f + b;
            v[3 * n + j] = c;
        }
    }
    t->fwd = median(v, n);
    t->bwd = median(v + n, n);
    t->step = median(v + 2 * n, n);
    t->cpu = median(v + 3 * n, n);
    free(v);
    return rc;
}

static void report(const bench_t *s, const args_t *a, const timing_t *t, double peak,
                   double peak_cpu, double loss0) {
    const model_t *m = s->m;
    double ff, fb;
    step_flops(m, s->ad, s->pos, s->b.T, &ff, &fb);
    double gf = (ff + fb) / t->step * 1e-9, gc = (ff + fb) / t->cpu * 1e-9;
    printf("model %s: L %d, D %d, H %d, Hkv %d, Dh %d, E %d, K %d, F %d, V %d, weights %s\n",
           a->model, m->L, m->D, m->H, m->Hkv, m->Dh, m->E, m->K, m->cfg.moe_intermediate_size,
           m->V, dtype_name(m->embed.dtype));
    printf("batch %d tokens in %d sequences; LoRA rank %d on attention and experts "
           "(%zu parameters); %d threads\n",
           s->b.T, s->b.B, a->rank, s->ad->n_params, a->threads);
    printf("step (median of %d): %.1f ms = forward %.1f + backward %.1f; %.0f tokens/s; "
           "CPU time %.1f ms per step\n",
           a->steps, 1e3 * t->step, 1e3 * t->fwd, 1e3 * t->bwd, s->b.T / t->step, 1e3 * t->cpu);
    printf("FLOPs per step %.3g (forward %.3g, backward %.3g): %.1f GFLOP/s = %.0f%% of "
           "sgemm %d^3 (%.1f GFLOP/s); per CPU second %.1f GFLOP = %.0f%% of sgemm's %.1f\n",
           ff + fb, ff, fb, gf, 100.0 * gf / peak, a->sgemm_n, peak, gc, 100.0 * gc / peak_cpu,
           peak_cpu);
    printf("RESULT moerl tokens_per_s=%.1f step_ms=%.2f fwd_ms=%.2f bwd_ms=%.2f cpu_ms=%.2f "
           "gflops=%.2f sgemm_gflops=%.2f gflops_cpu=%.2f sgemm_gflops_cpu=%.2f "
           "flops_per_step=%.6g loss0=%.9g\n",
           s->b.T / t->step, 1e3 * t->step, 1e3 * t->fwd, 1e3 * t->bwd, 1e3 * t->cpu, gf, peak,
           gc, peak_cpu, ff + fb, loss0);
}

static int run(const args_t *a) {
    backend_cpu_set_threads(a->threads);
    double peak, peak_cpu, loss0 = 0.0;
    sgemm_gflops(a->sgemm_n, &peak, &peak_cpu);
    bench_t s;
    memset(&s, 0, sizeof s);
    timing_t t = {0.0, 0.0, 0.0, 0.0};
    int rc = bench_setup(&s, a);
    if (rc == MO_OK && a->out)
        rc = write_peer_inputs(&s, a->out);
    if (rc == MO_OK)
        rc = time_steps(&s, a, &t, &loss0);
    if (rc == MO_OK)
        report(&s, a, &t, peak, peak_cpu, loss0);
    bench_free(&s);
    return rc;
}

int main(int argc, char **argv) {
    args_t a;
    if (parse_args(&a, argc, argv) < 0)
        return usage();
    int rc = run(&a);
    if (rc < 0) {
        fprintf(stderr, "bench_train_step: %s\n", mo_last_error());
        return 1;
    }
    return 0;
}
