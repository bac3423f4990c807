/* test_config: the key table, defaults, loading, every kind of error with its
 * file:line and key, --set overrides, cross-key checks and dump round trips. */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/config.h"
#include "core/status.h"
#include "tests/testutil.h"

static void source_path(char *buf, size_t cap, const char *rel) {
    snprintf(buf, cap, "%s/%s", tu_source_dir(), rel);
}

/* Asserts s contains sub, printing both otherwise. */
#define ASSERT_HAS(s, sub)                                                                         \
    do {                                                                                           \
        const char *s_ = (s), *sub_ = (sub);                                                       \
        if (!strstr(s_, sub_))                                                                     \
            tu_report("expected \"%s\" in:\n%s", sub_, s_);                                        \
        CU_ASSERT_PTR_NOT_NULL(strstr(s_, sub_));                                                  \
    } while (0)

/* The dump of c as a heap string. */
static char *dump_string(const moerl_config_t *c) {
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    config_dump(c, f);
    fclose(f);
    return buf;
}

static void test_table(void) {
    CU_ASSERT(cfg_nkeys >= 80);
    for (int i = 0; i < cfg_nkeys; i++) {
        const cfg_key_t *k = &cfg_keys[i];
        int sec = 0;
        for (int s = 0; s < cfg_nsections; s++)
            sec += !strcmp(cfg_sections[s].name, k->section);
        CU_ASSERT_EQUAL(sec, 1);
        CU_ASSERT(k->doc && strlen(k->doc) > 10);
        CU_ASSERT(k->def != NULL);
        CU_ASSERT_PTR_EQUAL(cfg_find(k->section, k->name), k); /* names are unique */
        if (k->type == CFG_INT) {
            CU_ASSERT(k->imin <= k->imax);
            CU_ASSERT(k->size == sizeof(int) || k->size == sizeof(int64_t));
            if (k->size == sizeof(int))
                CU_ASSERT(k->imin >= INT_MIN && k->imax <= INT_MAX);
        }
        if (k->type == CFG_FLOAT)
            CU_ASSERT(k->fmin <= k->fmax && k->size == sizeof(double));
        if (k->type == CFG_ENUM)
            CU_ASSERT(k->choices && k->choices[0] && k->size == sizeof(int));
    }
    const char *required[] = {"run.name",
                              "run.dir",
                              "run.seed",
                              "run.threads",
                              "run.device",
                              "run.deterministic",
                              "model.path",
                              "model.dtype",
                              "model.recompute",
                              "model.routing_replay",
                              "model.max_seq_len",
                              "lora.rank",
                              "lora.alpha",
                              "lora.targets",
                              "lora.rslora",
                              "lora.dropout",
                              "lora.init_seed",
                              "rollout.group_size",
                              "rollout.kv_cache_tokens",
                              "rollout.merge_adapter",
                              "reward.plugin",
                              "learner.loss_agg",
                              "learner.kl_estimator",
                              "learner.mismatch_kl_max",
                              "learner.ranks",
                              "learner.comm",
                              "data.skip_malformed",
                              "transport.curve_server_key",
                              "transport.allow_insecure_remote",
                              "metrics.status_line"};
    for (size_t i = 0; i < sizeof required / sizeof required[0]; i++) {
        char sec[32];
        const char *dot = strchr(required[i], '.');
        snprintf(sec, sizeof sec, "%.*s", (int)(dot - required[i]), required[i]);
        if (!cfg_find(sec, dot + 1))
            tu_report("missing key %s", required[i]);
        CU_ASSERT_PTR_NOT_NULL(cfg_find(sec, dot + 1));
    }
}

