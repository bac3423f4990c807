/* bpe: byte-level BPE model with rank-ordered merges and a word cache. */
#include "actor/bpe.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "actor/unicode.h"
#include "core/status.h"

/* ---- growable id arrays ---- */

int bpe_ids_push(bpe_ids_t *ids, int32_t id) {
    if (ids->n == ids->cap) {
        size_t cap = ids->cap ? 2 * ids->cap : 64;
        int32_t *v = realloc(ids->v, cap * sizeof *v);
        if (!v)
            return mo_errorf(MO_ENOMEM, "bpe: out of memory for %zu token ids", cap);
        ids->v = v, ids->cap = cap;
    }
    ids->v[ids->n++] = id;
    return 0;
}

void bpe_ids_free(bpe_ids_t *ids) {
    free(ids->v);
    *ids = (bpe_ids_t){0};
}

/* ---- GPT-2 byte <-> unicode mapping ---- */

static bool byte_is_printable(unsigned b) {
    return (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

uint32_t bpe_byte_char(uint8_t b) {
    if (byte_is_printable(b))
        return b;
    uint32_t n = 0; /* rank of b among the non-printable bytes */
    for (unsigned x = 0; x < b; x++)
        n += !byte_is_printable(x);
    return 256 + n;
}

int bpe_char_byte(uint32_t cp) {
    if (cp < 256)
        return byte_is_printable(cp) ? (int)cp : -1;
    if (cp >= 256 + 68)
        return -1;
    uint32_t n = cp - 256;
    for (unsigned x = 0; x < 256; x++)
        if (!byte_is_printable(x) && n-- == 0)
            return (int)x;
    return -1;
}

static uint32_t byte_char_tab[256];
static int16_t char_byte_tab[256 + 68];
static pthread_once_t map_once = PTHREAD_ONCE_INIT;

static void map_build(void) {
    for (unsigned b = 0; b < 256; b++)
        byte_char_tab[b] = bpe_byte_char((uint8_t)b);
    for (uint32_t c = 0; c < 256 + 68; c++)
        char_byte_tab[c] = (int16_t)bpe_char_byte(c);
}

size_t bpe_map(const char *bytes, size_t n, char *out) {
    pthread_once(&map_once, map_build);
    size_t len = 0;
    for (size_t i = 0; i < n; i++)
        len += uni_put(byte_char_tab[(uint8_t)bytes[i]], out + len);
    return len;
}

bool bpe_unmap(const char *s, size_t n, char *out, size_t *out_len) {
    pthread_once(&map_once, map_build);
    size_t len = 0;
    for (size_t i = 0; i < n;) {
        size_t l;
        uint32_t c = uni_next(s + i, n - i, &l);
        if (c >= 256 + 68 || char_byte_tab[c] < 0)
            return false;
        out[len++] = (char)(uint8_t)char_byte_tab[c];
        i += l;
    }
    *out_len = len;
    return true;
}

/* ---- the model ---- */

enum { TOK_NONE = 0, TOK_MAPPED = 1, TOK_RAW = 2 };

typedef struct {
    uint32_t off, len; /* the token's bytes in pool */
    uint8_t kind;      /* TOK_NONE, TOK_MAPPED or TOK_RAW (key not all mapped) */
} tok_t;

typedef struct {
    uint64_t key; /* (left << 32) | right; EMPTY_KEY when free */
    int32_t rank, id;
} mslot_t;

#define EMPTY_KEY UINT64_MAX
#define CACHE_SLOTS 16384
#define CACHE_MAX 8192 /* entries before the cache is emptied */
#define CACHE_WORD 256 /* longest word (bytes) worth caching */

typedef struct {
    uint64_t h;
    char *key;    /* NULL when free; one block holding ids then key bytes */
    int32_t *ids; /* (nids) */
    uint32_t klen, nids;
} centry_t;

typedef struct {
    pthread_mutex_t mu;
    centry_t *slots; /* (CACHE_SLOTS) */
    size_t n;
} cache_t;

struct bpe {
    char *pool; /* every token's bytes, back to back */
    size_t pool_n, pool_cap;
    tok_t *tok; /* (tok_cap) indexed by id */
    size_t tok_cap, size;
    int32_t *vslot; /* (vcap) ids of mapped tokens by bytes, -1 free */
    size_t vcap, vn;
    int32_t *raw_ids; /* (nraw) ids of tokens whose key is not all mapped */
    size_t nraw, raw_cap;
    mslot_t *mslot; /* (mcap) merges by pair */
    size_t mcap, mn, nmerges;
    int32_t byte_id[256];
    bool ignore_merges;
    cache_t *cache;
};

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 1469598103934665603ULL;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 1099511628211ULL;
    return h ^ (h >> 29);
}

static uint64_t hash_u64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    return x ^ (x >> 31);
}

