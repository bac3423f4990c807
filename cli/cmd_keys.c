/* cmd_keys: `moerl keys gen`: create a CURVE keypair for jobs whose sockets
 * reach beyond this machine. */
#include <stdbool.h>
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "core/status.h"
#include "transport/zsock.h"

static void keys_help(FILE *out) {
    fputs("usage: moerl keys gen --out DIR [--name NAME] [--force]\n"
          "\n"
          "Creates a CURVE keypair for encrypting and authenticating the job's ZeroMQ\n"
          "sockets: DIR/NAME.key (the secret key, mode 0600) and DIR/NAME.pub (the\n"
          "public key). DIR is created (mode 0700) when missing. Each file is written\n"
          "to a temporary name and renamed into place.\n"
          "\n"
          "A job uses one server keypair (the learner and the reward workers load it)\n"
          "and one keypair per connecting process (or a shared one):\n"
          "  transport.curve_secret_key: DIR/NAME.key   this process's secret key\n"
          "  transport.curve_public_key: DIR/NAME.pub   its public key (optional)\n"
          "  transport.curve_server_key: DIR/server.pub the server's public key\n"
          "\n"
          "options:\n"
          "  --out DIR    where to write the keys (required)\n"
          "  --name NAME  file name stem, [A-Za-z0-9._-] (default: moerl)\n"
          "  --force      replace existing files\n"
          "  -h, --help   this help\n"
          "\n"
          "exit status: 0 ok, 1 the keys could not be written (or exist), 2 usage errors\n",
          out);
}

static int keys_gen(int argc, char **argv) {
    const char *dir = NULL, *name = "moerl";
    bool force = false;
    for (int i = 0; i < argc; i++) {
        if ((!strcmp(argv[i], "--out") || !strcmp(argv[i], "--name")) && i + 1 >= argc) {
            fprintf(stderr, "moerl keys gen: %s needs a value\n", argv[i]);
            return 2;
        }
        if (!strcmp(argv[i], "--out")) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--name")) {
            name = argv[++i];
        } else if (!strcmp(argv[i], "--force")) {
            force = true;
        } else {
            fprintf(stderr, "moerl keys gen: unknown argument '%s' (see moerl keys --help)\n",
                    argv[i]);
            return 2;
        }
    }
    if (!dir) {
        fprintf(stderr, "moerl keys gen: --out DIR is required (see moerl keys --help)\n");
        return 2;
    }
    char pub[ZSOCK_KEY_LEN + 1];
    int rc = zsock_curve_keygen(dir, name, force, pub);
    if (rc < 0) {
        cli_fail("keys gen", rc);
        return rc == MO_EINVAL ? 2 : 1;
    }
    printf("wrote %s/%s.key (secret, 0600) and %s/%s.pub\npublic key: %s\n", dir, name, dir, name,
           pub);
    return 0;
}

static int keys_run(int argc, char **argv) {
    if (argc < 2) {
        keys_help(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "gen"))
        return keys_gen(argc - 2, argv + 2);
    fprintf(stderr, "moerl keys: unknown subcommand '%s' (gen)\n", argv[1]);
    return 2;
}

const cli_command_t cmd_keys = {
    "keys",
    "create CURVE keypairs for encrypted job sockets",
    keys_run,
    keys_help,
};