static void test_defaults_valid(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    CU_ASSERT_EQUAL(config_validate(&c), 0);
    CU_ASSERT_STRING_EQUAL(c.run.name, "moerl");
    CU_ASSERT_EQUAL(c.run.device, DEV_CPU);
    CU_ASSERT_EQUAL(c.learner.advantage, CFG_ADV_GRPO);
    CU_ASSERT_EQUAL(c.learner.loss, CFG_LOSS_PPO);
    CU_ASSERT_EQUAL(c.learner.kl_estimator, CFG_KL_K3);
    CU_ASSERT_DOUBLE_EQUAL(c.learner.lr, 1e-5, 0);
    CU_ASSERT_EQUAL(c.lora.targets.n, 4);
    CU_ASSERT(config_lora_has_target(&c, "q_proj") && !config_lora_has_target(&c, "experts"));
    CU_ASSERT_EQUAL(c.lora.dropout, 0.0);
    CU_ASSERT_EQUAL(c.rollout.stop_strings.n, 0);
    CU_ASSERT_EQUAL(c.transport.max_msg_bytes, 268435456);
    CU_ASSERT_STRING_EQUAL(c.transport.control, "tcp://127.0.0.1:5570");
    CU_ASSERT_STRING_EQUAL(c.transport.reward, "tcp://127.0.0.1:5574");
    char dir[256];
    CU_ASSERT_EQUAL(config_run_dir(&c, dir, sizeof dir), 0);
    CU_ASSERT_STRING_EQUAL(dir, "runs/moerl");
    config_free(&c);
    /* An empty file is every default. */
    CU_ASSERT_EQUAL(config_load_string(&c, "# nothing\n", "empty.yaml"), 0);
    CU_ASSERT_EQUAL(c.rollout.group_size, 8);
    config_free(&c);
}

static void test_load_full_file(void) {
    char path[1024];
    moerl_config_t c;
    source_path(path, sizeof path, "configs/grpo-tiny.yaml");
    int rc = config_load_file(&c, path);
    if (rc)
        tu_report("%s", mo_last_error());
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    CU_ASSERT_STRING_EQUAL(c.run.name, "grpo-tiny");
    CU_ASSERT_STRING_EQUAL(c.run.dir, "runs/grpo-tiny");
    CU_ASSERT_EQUAL(c.run.threads, 2);
    CU_ASSERT(c.run.deterministic);
    CU_ASSERT_STRING_EQUAL(c.model.path, "models/tiny-moe");
    CU_ASSERT_EQUAL(c.model.max_seq_len, 256);
    CU_ASSERT_EQUAL(c.lora.rank, 8);
    CU_ASSERT_EQUAL(c.lora.alpha, 16.0);
    CU_ASSERT_EQUAL(c.lora.targets.n, 5);
    CU_ASSERT(config_lora_has_target(&c, "experts") && config_lora_has_target(&c, "o_proj"));
    CU_ASSERT_EQUAL(c.rollout.workers, 2);
    CU_ASSERT_EQUAL(c.reward.workers, 1);
    CU_ASSERT_EQUAL(c.rollout.stop_strings.n, 1);
    CU_ASSERT_STRING_EQUAL(c.rollout.stop_strings.items[0], "\n\n");
    CU_ASSERT_EQUAL(c.learner.lr, strtod("5.0e-5", NULL));
    CU_ASSERT_EQUAL(c.learner.lr_schedule, CFG_LR_COSINE);
    CU_ASSERT_EQUAL(c.learner.overlong, CFG_OVERLONG_FILTER);
    CU_ASSERT_EQUAL(c.learner.minibatches, 2);
    CU_ASSERT(c.learner.dynamic_sampling);
    CU_ASSERT_EQUAL(c.data.task, CFG_TASK_ARITH);
    CU_ASSERT_EQUAL(c.transport.max_msg_bytes, 67108864);
    CU_ASSERT_EQUAL(c.transport.lease_timeout_ms, 30000);
    CU_ASSERT_STRING_EQUAL(c.reward.function, "arith_exact");
    config_free(&c);
}

typedef struct error_case {
    const char *what;
    const char *yaml;
    const char *want[3]; /* substrings of the message */
} error_case_t;