int bpe_new(bpe_t **out) {
    *out = NULL;
    bpe_t *b = calloc(1, sizeof *b);
    cache_t *c = calloc(1, sizeof *c);
    centry_t *slots = calloc(CACHE_SLOTS, sizeof *slots);
    if (!b || !c || !slots) {
        free(b), free(c), free(slots);
        return mo_errorf(MO_ENOMEM, "bpe: out of memory");
    }
    pthread_mutex_init(&c->mu, NULL);
    c->slots = slots;
    b->cache = c;
    for (int i = 0; i < 256; i++)
        b->byte_id[i] = -1;
    *out = b;
    return 0;
}

static void cache_clear(cache_t *c) {
    for (size_t i = 0; i < CACHE_SLOTS; i++) {
        free(c->slots[i].ids);
        c->slots[i] = (centry_t){0};
    }
    c->n = 0;
}

void bpe_destroy(bpe_t **bp) {
    bpe_t *b = *bp;
    if (!b)
        return;
    cache_clear(b->cache);
    pthread_mutex_destroy(&b->cache->mu);
    free(b->cache->slots);
    free(b->cache);
    free(b->pool);
    free(b->tok);
    free(b->vslot);
    free(b->raw_ids);
    free(b->mslot);
    free(b);
    *bp = NULL;
}

static const char *tok_bytes(const bpe_t *b, int32_t id) {
    return b->pool + b->tok[id].off;
}

static int32_t vocab_find(const bpe_t *b, const char *s, size_t n) {
    if (!b->vcap)
        return -1;
    size_t mask = b->vcap - 1;
    for (size_t i = hash_bytes(s, n) & mask;; i = (i + 1) & mask) {
        int32_t id = b->vslot[i];
        if (id < 0)
            return -1;
        if (b->tok[id].len == n && memcmp(tok_bytes(b, id), s, n) == 0)
            return id;
    }
}

static void vocab_insert(bpe_t *b, int32_t id) {
    size_t mask = b->vcap - 1;
    size_t i = hash_bytes(tok_bytes(b, id), b->tok[id].len) & mask;
    while (b->vslot[i] >= 0)
        i = (i + 1) & mask;
    b->vslot[i] = id;
    b->vn++;
}

static int vocab_grow(bpe_t *b) {
    if (2 * (b->vn + 1) <= b->vcap)
        return 0;
    size_t cap = b->vcap ? 2 * b->vcap : 1024;
    int32_t *old = b->vslot;
    size_t oldcap = b->vcap;
    if (!(b->vslot = malloc(cap * sizeof *b->vslot))) {
        b->vslot = old;
        return mo_errorf(MO_ENOMEM, "bpe: out of memory for the vocabulary index");
    }
    memset(b->vslot, 0xff, cap * sizeof *b->vslot);
    b->vcap = cap;
    b->vn = 0;
    for (size_t i = 0; i < oldcap; i++)
        if (old[i] >= 0)
            vocab_insert(b, old[i]);
    free(old);
    return 0;
}

