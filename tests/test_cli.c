/* test_cli: the real `moerl` executable: --help, --version and the config
 * subcommands, checked by exit status and output. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "tests/testutil.h"

/* Runs `moerl ARGS` through the shell with stderr merged into stdout; returns
 * the exit status (-1 if it could not run) and the output (heap) in *out. */
static int run_moerl(const char *args, char **out) {
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "cd '%s' && '%s' %s 2>&1", tu_source_dir(), tu_moerl_exe(), args);
    *out = NULL;
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t cap = 1 << 14, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        size_t got = fread(buf + n, 1, cap - n - 1, p);
        n += got;
        if (got == 0)
            break;
        if (n == cap - 1) {
            char *bigger = realloc(buf, cap * 2);
            if (!bigger)
                break;
            buf = bigger;
            cap *= 2;
        }
    }
    int st = pclose(p);
    if (buf)
        buf[n] = '\0';
    *out = buf;
    return st != -1 && WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void expect(const char *args, int status, const char *want) {
    char *out = NULL;
    int st = run_moerl(args, &out);
    CU_ASSERT_PTR_NOT_NULL_FATAL(out);
    if (st != status || !strstr(out, want))
        tu_report("moerl %s: status %d (want %d), output:\n%s\n(want \"%s\")", args, st, status,
                  out, want);
    CU_ASSERT_EQUAL(st, status);
    CU_ASSERT_PTR_NOT_NULL(strstr(out, want));
    free(out);
}

static void test_help_and_version(void) {
    expect("--help", 0, "usage: moerl <command>");
    expect("--help", 0, "\n  config ");
    expect("--version", 0, "moerl " MOERL_VERSION "\n");
    expect("", 2, "usage: moerl <command>");
    expect("frobnicate", 2, "unknown command 'frobnicate'");
}

static void test_config_help(void) {
    expect("config --help", 0, "usage: moerl config check FILE...");
    expect("config --help", 0, "--set key=value");
    expect("config check -h", 0, "moerl config docs");
    expect("config", 2, "usage: moerl config");
    expect("config frob", 2, "unknown subcommand 'frob'");
    expect("config check", 2, "no FILE given");
    expect("config check configs/grpo-tiny.yaml --bogus", 2, "unknown option '--bogus'");
}

static void test_config_check(void) {
    expect("config check configs/grpo-tiny.yaml", 0, "configs/grpo-tiny.yaml: ok\n");
    expect("config check configs/examples/bad-typo.yaml", 1,
           "configs/examples/bad-typo.yaml:7: learner.lrr: unknown key; did you mean "
           "'learner.lr'?\n");
    expect("config check configs/grpo-tiny.yaml configs/examples/bad-typo.yaml", 1,
           "configs/grpo-tiny.yaml: ok\n");
    expect("config check configs/no-such-file.yaml", 1, "configs/no-such-file.yaml: cannot open");
    expect("config check configs/grpo-tiny.yaml --set learner.lr=fast", 1,
           "--set: learner.lr: expected a number in (0, 1], got \"fast\"");
}

static void test_config_dump_and_docs(void) {
    expect("config dump configs/grpo-tiny.yaml --set learner.lr=0.25", 0, "\n  lr: 0.25\n");
    expect("config dump configs/grpo-tiny.yaml", 0, "\n  name: \"grpo-tiny\"\n");
    expect("config dump", 0, "\n  name: \"moerl\"\n");
    expect("config dump configs/examples/bad-typo.yaml", 1, "learner.lrr: unknown key");
    expect("config docs", 0, "# Configuration reference\n");
}

int main(void) {
    CU_TestInfo tests[] = {
        {"help_and_version", test_help_and_version},
        {"config_help", test_config_help},
        {"config_check", test_config_check},
        {"config_dump_and_docs", test_config_dump_and_docs},
        CU_TEST_INFO_NULL,
    };
    return tu_main("cli", tests);
}
