/* cli_util: helpers shared by the subcommands. */
#include <stdio.h>
#include <string.h>

#include "cli/commands.h"
#include "core/status.h"

int cli_wants_help(int argc, char **argv) {
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--"))
            return 0;
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help"))
            return 1;
    }
    return 0;
}

int cli_fail(const char *cmd, int rc) {
    const char *msg = mo_last_error();
    fprintf(stderr, "moerl %s: %s\n", cmd, msg && *msg ? msg : mo_status_name(rc));
    return rc == MO_EINVAL ? 2 : 1;
}