static int pool_add(bpe_t *b, const char *s, size_t n, uint32_t *off) {
    if (b->pool_n + n > UINT32_MAX)
        return mo_errorf(MO_EINVAL, "bpe: vocabulary text exceeds 4 GiB");
    if (b->pool_n + n > b->pool_cap) {
        size_t cap = b->pool_cap ? 2 * b->pool_cap : 1 << 16;
        while (cap < b->pool_n + n)
            cap *= 2;
        char *p = realloc(b->pool, cap);
        if (!p)
            return mo_errorf(MO_ENOMEM, "bpe: out of memory for %zu bytes of vocabulary", cap);
        b->pool = p, b->pool_cap = cap;
    }
    memcpy(b->pool + b->pool_n, s, n);
    *off = (uint32_t)b->pool_n;
    b->pool_n += n;
    return 0;
}

static int tok_reserve(bpe_t *b, int32_t id) {
    if ((size_t)id < b->tok_cap)
        return 0;
    size_t cap = b->tok_cap ? b->tok_cap : 1024;
    while (cap <= (size_t)id)
        cap *= 2;
    tok_t *t = realloc(b->tok, cap * sizeof *t);
    if (!t)
        return mo_errorf(MO_ENOMEM, "bpe: out of memory for %zu tokens", cap);
    memset(t + b->tok_cap, 0, (cap - b->tok_cap) * sizeof *t);
    b->tok = t, b->tok_cap = cap;
    return 0;
}

static int raw_add(bpe_t *b, int32_t id) {
    if (b->nraw == b->raw_cap) {
        size_t cap = b->raw_cap ? 2 * b->raw_cap : 16;
        int32_t *v = realloc(b->raw_ids, cap * sizeof *v);
        if (!v)
            return mo_errorf(MO_ENOMEM, "bpe: out of memory");
        b->raw_ids = v, b->raw_cap = cap;
    }
    b->raw_ids[b->nraw++] = id;
    return 0;
}

int bpe_add_token(bpe_t *b, const char *key, size_t len, int32_t id) {
    if (id < 0 || id >= BPE_MAX_ID)
        return mo_errorf(MO_EINVAL, "id %d out of range [0, %d)", id, BPE_MAX_ID);
    TRY(tok_reserve(b, id));
    if (b->tok[id].kind != TOK_NONE)
        return mo_errorf(MO_EINVAL, "id %d is already used by another token", id);
    char stack[256];
    char *raw = len <= sizeof stack ? stack : malloc(len);
    if (!raw)
        return mo_errorf(MO_ENOMEM, "bpe: out of memory");
    size_t n = 0;
    bool mapped = bpe_unmap(key, len, raw, &n);
    int rc = 0;
    if (mapped && vocab_find(b, raw, n) >= 0)
        rc = mo_errorf(MO_EINVAL, "token appears twice");
    if (!mapped && bpe_key_id(b, key, len) >= 0)
        rc = mo_errorf(MO_EINVAL, "token appears twice");
    if (rc == 0 && mapped)
        rc = vocab_grow(b);
    if (rc == 0)
        rc = mapped ? pool_add(b, raw, n, &b->tok[id].off) : pool_add(b, key, len, &b->tok[id].off);
    if (rc == 0 && !mapped)
        rc = raw_add(b, id);
    if (raw != stack)
        free(raw);
    TRY(rc);
    b->tok[id].len = (uint32_t)(mapped ? n : len);
    b->tok[id].kind = mapped ? TOK_MAPPED : TOK_RAW;
    if (mapped)
        vocab_insert(b, id);
    if ((size_t)id + 1 > b->size)
        b->size = (size_t)id + 1;
    return 0;
}