static const error_case_t error_cases[] = {
    {"unknown key",
     "learner:\n  steps: 3\n  lrr: 1e-5\n",
     {"cases/x.yaml:3: learner.lrr: unknown key", "did you mean 'learner.lr'?"}},
    {"key in the wrong section",
     "rollout:\n  lr: 1e-5\n",
     {"cases/x.yaml:2: rollout.lr: unknown key", "did you mean 'learner.lr'?"}},
    {"unknown section",
     "\nlerner:\n  lr: 1e-5\n",
     {"cases/x.yaml:2: lerner: unknown section", "did you mean 'learner'?"}},
    {"wrong type",
     "run:\n  name: x\nlearner:\n  lr: fast\n",
     {"cases/x.yaml:4: learner.lr: expected a number in (0, 1], got \"fast\""}},
    {"mapping for a number",
     "learner:\n  steps:\n    a: 1\n",
     {"cases/x.yaml:2: learner.steps: expected an integer in [1, 1000000000], got a mapping"}},
    {"out of range",
     "learner:\n  clip_low: 0.1\n  lr: 2\n",
     {"cases/x.yaml:3: learner.lr: expected a number in (0, 1], got \"2\""}},
    {"int out of range",
     "rollout:\n  workers: 0\n",
     {"cases/x.yaml:2: rollout.workers: expected an integer in [1, 1024], got \"0\""}},
    {"float for an int",
     "model:\n  max_seq_len: 1.5\n",
     {"cases/x.yaml:2: model.max_seq_len: expected an integer", "got \"1.5\""}},
    {"bool",
     "run:\n  deterministic: yes\n",
     {"cases/x.yaml:2: run.deterministic: expected true or false, got \"yes\""}},
    {"bad enum",
     "\n\nlearner:\n  advantage: ppo\n",
     {"cases/x.yaml:4: learner.advantage: expected one of grpo, dr_grpo, rloo, reinforce, "
      "got \"ppo\""}},
    {"bad list element",
     "lora:\n  targets:\n    - q_proj\n    - qproj\n",
     {"cases/x.yaml:4: lora.targets[1]: expected one of q_proj", "got \"qproj\""}},
    {"repeated list element",
     "lora:\n  targets: [q_proj, v_proj, q_proj]\n",
     {"cases/x.yaml:2: lora.targets[2]: \"q_proj\" is listed twice"}},
    {"scalar for a list",
     "lora:\n  targets: q_proj\n",
     {"cases/x.yaml:2: lora.targets: expected a list of", "got a single value \"q_proj\""}},
    {"dropout",
     "lora:\n  dropout: 0.1\n",
     {"cases/x.yaml:2: lora.dropout: expected exactly 0, got \"0.1\"", "not supported"}},
    {"bad endpoint",
     "transport:\n  work: tcp://127.0.0.1\n",
     {"cases/x.yaml:2: transport.work: expected an endpoint tcp://HOST:PORT or ipc://PATH",
      "got \"tcp://127.0.0.1\""}},
    {"bad endpoint port",
     "transport:\n  work: tcp://127.0.0.1:70000\n",
     {"cases/x.yaml:2: transport.work: expected an endpoint"}},
    {"bad endpoint scheme",
     "transport:\n  work: udp://127.0.0.1:5000\n",
     {"cases/x.yaml:2: transport.work: expected an endpoint"}},
    {"invalid YAML",
     "run:\n  name: \"abc\n",
     {"cases/x.yaml:2: invalid YAML", "double-quoted scalar without closing quote"}},
    {"duplicate key",
     "learner:\n  lr: 1e-5\n  steps: 2\n  lr: 2e-5\n",
     {"cases/x.yaml:4: learner.lr: duplicate key (first set at line 2)"}},
    {"duplicate key, dotted",
     "learner:\n  lr: 1e-5\nlearner.lr: 2e-5\n",
     {"cases/x.yaml:3: learner.lr: duplicate key (first set at line 2)"}},
    {"duplicate section",
     "learner:\n  lr: 1e-5\nlearner:\n  steps: 3\n",
     {"cases/x.yaml:3: learner: duplicate section (first at line 1)"}},
    {"section not a mapping",
     "run:\n  name: a\nlearner: 3\n",
     {"cases/x.yaml:3: learner: expected a mapping of learner settings, got a scalar \"3\""}},
    {"section a list",
     "rollout:\n  - workers\n",
     {"cases/x.yaml:1: rollout: expected a mapping of rollout settings, got a list"}},
    {"top level not a mapping",
     "- run\n- model\n",
     {"cases/x.yaml:1: expected a mapping of sections"}},
    {"two documents",
     "run:\n  name: a\n---\nrun:\n  name: b\n",
     {"cases/x.yaml:4: a config file holds one YAML document"}},
    {"merge key",
     "base: &b\n  lr: 1e-5\nlearner:\n  <<: *b\n",
     {"cases/x.yaml:1: base: unknown section", "cases/x.yaml:4: learner: merge keys"}},
    {"empty non-empty string",
     "reward:\n  function: \"\"\n",
     {"cases/x.yaml:2: reward.function: expected a non-empty string, got \"\""}},
#ifndef MOERL_HAVE_CUDA
    {"cuda device without the CUDA backend",
     "run:\n  seed: 3\n  device: cuda\n",
     {"cases/x.yaml:3: run.device: cuda: this build has no CUDA backend", "use cpu"}},
#endif
    {"cuda device with trainable norms",
     "run:\n  device: cuda\nlora:\n  train_norms: true\n",
     {"cases/x.yaml:4: lora.train_norms: cuda trains LoRA adapters only"}},
    {"cuda device with a merged rollout adapter",
     "run:\n  device: cuda\nrollout:\n  merge_adapter: true\n",
     {"cases/x.yaml:4: rollout.merge_adapter: cuda runs the rollout engine's adapter unmerged"}},
    {"cuda graphs on the CPU",
     "rollout:\n  cuda_graphs: true\n",
     {"cases/x.yaml:2: rollout.cuda_graphs: CUDA graphs replay the GPU's decode steps: they "
      "need run.device: cuda"}},
    {"nccl exchanges on the CPU",
     "learner:\n  ranks: 2\n  comm: nccl\n",
     {"cases/x.yaml:3: learner.comm: nccl exchanges the GPUs' memory: it needs run.device: "
      "cuda"}},
#ifndef MOERL_HAVE_NCCL
    {"nccl exchanges without NCCL",
     "run:\n  device: cuda\nlearner:\n  comm: nccl\n",
     {"cases/x.yaml:4: learner.comm: nccl: this build has no NCCL", "use mpi"}},
#endif
    {"null number",
     "learner:\n  lr:\n",
     {"cases/x.yaml:2: learner.lr: expected a number in (0, 1], got null"}},
};

