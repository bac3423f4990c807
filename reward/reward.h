/* reward: reward functions built from a spec string (built-in verifiers and
 * weighted sums) or a plugin library, scoring single completions or whole
 * groups, and a holder that swaps functions atomically while scoring runs. */
#ifndef MOERL_REWARD_REWARD_H
#define MOERL_REWARD_REWARD_H

#include <stddef.h>
#include <stdint.h>

#include "reward/moerl_reward.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The input of one completion: the plugin ABI's struct (see moerl_reward.h). */
typedef moerl_reward_input_t reward_input_t;
typedef moerl_reward_kv_t reward_kv_t;

/* A detail buffer this big holds every built-in's explanation untruncated
 * for short answers; longer ones are cut, never overrun. */
#define REWARD_DETAIL_CAP 256

/* Fills *in for one completion: lengths from strlen, answer "" when NULL, no
 * extra fields, finish MOERL_FINISH_STOP, completion_tokens -1, sample 0 of a
 * group of 1. Callers then set the fields they know. */
void reward_input_init(reward_input_t *in, const char *prompt, const char *completion,
                       const char *answer);

/* ------------------------------------------------------------------------
 * Reward functions.
 *
 * Spec grammar (docs/rewards.md has the full reference):
 *   spec   := term { '+' term }
 *   term   := [ weight '*' ] name [ ':' option { ',' option } ]
 *   option := key '=' value
 *   value  := '"' chars '"'   (\" is a quote, \\ a backslash, other
 *                              backslashes are kept as written)
 *           | bare chars      (up to the next ',' or the end of the spec, or
 *                              a '+' followed by a term: a weight and '*', or
 *                              a built-in name; outer spaces trimmed)
 * Spaces are allowed around every token. Examples:
 *   arith_exact
 *   numeric:tol=1e-6,rel=1e-4
 *   regex:pattern=^\d+$
 *   0.8*numeric + 0.2*format:pattern="^.*#### -?\d+$"
 *   plugin:path=/opt/lib/libmyreward.so,args="keyword=hello"
 * A parse error is MO_EINVAL with the 1-based column in the message.
 * ---------------------------------------------------------------------- */
typedef struct reward_fn reward_fn_t;

/* Builds a reward function from a spec. */
int reward_fn_parse(const char *spec, reward_fn_t **out);
/* Builds a reward function from a plugin library: dlopen(path), checks the
 * ABI version and every required symbol, then moerl_reward_init(args). On
 * failure nothing stays loaded and the message names the path and the cause
 * (dlerror's text, the missing symbol, the version pair, or init's reason). */
int reward_fn_plugin(const char *path, const char *args, reward_fn_t **out);
/* The configuration's pair (reward.function, reward.plugin): with plugin
 * NULL or "", function is a spec; otherwise the plugin is loaded and
 * function is its init argument string. */
int reward_fn_from_config(const char *function, const char *plugin, reward_fn_t **out);
void reward_fn_destroy(reward_fn_t **fn);

/* The text the function was built from ("spec", or "plugin PATH ARGS"). */
const char *reward_fn_describe(const reward_fn_t *fn);

/* The parts of a function: one per term of its spec, named after the
 * term's function ("numeric", "format"; a repeated name gets "#2", "#3").
 * A part's value is the term's reward before its weight. */
int reward_fn_n_parts(const reward_fn_t *fn);
const char *reward_fn_part_name(const reward_fn_t *fn, int i);

/* Scores one completion into *reward (finite), its parts into parts
 * (reward_fn_n_parts values; NULL to skip) and a detail line into
 * detail[0..cap) (NULL with cap 0 to skip). MO_EINVAL when the reward is not
 * finite, or the failure a verifier or plugin reports (the message says
 * which). Thread-safe: one function serves many threads. */
int reward_fn_score(const reward_fn_t *fn, const reward_input_t *in, double *reward, double *parts,
                    char *detail, size_t cap);
/* Scores the n completions of one group: rewards (n); parts (n, n_parts) or
 * NULL; details (n, cap), row i the detail of sample i, or NULL. Fails as a
 * whole on the first failing sample, naming it; outputs are then
 * unspecified. */
int reward_fn_score_group(const reward_fn_t *fn, const reward_input_t *in, int n, double *rewards,
                          double *parts, char *details, size_t cap);

/* The built-in verifiers, for help text: i in [0, reward_builtin_count()). */
int reward_builtin_count(void);
const char *reward_builtin_name(int i);
const char *reward_builtin_summary(int i);

/* ------------------------------------------------------------------------
 * Holder: the current reward function and its version, swappable while other
 * threads score. Versions only grow: each swap installs either the version
 * it is given (the job's reward version, as the learner numbers them) or,
 * given 0, the current one + 1. Scoring takes a reference (a lease) on the
 * current function for a whole group, so a group is never scored by two
 * versions; a swap never waits for scoring in flight, and a replaced function
 * is destroyed when its last lease is released.
 * ---------------------------------------------------------------------- */
typedef struct reward_holder reward_holder_t;

/* Takes ownership of *fn (set to NULL) as `version` (>= 1). */
int reward_holder_new(reward_fn_t **fn, uint64_t version, reward_holder_t **out);
/* No lease may be outstanding (programmer error otherwise). */
void reward_holder_destroy(reward_holder_t **h);

/* Installs *fn as `version` (0: the current version + 1) and writes the
 * installed version to *installed (may be NULL). Ownership of *fn is taken
 * (set to NULL) on success; on MO_ESTATE (version not newer than the current
 * one) *fn is left to the caller and nothing changes. */
int reward_holder_swap(reward_holder_t *h, reward_fn_t **fn, uint64_t version, uint64_t *installed);
/* Builds a function with reward_fn_from_config and installs it as above. On
 * failure the current function stays in place and the message says why. */
int reward_holder_swap_config(reward_holder_t *h, const char *function, const char *plugin,
                              uint64_t version, uint64_t *installed);

uint64_t reward_holder_version(reward_holder_t *h);
/* Copies the current function's description into buf[0..cap). */
void reward_holder_describe(reward_holder_t *h, char *buf, size_t cap, uint64_t *version);

/* A reference to the function in force when it was taken: fn and version stay
 * valid, whatever swaps happen, until reward_holder_release. */
typedef struct reward_lease {
    const reward_fn_t *fn;
    uint64_t version;
    void *slot; /* the holder's */
} reward_lease_t;

void reward_holder_acquire(reward_holder_t *h, reward_lease_t *lease);
void reward_holder_release(reward_holder_t *h, reward_lease_t *lease);

/* reward_fn_score_group under a lease on the current function; *version (may
 * be NULL) receives the version that scored every sample of the group. */
int reward_holder_score_group(reward_holder_t *h, const reward_input_t *in, int n, double *rewards,
                              char *details, size_t cap, uint64_t *version);

#ifdef __cplusplus
}
#endif
#endif