int32_t bpe_key_id(const bpe_t *b, const char *key, size_t len) {
    char stack[256] = {0};
    char *raw = len <= sizeof stack ? stack : malloc(len);
    if (!raw)
        return -1;
    size_t n = 0;
    int32_t id = bpe_unmap(key, len, raw, &n) ? vocab_find(b, raw, n) : -1;
    if (raw != stack)
        free(raw);
    if (id >= 0)
        return id;
    for (size_t i = 0; i < b->nraw; i++) {
        int32_t r = b->raw_ids[i];
        if (b->tok[r].len == len && memcmp(tok_bytes(b, r), key, len) == 0)
            return r;
    }
    return -1;
}

int32_t bpe_bytes_id(const bpe_t *b, const char *bytes, size_t n) {
    return vocab_find(b, bytes, n);
}

int bpe_token_bytes(const bpe_t *b, int32_t id, const char **bytes, size_t *len) {
    if (id < 0 || (size_t)id >= b->size || b->tok[id].kind == TOK_NONE)
        return mo_errorf(MO_ENOTFOUND, "no token has id %d", id);
    *bytes = tok_bytes(b, id);
    *len = b->tok[id].len;
    return 0;
}

size_t bpe_size(const bpe_t *b) {
    return b->size;
}

size_t bpe_num_merges(const bpe_t *b) {
    return b->nmerges;
}

/* ---- merges ---- */

static const mslot_t *merge_find(const bpe_t *b, int32_t l, int32_t r) {
    if (!b->mcap)
        return NULL;
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    size_t mask = b->mcap - 1;
    for (size_t i = hash_u64(key) & mask;; i = (i + 1) & mask) {
        if (b->mslot[i].key == key)
            return &b->mslot[i];
        if (b->mslot[i].key == EMPTY_KEY)
            return NULL;
    }
}

static int merge_grow(bpe_t *b) {
    if (2 * (b->mn + 1) <= b->mcap)
        return 0;
    size_t cap = b->mcap ? 2 * b->mcap : 1024, oldcap = b->mcap;
    mslot_t *old = b->mslot, *s = malloc(cap * sizeof *s);
    if (!s)
        return mo_errorf(MO_ENOMEM, "bpe: out of memory for %zu merges", cap / 2);
    memset(s, 0xff, cap * sizeof *s); /* every key EMPTY_KEY */
    for (size_t i = 0; i < oldcap; i++) {
        if (old[i].key == EMPTY_KEY)
            continue;
        size_t j = hash_u64(old[i].key) & (cap - 1);
        while (s[j].key != EMPTY_KEY)
            j = (j + 1) & (cap - 1);
        s[j] = old[i];
    }
    free(old);
    b->mslot = s, b->mcap = cap;
    return 0;
}

/* Id of the mapped key s, with an error naming it when absent. */
static int merge_side(const bpe_t *b, const char *s, size_t n, int32_t *id) {
    *id = -1;
    char stack[256];
    char *raw = n <= sizeof stack ? stack : malloc(n);
    if (!raw)
        return mo_errorf(MO_ENOMEM, "bpe: out of memory");
    size_t len = 0;
    if (bpe_unmap(s, n, raw, &len))
        *id = vocab_find(b, raw, len);
    if (raw != stack)
        free(raw);
    if (*id < 0)
        return mo_errorf(MO_ENOTFOUND, "token \"%.*s\" is not in model.vocab", (int)n, s);
    return 0;
}

int bpe_add_merge(bpe_t *b, const char *left, size_t nl, const char *right, size_t nr) {
    int32_t l, r;
    TRY(merge_side(b, left, nl, &l));
    TRY(merge_side(b, right, nr, &r));
    size_t n = (size_t)b->tok[l].len + b->tok[r].len;
    char *cat = malloc(n);
    if (!cat)
        return mo_errorf(MO_ENOMEM, "bpe: out of memory");
    memcpy(cat, tok_bytes(b, l), b->tok[l].len);
    memcpy(cat + b->tok[l].len, tok_bytes(b, r), b->tok[r].len);
    int32_t id = vocab_find(b, cat, n);
    free(cat);
    if (id < 0)
        return mo_errorf(MO_ENOTFOUND, "the merged token \"%.*s%.*s\" is not in model.vocab",
                         (int)nl, left, (int)nr, right);
    TRY(merge_grow(b));
    int32_t rank = (int32_t)b->nmerges++;
    uint64_t key = ((uint64_t)(uint32_t)l << 32) | (uint32_t)r;
    size_t mask = b->mcap - 1, i = hash_u64(key) & mask;
    while (b->mslot[i].key != EMPTY_KEY && b->mslot[i].key != key)
        i = (i + 1) & mask;
    if (b->mslot[i].key == EMPTY_KEY)
        b->mn++;
    b->mslot[i] = (mslot_t){key, rank, id};
    return 0;
}