static void test_errors(void) {
    for (size_t i = 0; i < sizeof error_cases / sizeof error_cases[0]; i++) {
        const error_case_t *t = &error_cases[i];
        moerl_config_t c;
        mo_clear_error();
        int rc = config_load_string(&c, t->yaml, "cases/x.yaml");
        if (rc != MO_ECONFIG)
            tu_report("case '%s': rc %d", t->what, rc);
        CU_ASSERT_EQUAL(rc, MO_ECONFIG);
        for (int j = 0; j < 3 && t->want[j]; j++) {
            if (!strstr(mo_last_error(), t->want[j]))
                tu_report("case '%s': expected \"%s\" in:\n%s", t->what, t->want[j],
                          mo_last_error());
            CU_ASSERT_PTR_NOT_NULL(strstr(mo_last_error(), t->want[j]));
        }
        config_free(&c);
    }
}

static void test_missing_and_unreadable_file(void) {
    moerl_config_t c;
    char dir[512], path[700];
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    snprintf(path, sizeof path, "%s/absent.yaml", dir);
    CU_ASSERT_EQUAL(config_load_file(&c, path), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), path);
    ASSERT_HAS(mo_last_error(), "cannot open: No such file or directory");
    config_free(&c);
    CU_ASSERT_EQUAL(config_load_file(&c, dir), MO_ECONFIG); /* a directory */
    ASSERT_HAS(mo_last_error(), dir);
    config_free(&c);
    tu_rmtree(dir);
}

/* Every error of a file is reported, in file order, not only the first. */
static void test_all_errors_reported(void) {
    const char *yaml = "run:\n  seed: -4\nlearner:\n  lr: fast\n  stepz: 3\n"
                       "lora:\n  targets: [q_proj, bogus]\n";
    char dir[512], path[700];
    CU_ASSERT_EQUAL_FATAL(tu_tmpdir(dir, sizeof dir), 0);
    snprintf(path, sizeof path, "%s/many.yaml", dir);
    FILE *f = fopen(path, "w");
    CU_ASSERT_PTR_NOT_NULL_FATAL(f);
    fputs(yaml, f);
    fclose(f);
    moerl_config_t c;
    config_errors_t errs = {0};
    CU_ASSERT_EQUAL(config_load(&c, path, NULL, 0, &errs), MO_ECONFIG);
    CU_ASSERT_EQUAL_FATAL(errs.n, 4);
    const char *want[] = {":2: run.seed:", ":4: learner.lr:", ":5: learner.stepz: unknown key",
                          ":7: lora.targets[1]:"};
    for (int i = 0; i < 4; i++) {
        ASSERT_HAS(errs.items[i], path);
        ASSERT_HAS(errs.items[i], want[i]);
        ASSERT_HAS(mo_last_error(), want[i]); /* the message lists them too */
    }
    config_errors_free(&errs);
    config_free(&c);
    tu_rmtree(dir);
}

