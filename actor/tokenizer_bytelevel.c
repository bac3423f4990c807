/* tokenizer_bytelevel: writes the byte-level tokenizer of moerl's built-in tiny
 * models (tokenizer.h, TOK_BYTELEVEL_*) as Hugging Face files, atomically. */
#include "actor/tokenizer.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "actor/bpe.h"
#include "core/status.h"

#define PATH_CAP 4096

static const char *const BYTELEVEL_SPECIALS[] = {"<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>",
                                                 "<|im_end|>"};

static cJSON *bytelevel_component(bool use_regex) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "type", "ByteLevel");
    cJSON_AddBoolToObject(c, "add_prefix_space", 0);
    cJSON_AddBoolToObject(c, "trim_offsets", 1);
    cJSON_AddBoolToObject(c, "use_regex", use_regex);
    return c;
}

static cJSON *bytelevel_tokenizer_json(void) {
    cJSON *root = cJSON_CreateObject();
    cJSON_AddStringToObject(root, "version", "1.0");
    cJSON_AddNullToObject(root, "truncation");
    cJSON_AddNullToObject(root, "padding");
    cJSON *added = cJSON_AddArrayToObject(root, "added_tokens");
    for (int i = 0; i < TOK_BYTELEVEL_VOCAB - 256; i++) {
        cJSON *a = cJSON_CreateObject();
        cJSON_AddNumberToObject(a, "id", 256 + i);
        cJSON_AddStringToObject(a, "content", BYTELEVEL_SPECIALS[i]);
        cJSON_AddBoolToObject(a, "single_word", 0);
        cJSON_AddBoolToObject(a, "lstrip", 0);
        cJSON_AddBoolToObject(a, "rstrip", 0);
        cJSON_AddBoolToObject(a, "normalized", 0);
        cJSON_AddBoolToObject(a, "special", 1);
        cJSON_AddItemToArray(added, a);
    }
    cJSON_AddNullToObject(root, "normalizer");
    cJSON_AddItemToObject(root, "pre_tokenizer", bytelevel_component(false));
    cJSON_AddItemToObject(root, "post_processor", bytelevel_component(false));
    cJSON_AddItemToObject(root, "decoder", bytelevel_component(false));
    cJSON *model = cJSON_AddObjectToObject(root, "model");
    cJSON_AddStringToObject(model, "type", "BPE");
    cJSON_AddNullToObject(model, "dropout");
    cJSON_AddNullToObject(model, "unk_token");
    cJSON_AddNullToObject(model, "continuing_subword_prefix");
    cJSON_AddNullToObject(model, "end_of_word_suffix");
    cJSON_AddBoolToObject(model, "fuse_unk", 0);
    cJSON_AddBoolToObject(model, "byte_fallback", 0);
    cJSON_AddBoolToObject(model, "ignore_merges", 0);
    cJSON *vocab = cJSON_AddObjectToObject(model, "vocab");
    for (int b = 0; b < 256; b++) {
        char byte = (char)b, key[4];
        key[bpe_map(&byte, 1, key)] = 0;
        cJSON_AddNumberToObject(vocab, key, b);
    }
    cJSON_AddArrayToObject(model, "merges");
    return root;
}

static cJSON *bytelevel_config_json(void) {
    cJSON *c = cJSON_CreateObject();
    cJSON_AddStringToObject(c, "tokenizer_class", "PreTrainedTokenizerFast");
    cJSON_AddStringToObject(c, "bos_token", BYTELEVEL_SPECIALS[TOK_BYTELEVEL_BOS - 256]);
    cJSON_AddStringToObject(c, "eos_token", BYTELEVEL_SPECIALS[TOK_BYTELEVEL_EOS - 256]);
    cJSON_AddStringToObject(c, "pad_token", BYTELEVEL_SPECIALS[TOK_BYTELEVEL_PAD - 256]);
    cJSON_AddNullToObject(c, "unk_token");
    cJSON_AddBoolToObject(c, "add_bos_token", 0);
    cJSON_AddBoolToObject(c, "add_eos_token", 0);
    cJSON_AddBoolToObject(c, "clean_up_tokenization_spaces", 0);
    return c;
}

static int write_all(int fd, const char *data, size_t n) {
    while (n > 0) {
        ssize_t w = write(fd, data, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        data += w, n -= (size_t)w;
    }
    return 0;
}

/* dir/name <- data via a temporary file, fsync, rename, fsync(dir). */
static int write_atomic(const char *dir, const char *name, const char *data, size_t n) {
    char path[PATH_CAP], tmp[PATH_CAP];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    snprintf(tmp, sizeof tmp, "%s/.%s.tmp-XXXXXX", dir, name);
    int fd = mkstemp(tmp);
    if (fd < 0)
        return mo_errorf(MO_EIO, "cannot create a temporary file in %s: %s", dir, strerror(errno));
    int rc = 0;
    if (fchmod(fd, 0644) != 0 || write_all(fd, data, n) != 0 || fsync(fd) != 0)
        rc = mo_errorf(MO_EIO, "cannot write %s: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc == 0)
        rc = mo_errorf(MO_EIO, "cannot write %s: %s", tmp, strerror(errno));
    if (rc == 0 && rename(tmp, path) != 0)
        rc = mo_errorf(MO_EIO, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    if (rc < 0) {
        unlink(tmp);
        return rc;
    }
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd < 0 || fsync(dfd) != 0)
        rc = mo_errorf(MO_EIO, "cannot sync directory %s: %s", dir, strerror(errno));
    if (dfd >= 0)
        close(dfd);
    return rc;
}

static int write_json(const char *dir, const char *name, cJSON *doc) {
    char *text = doc ? cJSON_Print(doc) : NULL;
    cJSON_Delete(doc);
    if (!text)
        return mo_errorf(MO_ENOMEM, "out of memory writing %s/%s", dir, name);
    int rc = write_atomic(dir, name, text, strlen(text));
    cJSON_free(text);
    return rc;
}

int tokenizer_write_bytelevel(const char *dir) {
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return mo_errorf(MO_EIO, "cannot create directory %s: %s", dir, strerror(errno));
    TRY(write_json(dir, "tokenizer.json", bytelevel_tokenizer_json()));
    return write_json(dir, "tokenizer_config.json", bytelevel_config_json());
}