int bpe_finish(bpe_t *b, bool ignore_merges) {
    for (int i = 0; i < 256; i++) {
        char c = (char)i;
        b->byte_id[i] = vocab_find(b, &c, 1);
        if (b->byte_id[i] < 0) {
            char m[4];
            size_t ml = uni_put(bpe_byte_char((uint8_t)i), m);
            return mo_errorf(MO_EMALFORMED,
                             "model.vocab has no token for byte 0x%02x (\"%.*s\"); a byte-level "
                             "vocabulary needs all 256",
                             i, (int)ml, m);
        }
    }
    b->ignore_merges = ignore_merges;
    return 0;
}

/* ---- the merge loop ---- */

typedef struct {
    int32_t id, prev, next; /* token, neighbours (-1 at the ends) */
    uint32_t len;           /* bytes covered; 0 once merged into its left neighbour */
} sym_t;

typedef struct {
    int32_t rank, pos, id; /* merge of the pair starting at symbol pos into id */
} cand_t;

static bool cand_less(cand_t a, cand_t b) {
    return a.rank != b.rank ? a.rank < b.rank : a.pos < b.pos;
}

static void heap_push(cand_t *h, size_t *n, cand_t c) {
    size_t i = (*n)++;
    while (i > 0 && cand_less(c, h[(i - 1) / 2])) {
        h[i] = h[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    h[i] = c;
}

static cand_t heap_pop(cand_t *h, size_t *n) {
    cand_t top = h[0], last = h[--(*n)];
    size_t i = 0;
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= *n)
            break;
        if (c + 1 < *n && cand_less(h[c + 1], h[c]))
            c++;
        if (!cand_less(h[c], last))
            break;
        h[i] = h[c];
        i = c;
    }
    h[i] = last;
    return top;
}

static void push_pair(const bpe_t *b, const sym_t *s, int32_t pos, cand_t *h, size_t *nh) {
    const mslot_t *m = merge_find(b, s[pos].id, s[s[pos].next].id);
    if (m)
        heap_push(h, nh, (cand_t){m->rank, pos, m->id});
}

/* Merges word[0..n) (n >= 2) in s; the survivors form the list from s[0].
 * s has room for n symbols, h for 3 n candidates (n - 1 initial pairs plus
 * at most two per merge). */
static void merge_word(const bpe_t *b, const char *word, size_t n, sym_t *s, cand_t *h) {
    size_t nh = 0;
    for (size_t i = 0; i < n; i++)
        s[i] = (sym_t){b->byte_id[(uint8_t)word[i]], (int32_t)i - 1,
                       i + 1 < n ? (int32_t)i + 1 : -1, 1};
    for (size_t i = 0; i + 1 < n; i++)
        push_pair(b, s, (int32_t)i, h, &nh);
    while (nh > 0) {
        cand_t top = heap_pop(h, &nh);
        sym_t *l = &s[top.pos];
        if (l->len == 0 || l->next < 0)
            continue;
        const mslot_t *m = merge_find(b, l->id, s[l->next].id);
        if (!m || m->id != top.id)
            continue; /* stale: the pair changed since it was queued */
        sym_t *r = &s[l->next];
        l->id = top.id;
        l->len += r->len;
        l->next = r->next;
        r->len = 0;
        if (l->next >= 0)
            s[l->next].prev = top.pos;
        if (l->prev >= 0)
            push_pair(b, s, l->prev, h, &nh);
        if (l->next >= 0)
            push_pair(b, s, top.pos, h, &nh);
    }
}

