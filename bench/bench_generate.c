/* bench_generate: generation throughput of the rollout engine (tokens/s) for G samples of
 * each of NP prompts, batched and one sequence at a time, side by side with an eager
 * PyTorch KV-cache generation of the same model, weights and shapes (bench/
 * generate_peer.py, run from here through popen), with the ratios. A greedy check
 * compares the tokens both sides generate for two prompts.
 *
 * usage: bench_generate [--model DIR] [--threads N] [--prompts NP] [-n G]
 *                       [--prompt-len P] [--max-tokens N] [--single S] [--python PY]
 *                       [--peer FILE | --no-peer] [--device cpu|cuda] [--adapter-rank R]
 *                       [--cuda-graphs]
 *
 * Without --model, a `moerl init-model --arch qwen3_moe --size small` model (bf16) is
 * written to a temporary directory. Prompts are NP random byte sequences of P tokens;
 * every completion runs exactly N tokens (no stop ids), at temperature 1. "single" runs
 * the first S prompts' G samples one sequence at a time (batch 1, own prefill each).
 * Times include prefill, decode and sampling, not model loading. It also prints which
 * kernel runs the engine's products with bf16 weights (AMX tiles or the vector units).
 * The peer's OpenMP threads sleep at once when idle (OMP_WAIT_POLICY=passive, unless the
 * caller sets a policy for both): with threads that spin, PyTorch's and OpenBLAS's pools
 * take the cores from each other and the peer runs about three times slower at two
 * threads. The engine keeps OpenMP's default (spin briefly, then sleep).
 * --adapter-rank R (R > 0) runs both sides with a LoRA adapter of rank R (alpha 2R) on the
 * attention projections and every expert's gate, up and down, unmerged, as a rollout
 * between two weight updates runs (B random in [-0.01, 0.01], so every adapter path
 * computes); the peer loads the same adapter (PEFT files).
 * --device cuda runs the engine on the GPU (engine_opts_t.device; builds with the CUDA
 * backend); the peer, which runs on the CPU, is then left out. --cuda-graphs replays the
 * device's decode steps as CUDA graphs (engine_opts_t.cuda_graphs). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>

#include "actor/init_model.h"
#include "actor/model.h"
#include "core/backend.h"
#include "core/rng.h"
#include "core/status.h"
#include "lora/adapter.h"
#include "lora/peft.h"
#include "rollout/amx_matmul.h"
#include "rollout/engine.h"

typedef struct args {
    const char *model, *python, *peer;
    int threads, prompts, n, prompt_len, max_tokens, single, no_peer, adapter_rank;
    int cuda_graphs; /* --cuda-graphs: device decode steps replayed as CUDA graphs */
    device_t device;
} args_t;

typedef struct result {
    int64_t tokens;
    double seconds; /* wall clock */
    double cpu;     /* process CPU time (all threads) */
    uint64_t graph_steps, eager_steps; /* --cuda-graphs: steps replayed, steps as usual */
    char graphs_off[256];              /* why graphs went off, if they did */
} result_t;