static void test_bad_typo_example(void) {
    char path[1024], want[1200];
    moerl_config_t c;
    source_path(path, sizeof path, "configs/examples/bad-typo.yaml");
    CU_ASSERT_EQUAL(config_load_file(&c, path), MO_ECONFIG);
    snprintf(want, sizeof want, "%s:7: learner.lrr: unknown key; did you mean 'learner.lr'?", path);
    if (strcmp(mo_last_error(), want) != 0)
        tu_report("got: %s\nwant: %s", mo_last_error(), want);
    CU_ASSERT_STRING_EQUAL(mo_last_error(), want);
    config_free(&c);
}

static void test_set(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    CU_ASSERT_EQUAL(config_set(&c, "learner.lr", "2.5e-5"), 0);
    CU_ASSERT_EQUAL(c.learner.lr, 2.5e-5);
    CU_ASSERT_EQUAL(config_set(&c, "learner.lr", "fast"), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), "learner.lr: expected a number in (0, 1], got \"fast\"");
    CU_ASSERT_EQUAL(c.learner.lr, 2.5e-5); /* unchanged by a failed set */
    CU_ASSERT_EQUAL(config_set(&c, "run.deterministic", "true"), 0);
    CU_ASSERT(c.run.deterministic);
    CU_ASSERT_EQUAL(config_set(&c, "run.device", "cuda"), 0);
    CU_ASSERT_EQUAL(c.run.device, DEV_CUDA);
#ifdef MOERL_HAVE_CUDA
    CU_ASSERT_EQUAL(config_validate(&c), 0); /* the learner runs on the GPU */
#else
    CU_ASSERT_EQUAL(config_validate(&c), MO_ECONFIG); /* no CUDA backend, see error cases */
    ASSERT_HAS(mo_last_error(), "run.device: cuda: this build has no CUDA backend");
#endif
    CU_ASSERT_EQUAL(config_set(&c, "run.device", "cpu"), 0);
    CU_ASSERT_EQUAL(config_set(&c, "learner.loss_agg", "seq-mean-token-sum"), 0);
    CU_ASSERT_EQUAL(c.learner.loss_agg, CFG_AGG_SEQ_MEAN_TOKEN_SUM);
    CU_ASSERT_EQUAL(config_set(&c, "transport.max_msg_bytes", "1099511627776"), 0);
    CU_ASSERT_EQUAL(c.transport.max_msg_bytes, (int64_t)1 << 40);
    CU_ASSERT_EQUAL(config_set(&c, "run.seed", "9223372036854775807"), 0);
    CU_ASSERT_EQUAL(c.run.seed, INT64_MAX);
    CU_ASSERT_EQUAL(config_set(&c, "run.seed", "9223372036854775808"), MO_ECONFIG);
    CU_ASSERT_EQUAL(config_set(&c, "lora.targets", "q_proj, experts"), 0);
    CU_ASSERT_EQUAL_FATAL(c.lora.targets.n, 2);
    CU_ASSERT_STRING_EQUAL(c.lora.targets.items[1], "experts");
    CU_ASSERT_EQUAL(config_set(&c, "rollout.stop_strings", "[\"a, b\", '</s>']"), 0);
    CU_ASSERT_EQUAL_FATAL(c.rollout.stop_strings.n, 2);
    CU_ASSERT_STRING_EQUAL(c.rollout.stop_strings.items[0], "a, b");
    CU_ASSERT_STRING_EQUAL(c.rollout.stop_strings.items[1], "</s>");
    CU_ASSERT_EQUAL(config_set(&c, "rollout.stop_strings", ""), 0);
    CU_ASSERT_EQUAL(c.rollout.stop_strings.n, 0);
    CU_ASSERT_EQUAL(config_set(&c, "lora.targets", "q_proj,nope"), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), "lora.targets: element 1: expected one of");
    CU_ASSERT_EQUAL(c.lora.targets.n, 2);
    CU_ASSERT_EQUAL(config_set(&c, "run.name", "  spaced: #name "), 0); /* verbatim */
    CU_ASSERT_STRING_EQUAL(c.run.name, "  spaced: #name ");
    CU_ASSERT_EQUAL(config_set(&c, "learner.lrr", "1"), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), "learner.lrr: unknown key; did you mean 'learner.lr'?");
    CU_ASSERT_EQUAL(config_set(&c, "group_size", "4"), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), "did you mean 'rollout.group_size'?");
    /* Cross-key checks run on demand after sets. */
    CU_ASSERT_EQUAL(config_validate(&c), 0);
    CU_ASSERT_EQUAL(config_set(&c, "rollout.group_size", "1"), 0);
    CU_ASSERT_EQUAL(config_validate(&c), MO_ECONFIG);
    ASSERT_HAS(mo_last_error(), "rollout.group_size >= 2");
    CU_ASSERT_EQUAL(config_set(&c, "learner.advantage", "reinforce"), 0);
    CU_ASSERT_EQUAL(config_validate(&c), 0);
    config_free(&c);
}