static int cache_get(cache_t *c, uint64_t h, const char *w, size_t n, bpe_ids_t *out, bool *hit) {
    *hit = false;
    int rc = 0;
    pthread_mutex_lock(&c->mu);
    for (size_t i = h & (CACHE_SLOTS - 1); c->slots[i].key; i = (i + 1) & (CACHE_SLOTS - 1)) {
        centry_t *e = &c->slots[i];
        if (e->h == h && e->klen == n && memcmp(e->key, w, n) == 0) {
            for (uint32_t k = 0; k < e->nids && rc == 0; k++)
                rc = bpe_ids_push(out, e->ids[k]);
            *hit = true;
            break;
        }
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* Best effort: an entry that cannot be allocated is simply not cached. */
static void cache_put(cache_t *c, uint64_t h, const char *w, size_t n, const int32_t *ids,
                      size_t nids) {
    int32_t *blk = malloc(nids * sizeof *ids + n);
    if (!blk)
        return;
    memcpy(blk, ids, nids * sizeof *ids);
    memcpy((char *)(blk + nids), w, n);
    pthread_mutex_lock(&c->mu);
    if (c->n >= CACHE_MAX)
        cache_clear(c);
    size_t i = h & (CACHE_SLOTS - 1);
    while (c->slots[i].key) {
        centry_t *e = &c->slots[i];
        if (e->h == h && e->klen == n && memcmp(e->key, w, n) == 0)
            break; /* another thread got there first */
        i = (i + 1) & (CACHE_SLOTS - 1);
    }
    if (c->slots[i].key) {
        free(blk);
    } else {
        c->slots[i] = (centry_t){h, (char *)(blk + nids), blk, (uint32_t)n, (uint32_t)nids};
        c->n++;
    }
    pthread_mutex_unlock(&c->mu);
}

int bpe_encode(const bpe_t *b, const char *word, size_t n, bpe_ids_t *out) {
    if (n == 0)
        return 0;
    if (b->ignore_merges) {
        int32_t id = vocab_find(b, word, n);
        if (id >= 0)
            return bpe_ids_push(out, id);
    }
    if (n == 1 || b->nmerges == 0) {
        for (size_t i = 0; i < n; i++)
            TRY(bpe_ids_push(out, b->byte_id[(uint8_t)word[i]]));
        return 0;
    }
    uint64_t h = hash_bytes(word, n);
    bool cacheable = n <= CACHE_WORD, hit = false;
    if (cacheable) {
        TRY(cache_get(b->cache, h, word, n, out, &hit));
        if (hit)
            return 0;
    }
    if (n > (size_t)INT32_MAX / 3)
        return mo_errorf(MO_EINVAL, "bpe: pre-token of %zu bytes is too long", n);
    sym_t s_stack[64];
    cand_t h_stack[3 * 64];
    sym_t *s = n <= 64 ? s_stack : malloc(n * sizeof *s);
    cand_t *hp = n <= 64 ? h_stack : malloc(3 * n * sizeof *hp);
    int rc = 0;
    if (!s || !hp) {
        rc = mo_errorf(MO_ENOMEM, "bpe: out of memory for a %zu-byte pre-token", n);
        goto done;
    }
    merge_word(b, word, n, s, hp);
    size_t first = out->n;
    for (int32_t i = 0; i >= 0 && rc == 0; i = s[i].next)
        rc = bpe_ids_push(out, s[i].id);
    if (rc == 0 && cacheable)
        cache_put(b->cache, h, word, n, out->v + first, out->n - first);
done:
    if (s != s_stack)
        free(s);
    if (hp != h_stack)
        free(hp);
    return rc;
}
