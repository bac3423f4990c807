/* moerl_reward: the C ABI of reward plugins, shared libraries that moerl loads
 * with dlopen to score completions. Self-contained: a plugin needs only this
 * header and a C compiler. */
#ifndef MOERL_REWARD_PLUGIN_ABI_H
#define MOERL_REWARD_PLUGIN_ABI_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The version of this ABI. A plugin returns it from moerl_reward_abi_version;
 * the host refuses a plugin whose version differs from its own. Any change to
 * the structs or functions below that an old plugin could misread bumps it. */
#define MOERL_REWARD_ABI_VERSION 1

/* Why generation of a completion ended. */
enum {
    MOERL_FINISH_STOP = 0,   /* end-of-sequence token or a stop string */
    MOERL_FINISH_LENGTH = 1, /* cut at the token limit (max_new_tokens or the context) */
    MOERL_FINISH_ABORT = 2,  /* cut for another reason (cancelled, error) */
};

/* One extra field of the prompt's record, as text: a JSONL record's fields
 * other than "prompt" and "answer" (numbers and booleans in their JSON
 * spelling). */
typedef struct moerl_reward_kv {
    const char *key;   /* NUL-terminated */
    const char *value; /* NUL-terminated */
} moerl_reward_kv_t;

/* One completion to score. Every string is NUL-terminated at its length (the
 * text itself may hold NUL bytes: trust the length). Nothing here may be kept
 * after moerl_reward_score returns. */
typedef struct moerl_reward_input {
    const char *prompt; /* the prompt text, as the model saw it */
    size_t prompt_len;
    const char *completion; /* the generated text, without the stop token */
    size_t completion_len;
    const char *answer; /* the reference answer; "" when the record has none */
    size_t answer_len;
    const moerl_reward_kv_t *extra; /* (n_extra) */
    size_t n_extra;
    int finish_reason;         /* MOERL_FINISH_* */
    int64_t completion_tokens; /* tokens generated; -1 when unknown */
    int32_t sample_index;      /* position of this completion in its group, 0 .. group_size-1 */
    int32_t group_size;        /* completions generated for this prompt (G) */
} moerl_reward_input_t;

/* Flags a plugin may return from the optional moerl_reward_flags. */
#define MOERL_REWARD_THREAD_SAFE 1u /* moerl_reward_score may run concurrently on one state */

/* ------------------------------------------------------------------------
 * Symbols a plugin exports (with C linkage and default visibility).
 *
 * Return values: 0 is success; a negative value is failure, and the plugin
 * writes a one-line reason into the buffer it was given (err or info),
 * truncated to the buffer's capacity and NUL-terminated. Positive values are
 * reserved; the host treats them as failure too.
 *
 * Lifetime and threads: the host calls moerl_reward_init once per reward
 * function it builds (several states may live at once in one process, e.g.
 * while a new function replaces an old one), then moerl_reward_score any
 * number of times, then moerl_reward_fini once. init and fini never overlap
 * any other call on the same state. Unless moerl_reward_flags returns
 * MOERL_REWARD_THREAD_SAFE, the host serialises moerl_reward_score calls on
 * one state; calls on different states may always run concurrently, so
 * global mutable data needs the plugin's own locking.
 *
 * Rewards: *reward must be a finite double. NaN or an infinity is rejected by
 * the host, which fails the sample (and its group) as if the call had
 * returned a negative value.
 * ---------------------------------------------------------------------- */

/* Returns MOERL_REWARD_ABI_VERSION as the plugin was compiled. Required. */
int moerl_reward_abi_version(void);

/* Builds a state from args (the plugin's argument string: reward.function
 * when reward.plugin names the library, or args= of a plugin term in a reward
 * spec; "" when none, never NULL) into *state (which may be set to NULL when
 * the plugin needs none). On failure returns negative with the reason in
 * err[0..errcap) and owns nothing. Required. */
int moerl_reward_init(const char *args, void **state, char *err, size_t errcap);

/* Scores one completion: writes *reward and, optionally, a short human-
 * readable explanation into info[0..infocap) (info[0] is "" on entry). On
 * failure returns negative with the reason in info. Required. */
int moerl_reward_score(void *state, const moerl_reward_input_t *in, double *reward, char *info,
                       size_t infocap);

/* Frees a state made by moerl_reward_init (NULL states included). Required. */
void moerl_reward_fini(void *state);

/* MOERL_REWARD_* flags. Optional: a plugin without it gets 0. */
unsigned moerl_reward_flags(void);

#ifdef __cplusplus
}
#endif
#endif