/* Overrides through config_load: applied after the file, errors with --set. */
static void test_load_with_sets(void) {
    char path[1024];
    source_path(path, sizeof path, "configs/grpo-tiny.yaml");
    const char *sets[] = {"learner.lr=1e-4", "lora.targets=[q_proj, v_proj]"};
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_load(&c, path, sets, 2, NULL), 0);
    CU_ASSERT_EQUAL(c.learner.lr, 1e-4);
    CU_ASSERT_EQUAL(c.lora.targets.n, 2);
    config_free(&c);
    const char *bad[] = {"learner.lr=2", "novalue", "transport.work=tcp://127.0.0.1:5570"};
    config_errors_t errs = {0};
    CU_ASSERT_EQUAL(config_load(&c, path, bad, 2, &errs), MO_ECONFIG);
    CU_ASSERT_EQUAL_FATAL(errs.n, 2);
    ASSERT_HAS(errs.items[0], "--set: learner.lr: expected a number in (0, 1], got \"2\"");
    ASSERT_HAS(errs.items[1], "--set novalue: expected key=value");
    config_errors_free(&errs);
    config_free(&c);
    /* A cross-key error caused by an override is blamed on the override. */
    CU_ASSERT_EQUAL(config_load(&c, path, bad + 2, 1, &errs), MO_ECONFIG);
    CU_ASSERT_EQUAL_FATAL(errs.n, 1);
    ASSERT_HAS(errs.items[0], "--set: transport.work: endpoint tcp://127.0.0.1:5570 is also "
                              "transport.control's");
    config_errors_free(&errs);
    config_free(&c);
}

typedef struct cross_case {
    const char *yaml;
    const char *want;
} cross_case_t;

static const cross_case_t cross_cases[] = {
    {"transport:\n  control: tcp://127.0.0.1:7000\n  weights: tcp://127.0.0.1:7000\n",
     "x.yaml:3: transport.weights: endpoint tcp://127.0.0.1:7000 is also transport.control's"},
    {"transport:\n  work: tcp://0.0.0.0:7000\n",
     "x.yaml:2: transport.work: tcp://0.0.0.0:7000 is reachable beyond this machine"},
    {"transport:\n  curve_secret_key: keys/secret\n",
     "x.yaml: transport.curve_public_key: CURVE needs both"},
    {"learner:\n  advantage: rloo\nrollout:\n  group_size: 1\n",
     "x.yaml:4: rollout.group_size: advantage rloo compares completions"},
    {"model:\n  max_seq_len: 64\n", "x.yaml:2: model.max_seq_len: rollout.max_new_tokens (512)"},
    {"learner:\n  minibatches: 1000\n", "x.yaml:2: learner.minibatches: 1000 minibatches exceed"},
    {"learner:\n  overlong: penalty\n  overlong_buffer: 0\n",
     "x.yaml:3: learner.overlong_buffer: overlong penalty needs"},
    {"learner:\n  tis_cap: 0.5\n", "x.yaml:2: learner.tis_cap: expected 0 (off) or a cap >= 1"},
    {"rollout:\n  prompt_template: \"Q: {question}\"\n",
     "x.yaml:2: rollout.prompt_template: must contain {prompt} exactly once"},
    {"data:\n  task: jsonl\n", "x.yaml:2: data.task: task jsonl needs data.path"},
    {"rollout:\n  kv_cache_tokens: 100\n", "x.yaml:2: rollout.kv_cache_tokens: 100 tokens"},
};