static double clock_s(clockid_t id) {
    struct timespec ts;
    clock_gettime(id, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int usage(void) {
    fprintf(stderr,
            "usage: bench_generate [--model DIR] [--threads N] [--prompts NP] [-n G] "
            "[--prompt-len P] [--max-tokens N] [--single S] [--python PY] "
            "[--peer FILE | --no-peer] [--device cpu|cuda] [--adapter-rank R] [--cuda-graphs]\n");
    return 2;
}

static int parse_args(args_t *a, int argc, char **argv) {
    *a = (args_t){NULL, "/usr/bin/python3", NULL, 1, 64, 8, 32, 64, 2, 0, 0, 0, DEV_CPU};
    const char *py = getenv("MOERL_PYTHON");
    if (py && *py)
        a->python = py;
    for (int i = 1; i < argc; i++) {
        const char *o = argv[i];
        if (!strcmp(o, "--no-peer")) {
            a->no_peer = 1;
            continue;
        }
        if (!strcmp(o, "--cuda-graphs")) {
            a->cuda_graphs = 1;
            continue;
        }
        if (i + 1 >= argc)
            return -1;
        const char *v = argv[++i];
        int *n = !strcmp(o, "--threads")        ? &a->threads
                 : !strcmp(o, "--prompts")      ? &a->prompts
                 : !strcmp(o, "-n")             ? &a->n
                 : !strcmp(o, "--prompt-len")   ? &a->prompt_len
                 : !strcmp(o, "--max-tokens")   ? &a->max_tokens
                 : !strcmp(o, "--single")       ? &a->single
                 : !strcmp(o, "--adapter-rank") ? &a->adapter_rank
                                                : NULL;
        if (!strcmp(o, "--model"))
            a->model = v;
        else if (!strcmp(o, "--python"))
            a->python = v;
        else if (!strcmp(o, "--peer"))
            a->peer = v;
        else if (!strcmp(o, "--device") && (!strcmp(v, "cpu") || !strcmp(v, "cuda")))
            a->device = !strcmp(v, "cuda") ? DEV_CUDA : DEV_CPU;
        else if (!n || (*n = atoi(v)) < 0)
            return -1;
    }
    if (a->threads < 1 || a->prompts < 2 || a->n < 1 || a->prompt_len < 1 || a->max_tokens < 1 ||
        a->single > a->prompts)
        return -1;
    if (a->device == DEV_CUDA)
        a->no_peer = 1;
    return 0;
}

/* The peer script next to this file unless given. */
static void peer_path(char *buf, size_t cap, const args_t *a) {
    if (a->peer) {
        snprintf(buf, cap, "%s", a->peer);
        return;
    }
    const char *f = __FILE__, *slash = strrchr(f, '/');
    int len = slash ? (int)(slash - f) : 0;
    snprintf(buf, cap, "%.*s%sgenerate_peer.py", len, f, slash ? "/" : "");
}

static gen_request_t request(uint64_t id, const int32_t *prompt, int P, int n, float T,
                             int max_new) {
    gen_request_t r;
    memset(&r, 0, sizeof r);
    r.id = id;
    r.prompt = prompt;
    r.prompt_len = P;
    r.n = n;
    r.params = gen_params_default();
    r.params.sampling.temperature = T;
    r.params.max_new_tokens = max_new;
    r.params.seed = 1;
    r.params.ignore_eos = 1;
    r.params.record_routing = 1;
    return r;
}

/* Runs reqs (nr) on an engine with room for max_batch samples; adds to *res. */
static int run(model_t *m, const args_t *a, const lora_adapter_t *ad, const gen_request_t *reqs,
               int nr, int max_batch, int max_seq, result_t *res, gen_group_t **keep) {
    engine_opts_t o;
    memset(&o, 0, sizeof o);
    o.device = a->device;
    o.cuda_graphs = a->cuda_graphs;
    o.max_batch = max_batch;
    o.max_seq_len = max_seq;
    o.max_prefill_tokens = 8192;
    o.no_default_stops = 1;
    engine_t *e;
    TRY(engine_new(&e, m, &o));
    int rc = ad ? engine_set_adapter(e, ad, 1) : MO_OK;
    gen_group_t **g = rc == MO_OK ? calloc((size_t)nr, sizeof *g) : NULL;
    if (rc < 0 || !g) {
        engine_destroy(&e);
        return rc < 0 ? rc : mo_errorf(MO_ENOMEM, "out of memory");
    }
    double t0 = clock_s(CLOCK_MONOTONIC), c0 = clock_s(CLOCK_PROCESS_CPUTIME_ID);
    rc = engine_generate(e, reqs, nr, g);
    res->seconds += clock_s(CLOCK_MONOTONIC) - t0;
    res->cpu += clock_s(CLOCK_PROCESS_CPUTIME_ID) - c0;
    engine_graph_stats_t gs;
    engine_get_graph_stats(e, &gs);
    res->graph_steps += gs.replayed;
    res->eager_steps += gs.eager;
    if (gs.off_reason[0])
        snprintf(res->graphs_off, sizeof res->graphs_off, "%s", gs.off_reason);
    for (int i = 0; i < nr; i++) {
        if (g[i] && g[i]->status < 0 && rc == MO_OK)
            rc = mo_errorf(g[i]->status, "%s", g[i]->error);
        for (int j = 0; g[i] && j < g[i]->n; j++)
            res->tokens += g[i]->samples[j].n_tokens;
        if (keep && i < 2)
            keep[i] = g[i];
        else
            gen_group_free(&g[i]);
    }
    free(g);
    engine_destroy(&e);
    return rc;
}

static cJSON *int_array(const int32_t *v, int n) {
    cJSON *a = cJSON_CreateArray();
    for (int i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber(v[i]));
    return a;
}

/* The job the peer reads: prompts, shapes, and the greedy tokens to compare with. */
static int write_job(const char *path, const args_t *a, int32_t *const *prompts,
                     gen_group_t *const *greedy, int check_tokens) {
    cJSON *j = cJSON_CreateObject(), *ps = cJSON_CreateArray(), *gt = cJSON_CreateArray();
    for (int i = 0; i < a->prompts; i++)
        cJSON_AddItemToArray(ps, int_array(prompts[i], a->prompt_len));
    for (int i = 0; i < 2; i++)
        cJSON_AddItemToArray(gt, int_array(greedy[i]->samples[0].tokens, check_tokens));
    cJSON_AddItemToObject(j, "prompts", ps);
    cJSON_AddItemToObject(j, "greedy_tokens", gt);
    cJSON_AddNumberToObject(j, "n", a->n);
    cJSON_AddNumberToObject(j, "max_tokens", a->max_tokens);
    cJSON_AddNumberToObject(j, "single", a->single);
    cJSON_AddNumberToObject(j, "threads", a->threads);
    char *s = cJSON_PrintUnformatted(j);
    cJSON_Delete(j);
    FILE *f = fopen(path, "w");
    int rc = s && f && fputs(s, f) >= 0 ? MO_OK : mo_errorf(MO_EIO, "%s: cannot write", path);
    if (f && fclose(f) != 0 && rc == MO_OK)
        rc = mo_errorf(MO_EIO, "%s: cannot write", path);
    free(s);
    return rc;
}

/* Runs the peer; its "RESULT mode=M tokens=T seconds=S cpu=C" lines fill torch[0]
 * (batched) and torch[1] (single), "CHECK greedy_equal=E total=N" the check. */
static int run_peer(const args_t *a, const char *model, const char *adapter, const char *job,
                    result_t torch[2], int *eq, int *total) {
    char peer[1024], cmd[4096], ad[1200] = "";
    peer_path(peer, sizeof peer, a);
    if (*adapter)
        snprintf(ad, sizeof ad, " --adapter '%s'", adapter);
    snprintf(cmd, sizeof cmd,
             "OMP_NUM_THREADS=%d OMP_WAIT_POLICY=\"${OMP_WAIT_POLICY:-passive}\" '%s' '%s' "
             "--model '%s' --job '%s'%s",
             a->threads, a->python, peer, model, job, ad);
    FILE *p = popen(cmd, "r");
    if (!p)
        return mo_errorf(MO_EIO, "cannot run %s", cmd);
    char line[1024], mode[32];
    while (fgets(line, sizeof line, p)) {
        fputs(line, stdout);
        long long tok;
        double sec, cpu;
        if (sscanf(line, "RESULT mode=%31s tokens=%lld seconds=%lf cpu=%lf", mode, &tok, &sec,
                   &cpu) == 4) {
            result_t *r = !strcmp(mode, "batched") ? &torch[0] : &torch[1];
            r->tokens = tok;
            r->seconds = sec;
            r->cpu = cpu;
        }
        sscanf(line, "CHECK greedy_equal=%d total=%d", eq, total);
    }
    int st = pclose(p);
    return st == 0 ? MO_OK : mo_errorf(MO_EIO, "the peer failed (status %d): %s", st, cmd);
}

static double rate(const result_t *r) {
    return r->seconds > 0 ? (double)r->tokens / r->seconds : 0.0;
}

static double cpu_rate(const result_t *r) {
    return r->cpu > 0 ? (double)r->tokens / r->cpu : 0.0;
}

static void show(const char *name, const result_t *r) {
    printf("%-14s: %8.1f tokens/s wall, %8.1f tokens/s of CPU time (%lld tokens, %.2f s wall, "
           "%.2f s CPU)\n",
           name, rate(r), cpu_rate(r), (long long)r->tokens, r->seconds, r->cpu);
}

/* A rank-R adapter on the attention projections and the experts with random B, bound to
 * nothing yet, and its PEFT files in tmp/adapter (dir receives the path) for the peer. */
static int make_adapter(lora_adapter_t **ad, const model_t *m, int R, const char *tmp, char *dir,
                        size_t cap) {
    const char *targets[2] = {"attention", "experts"};
    lora_config_t lc = {R, 2.0f * (float)R, 0, 0.0f, 5, 0, targets, 2};
    TRY(lora_adapter_new(ad, &lc, m->modules, m->n_modules));
    for (int i = 1; i < (*ad)->n_tensors; i += 2) /* B != 0: every adapter path computes */
        rng_fill_uniform((*ad)->params + (*ad)->tensors[i].offset, (*ad)->tensors[i].numel, 5,
                         (uint64_t)i, -0.01f, 0.01f);
    snprintf(dir, cap, "%s/adapter", tmp);
    return peft_save(*ad, dir, NULL);
}

static int bench(const args_t *a, const char *model_dir, const char *tmp) {
    model_t *m;
    TRY(model_open(&m, model_dir, NULL));
    int NP = a->prompts, G = a->n, P = a->prompt_len, N = a->max_tokens, rc = MO_OK;
    int max_seq = P + N + 1;
    int32_t **prompts = calloc((size_t)NP, sizeof *prompts);
    gen_request_t *reqs = calloc((size_t)NP * G, sizeof *reqs);
    for (int i = 0; prompts && i < NP; i++) {
        prompts[i] = malloc(sizeof(int32_t) * (size_t)P);
        for (int t = 0; prompts[i] && t < P; t++)
            prompts[i][t] = (int32_t)(rng_uniform(2024, (uint64_t)i, (uint64_t)t) * 256.0f) % 256;
    }
    result_t warm = {0}, batched = {0}, single = {0}, greedy = {0};
    result_t torch[2] = {{0}, {0}};
    gen_group_t *check[2] = {NULL, NULL};
    int check_tokens = N < 16 ? N : 16, eq = -1, total = 0;
    for (int i = 0; i < NP; i++)
        reqs[i] = request((uint64_t)i, prompts[i], P, G, 1.0f, N);
    device_t dev = a->device;
    lora_adapter_t *ad = NULL;
    char adir[1100] = "";
    if (a->adapter_rank > 0)
        rc = make_adapter(&ad, m, a->adapter_rank, tmp, adir, sizeof adir);
    if (rc == MO_OK)
        rc = run(m, a, ad, reqs, 2, 2 * G, max_seq, &warm, NULL);
    if (rc == MO_OK)
        rc = run(m, a, ad, reqs, NP, NP * G, max_seq, &batched, NULL);
    for (int i = 0; rc == MO_OK && i < a->single; i++)
        for (int j = 0; j < G; j++) {
            gen_request_t r = request((uint64_t)(i * G + j), prompts[i], P, 1, 1.0f, N);
            rc = run(m, a, ad, &r, 1, 1, max_seq, &single, NULL);
        }
    gen_request_t gr[2] = {request(0, prompts[0], P, 1, 0.0f, check_tokens),
                           request(1, prompts[1], P, 1, 0.0f, check_tokens)};
    if (rc == MO_OK)
        rc = run(m, a, ad, gr, 2, 2, max_seq, &greedy, check);
    char job[1100];
    snprintf(job, sizeof job, "%s/job.json", tmp);
    if (rc == MO_OK && !a->no_peer)
        rc = write_job(job, a, prompts, check, check_tokens);
    if (rc == MO_OK && !a->no_peer)
        rc = run_peer(a, model_dir, adir, job, torch, &eq, &total);
    if (rc == MO_OK) {
        printf("config: %s, L %d, D %d, H %d/%d, E %d, K %d, V %d; %d prompts x %d samples, "
               "prompt %d, %d new tokens; %d thread(s)\n",
               m->cfg.model_type, m->L, m->D, m->H, m->Hkv, m->E, m->K, m->V, NP, G, P, N,
               a->threads);
        if (ad)
            printf("adapter: LoRA rank %d, alpha %d, on q, k, v, o and every expert's gate, up "
                   "and down (unmerged)\n",
                   a->adapter_rank, 2 * a->adapter_rank);
        else
            printf("adapter: none\n");
        printf("moerl products with bf16 weights: %s\n",
               dev == DEV_CUDA ? "the CUDA device (engine on the GPU; no CPU peer)"
               : amx_matmul_available()
                   ? "AMX tiles, packed weight copies (activations split into 3 bf16 parts)"
                   : "vector units (CPU kernel table)");
        show("moerl batched", &batched);
        show("moerl single", &single);
        if (a->cuda_graphs)
            printf("cuda graphs: batched %llu of %llu decode steps replayed, single %llu of "
                   "%llu%s%s\n",
                   (unsigned long long)batched.graph_steps,
                   (unsigned long long)(batched.graph_steps + batched.eager_steps),
                   (unsigned long long)single.graph_steps,
                   (unsigned long long)(single.graph_steps + single.eager_steps),
                   batched.graphs_off[0] ? "; off: " : "", batched.graphs_off);
        if (!a->no_peer) {
            show("torch batched", &torch[0]);
            show("torch single", &torch[1]);
            printf("greedy check  : %d of %d tokens equal\n", eq, total);
            printf("ratio moerl / torch, batched: %.2fx wall, %.2fx CPU time\n",
                   rate(&batched) / rate(&torch[0]), cpu_rate(&batched) / cpu_rate(&torch[0]));
            printf("ratio moerl / torch, single : %.2fx wall, %.2fx CPU time\n",
                   rate(&single) / rate(&torch[1]), cpu_rate(&single) / cpu_rate(&torch[1]));
        }
        printf("ratio moerl batched / moerl single: %.2fx wall, %.2fx CPU time\n",
               rate(&batched) / rate(&single), cpu_rate(&batched) / cpu_rate(&single));
    }
    for (int i = 0; i < 2; i++)
        gen_group_free(&check[i]);
    for (int i = 0; prompts && i < NP; i++)
        free(prompts[i]);
    free(prompts);
    free(reqs);
    model_destroy(&m);
    lora_adapter_destroy(&ad);
    return rc;
}

int main(int argc, char **argv) {
    args_t a;
    if (parse_args(&a, argc, argv) < 0)
        return usage();
    backend_cpu_set_threads(a.threads);
    char tmp[] = "/tmp/bench_generate.XXXXXX";
    if (!mkdtemp(tmp)) {
        perror("mkdtemp");
        return 1;
    }
    char model_dir[1100];
    int rc = MO_OK;
    if (a.model) {
        snprintf(model_dir, sizeof model_dir, "%s", a.model);
    } else {
        snprintf(model_dir, sizeof model_dir, "%s/model", tmp);
        model_config_t c;
        init_model_opts_t io = {1, 0.0f};
        rc = init_model_config(&c, ARCH_QWEN3_MOE, INIT_SIZE_SMALL, DT_BF16);
        if (rc == MO_OK)
            rc = init_model_write(model_dir, &c, &io);
    }
    if (rc == MO_OK)
        rc = bench(&a, model_dir, tmp);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", tmp);
    if (system(cmd) != 0)
        fprintf(stderr, "bench_generate: could not remove %s\n", tmp);
    if (rc < 0) {
        fprintf(stderr, "bench_generate: %s\n", mo_last_error());
        return 1;
    }
    return 0;
}
