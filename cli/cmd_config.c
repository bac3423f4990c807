/* cmd_config: `moerl config check|dump|docs`: validate, resolve and document
 * job configuration files. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli/commands.h"
#include "core/config.h"
#include "core/status.h"

static void config_help(FILE *out) {
    fputs("usage: moerl config check FILE... [--set key=value ...]\n"
          "       moerl config dump [FILE] [--set key=value ...]\n"
          "       moerl config docs\n"
          "\n"
          "Job configuration files: YAML sections (run, model, lora, rollout, reward,\n"
          "learner, data, transport, metrics) of typed keys. Every key is optional; an\n"
          "unknown key, a wrong type or an out-of-range value is an error that names the\n"
          "file, the line and the key.\n"
          "\n"
          "subcommands:\n"
          "  check FILE...  check each file; prints \"FILE: ok\", or every error found\n"
          "                 (\"FILE:LINE: key: what\") on stderr and exits with status 1\n"
          "  dump [FILE]    print the fully resolved config (defaults, then FILE, then\n"
          "                 the overrides) as YAML that loads back to the same dump;\n"
          "                 without FILE, the defaults\n"
          "  docs           print the markdown reference of every key (docs/config.md)\n"
          "\n"
          "options:\n"
          "  --set key=value  override one key after the file, in order given:\n"
          "                   --set learner.lr=2e-5  --set lora.targets=q_proj,v_proj\n"
          "                   --set 'lora.targets=[q_proj, v_proj]'  (strings verbatim)\n"
          "  -h, --help       this help\n"
          "\n"
          "exit status: 0 ok, 1 configuration errors, 2 usage errors\n",
          out);
}

typedef struct args {
    const char **files; /* (nfiles) */
    int nfiles;
    const char **sets; /* (nsets) */
    int nsets;
} args_t;

/* Splits argv (after the subcommand) into files and --set values. */
static int parse_args(int argc, char **argv, args_t *a) {
    a->files = calloc((size_t)argc + 1, sizeof *a->files);
    a->sets = calloc((size_t)argc + 1, sizeof *a->sets);
    a->nfiles = a->nsets = 0;
    if (!a->files || !a->sets) {
        fprintf(stderr, "moerl config: out of memory\n");
        return 1;
    }
    for (int i = 0; i < argc; i++) {
        if (!strcmp(argv[i], "--set") || !strcmp(argv[i], "-s")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "moerl config: %s needs key=value\n", argv[i]);
                return 2;
            }
            a->sets[a->nsets++] = argv[++i];
        } else if (!strncmp(argv[i], "--set=", 6)) {
            a->sets[a->nsets++] = argv[i] + 6;
        } else if (argv[i][0] == '-' && argv[i][1] != '\0') {
            fprintf(stderr, "moerl config: unknown option '%s' (see moerl config --help)\n",
                    argv[i]);
            return 2;
        } else {
            a->files[a->nfiles++] = argv[i];
        }
    }
    return 0;
}

static void print_errors(const config_errors_t *e, int rc) {
    for (int i = 0; i < e->n; i++)
        fprintf(stderr, "%s\n", e->items[i]);
    if (e->n == 0 && rc < 0)
        fprintf(stderr, "moerl config: %s\n",
                *mo_last_error() ? mo_last_error() : mo_status_name(rc));
}

static int do_check(const args_t *a) {
    if (a->nfiles == 0) {
        fprintf(stderr, "moerl config check: no FILE given (see moerl config --help)\n");
        return 2;
    }
    int status = 0;
    for (int i = 0; i < a->nfiles; i++) {
        moerl_config_t c;
        config_errors_t errs = {0};
        int rc = config_load(&c, a->files[i], a->sets, a->nsets, &errs);
        if (rc == 0) {
            printf("%s: ok\n", a->files[i]);
        } else {
            print_errors(&errs, rc);
            fprintf(stderr, "%s: %d error%s\n", a->files[i], errs.n > 0 ? errs.n : 1,
                    errs.n > 1 ? "s" : "");
            status = 1;
        }
        config_errors_free(&errs);
        config_free(&c);
    }
    return status;
}

static int do_dump(const args_t *a) {
    if (a->nfiles > 1) {
        fprintf(stderr, "moerl config dump: one FILE at most (see moerl config --help)\n");
        return 2;
    }
    moerl_config_t c;
    config_errors_t errs = {0};
    int rc = config_load(&c, a->nfiles ? a->files[0] : NULL, a->sets, a->nsets, &errs);
    if (rc == 0)
        config_dump(&c, stdout);
    else
        print_errors(&errs, rc);
    config_errors_free(&errs);
    config_free(&c);
    return rc == 0 ? 0 : 1;
}

static int config_run(int argc, char **argv) {
    if (argc < 2) {
        config_help(stderr);
        return 2;
    }
    const char *sub = argv[1];
    args_t a;
    int rc = parse_args(argc - 2, argv + 2, &a);
    if (rc == 0) {
        if (!strcmp(sub, "check")) {
            rc = do_check(&a);
        } else if (!strcmp(sub, "dump")) {
            rc = do_dump(&a);
        } else if (!strcmp(sub, "docs")) {
            if (a.nfiles || a.nsets) {
                fprintf(stderr, "moerl config docs: takes no arguments\n");
                rc = 2;
            } else {
                config_doc_markdown(stdout);
                rc = fflush(stdout) == 0 ? 0 : 1;
            }
        } else {
            fprintf(stderr, "moerl config: unknown subcommand '%s' (check, dump or docs)\n", sub);
            rc = 2;
        }
    }
    free(a.files);
    free(a.sets);
    return rc;
}

const cli_command_t cmd_config = {
    "config",
    "check, dump and document job configuration files",
    config_run,
    config_help,
};