static void test_cross_checks(void) {
    for (size_t i = 0; i < sizeof cross_cases / sizeof cross_cases[0]; i++) {
        moerl_config_t c;
        CU_ASSERT_EQUAL(config_load_string(&c, cross_cases[i].yaml, "x.yaml"), MO_ECONFIG);
        ASSERT_HAS(mo_last_error(), cross_cases[i].want);
        config_free(&c);
    }
    /* The same endpoints pass with keys, or with the explicit opt-in. */
    const char *ok[] = {
        "transport:\n  work: tcp://10.0.0.2:7000\n  allow_insecure_remote: true\n",
        "transport:\n  work: tcp://*:7000\n  curve_secret_key: s\n  curve_public_key: p\n",
        "transport:\n  work: ipc:///tmp/moerl-work\n  control: tcp://[::1]:7001\n",
        "data:\n  task: jsonl\n  path: data/prompts.jsonl\n",
    };
    for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
        moerl_config_t c;
        int rc = config_load_string(&c, ok[i], "ok.yaml");
        if (rc)
            tu_report("%s", mo_last_error());
        CU_ASSERT_EQUAL(rc, 0);
        config_free(&c);
    }
}

static void check_round_trip(const moerl_config_t *c) {
    char *d1 = dump_string(c);
    moerl_config_t back;
    int rc = config_load_string(&back, d1, "dump.yaml");
    if (rc)
        tu_report("%s\n%s", mo_last_error(), d1);
    CU_ASSERT_EQUAL_FATAL(rc, 0);
    char *d2 = dump_string(&back);
    CU_ASSERT_STRING_EQUAL(d1, d2);
    CU_ASSERT_EQUAL(memcmp(&back.learner.lr, &c->learner.lr, sizeof(double)), 0);
    CU_ASSERT_EQUAL(back.lora.targets.n, c->lora.targets.n);
    config_free(&back);
    free(d1);
    free(d2);
}

static void test_dump_round_trip(void) {
    moerl_config_t c;
    CU_ASSERT_EQUAL_FATAL(config_defaults(&c), 0);
    check_round_trip(&c);
    config_free(&c);
    char path[1024];
    source_path(path, sizeof path, "configs/grpo-tiny.yaml");
    const char *sets[] = {
        "run.name=we\"ird \\ name: #x\ttab",
        "rollout.stop_strings=[\"\\n\", \"a,b\", \"'q'\", \"\"]",
        "learner.lr=0.1",        /* not exact in binary */
        "learner.beta2=0.99999", /* needs many digits */
        "learner.clip_high=3.0000000000000004",
        "reward.plugin=",
    };
    CU_ASSERT_EQUAL_FATAL(config_load(&c, path, sets, 6, NULL), 0);
    CU_ASSERT_STRING_EQUAL(c.run.name, "we\"ird \\ name: #x\ttab");
    CU_ASSERT_EQUAL(c.rollout.stop_strings.n, 4);
    CU_ASSERT_EQUAL(c.learner.clip_high, 3.0000000000000004);
    check_round_trip(&c);
    char *d = dump_string(&c);
    ASSERT_HAS(d, "\n  lr: 0.1\n");
    ASSERT_HAS(d, "\n  targets: [q_proj, k_proj, v_proj, o_proj, experts]\n");
    free(d);
    config_free(&c);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"table", test_table},
        {"defaults_valid", test_defaults_valid},
        {"load_full_file", test_load_full_file},
        {"errors", test_errors},
        {"missing_and_unreadable_file", test_missing_and_unreadable_file},
        {"all_errors_reported", test_all_errors_reported},
        {"bad_typo_example", test_bad_typo_example},
        {"set", test_set},
        {"load_with_sets", test_load_with_sets},
        {"cross_checks", test_cross_checks},
        {"dump_round_trip", test_dump_round_trip},
        CU_TEST_INFO_NULL,
    };
    return tu_main("config", tests);
}
