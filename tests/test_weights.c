/* Tests for weight streaming: the xxHash64 checksum against reference
 * values, split and reassembly in random order through the codec, and the
 * assembler's refusals: duplicate, inconsistent, missing and corrupt chunks,
 * wrong checksums, stale and newer versions, oversized adapters. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/rng.h"
#include "core/status.h"
#include "tests/testutil.h"
#include "transport/codec.h"
#include "transport/weights.h"

/* ---- Checksum ---- */

static void test_hash_vectors(void) {
    /* XXH64(seed 0) of bytes (i * 131 + 7) mod 256, from the reference xxHash library. */
    static const struct {
        size_t n;
        uint64_t h;
    } v[] = {
        {0, 0xef46db3751d8e999ULL},   {1, 0xa96c7f0ce858bbb7ULL},    {3, 0xbed43740ee6332bbULL},
        {4, 0xfa212ae44b3bb23dULL},   {7, 0x2744460dd675d2c0ULL},    {8, 0x994b676b71ce94ddULL},
        {31, 0x6711d55e306b5d8fULL},  {32, 0x07f7b8e3bc5d6e25ULL},   {33, 0x09f85eeb4e1cbe9fULL},
        {100, 0x9ddada11d3dc2d8fULL}, {1000, 0x0bf0bdbcc82eb373ULL},
    };
    uint8_t buf[1000];
    for (int i = 0; i < 1000; i++)
        buf[i] = (uint8_t)(i * 131u + 7u);
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        uint64_t h = weights_hash64(buf, v[i].n);
        if (h != v[i].h)
            tu_report("xxh64 of %zu bytes: %016llx, expected %016llx", v[i].n,
                      (unsigned long long)h, (unsigned long long)v[i].h);
        CU_ASSERT(h == v[i].h);
    }
    CU_ASSERT(weights_hash64("abc", 3) == 0x44bc2cf5ad770999ULL);
    /* Unaligned input gives the same hash. */
    uint8_t *odd = malloc(1001);
    memcpy(odd + 1, buf, 1000);
    CU_ASSERT(weights_hash64(odd + 1, 1000) == 0x0bf0bdbcc82eb373ULL);
    free(odd);
}

/* ---- A small adapter ---- */

#define N_T 4
static msg_tensor_entry_t g_table[N_T];
static const msg_kv_t g_meta_kv[] = {{"rank", "4"}, {"alpha", "8"}, {"targets", "q_proj,v_proj"}};
static const msg_strmap_t g_meta = {g_meta_kv, 3};

/* A flat buffer of four tensors with gaps and a zero-size one: 1144 bytes. */
static uint8_t *make_flat(uint64_t *total) {
    g_table[0] = (msg_tensor_entry_t){"q_proj.lora_A", DT_F32, 2, {4, 16}, 0};    /* 256 B */
    g_table[1] = (msg_tensor_entry_t){"q_proj.lora_B", DT_BF16, 2, {32, 4}, 256}; /* 256 B */
    g_table[2] = (msg_tensor_entry_t){"v_proj.lora_A", DT_F32, 2, {4, 38}, 520};  /* 608 B */
    g_table[3] = (msg_tensor_entry_t){"empty", DT_F32, 2, {0, 4}, 1128};          /* 0 B */
    *total = 1144;
    uint8_t *flat = malloc(*total);
    float *f = malloc(*total);
    tu_fill(f, *total / 4, 77, -1.0f, 1.0f);
    memcpy(flat, f, *total);
    free(f);
    return flat;
}

/* Encodes chunk i and decodes it again, as it would cross the wire. */
static void wire_chunk(const weights_split_t *s, uint32_t i, msg_t *out) {
    msg_t m;
    msg_buf_t b;
    msg_buf_init(&b);
    weights_split_chunk(s, i, &m);
    int rc = msg_encode(&m, &b);
    if (rc != MO_OK)
        tu_report("encode chunk %u: %s", i, mo_last_error());
    CU_ASSERT_FATAL(rc == MO_OK);
    rc = msg_decode(out, b.data, b.len, MSG_WEIGHTS_CHUNK);
    if (rc != MO_OK)
        tu_report("decode chunk %u: %s", i, mo_last_error());
    CU_ASSERT_FATAL(rc == MO_OK);
    msg_buf_free(&b);
}

static void shuffle(uint32_t *p, uint32_t n, uint64_t seed) {
    for (uint32_t i = n; i > 1; i--) {
        uint32_t r[4];
        rng_block(r, seed, 1, i);
        uint32_t j = r[0] % i, t = p[i - 1];
        p[i - 1] = p[j];
        p[j] = t;
    }
}

static void expect_adapter(const weights_adapter_t *a, const uint8_t *flat, uint64_t total,
                           uint64_t version) {
    CU_ASSERT(a->version == version && a->total_bytes == total);
    CU_ASSERT(a->data && memcmp(a->data, flat, total) == 0);
    CU_ASSERT(((uintptr_t)a->data % 64) == 0);
    CU_ASSERT(a->checksum == weights_hash64(flat, total));
    CU_ASSERT_FATAL(a->n_table == N_T);
    for (int i = 0; i < N_T; i++) {
        CU_ASSERT(strcmp(a->table[i].name, g_table[i].name) == 0);
        CU_ASSERT(a->table[i].offset == g_table[i].offset && a->table[i].dtype == g_table[i].dtype);
        CU_ASSERT(a->table[i].shape[1] == g_table[i].shape[1]);
    }
    CU_ASSERT(a->meta.n == 3 && strcmp(a->meta.items[2].value, "q_proj,v_proj") == 0);
    const msg_tensor_entry_t *e = weights_adapter_find(a, "v_proj.lora_A");
    CU_ASSERT(e && e->offset == 520);
    CU_ASSERT(weights_adapter_find(a, "k_proj.lora_A") == NULL);
}

/* ---- Round trip ---- */

static void test_split_assemble(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    static const uint64_t sizes[] = {1, 7, 64, 100, 1143, 1144, 5000};
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
        weights_split_t s;
        int rc = weights_split_init(&s, flat, total, g_table, N_T, &g_meta, 10 + k, sizes[k]);
        CU_ASSERT_FATAL(rc == MO_OK);
        CU_ASSERT(s.n_chunks == (total + sizes[k] - 1) / sizes[k]);
        uint32_t *order = malloc(s.n_chunks * sizeof *order);
        for (uint32_t i = 0; i < s.n_chunks; i++)
            order[i] = i;
        shuffle(order, s.n_chunks, 1234 + k);
        weights_assembler_t *a;
        CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
        int done = 0, more = 0;
        for (uint32_t i = 0; i < s.n_chunks; i++) {
            msg_t c;
            wire_chunk(&s, order[i], &c);
            rc = weights_assembler_add(a, &c.weights_chunk);
            done += rc == WEIGHTS_DONE;
            more += rc == WEIGHTS_MORE;
            CU_ASSERT(rc == (i + 1 == s.n_chunks ? WEIGHTS_DONE : WEIGHTS_MORE));
            msg_free(&c);
        }
        CU_ASSERT(done == 1 && more == (int)s.n_chunks - 1);
        weights_adapter_t ad;
        CU_ASSERT_FATAL(weights_assembler_take(a, &ad) == MO_OK);
        expect_adapter(&ad, flat, total, 10 + k);
        weights_adapter_free(&ad);
        int has;
        uint64_t latest;
        weights_assembler_latest(a, &has, &latest);
        CU_ASSERT(has && latest == 10 + k);
        CU_ASSERT(weights_assembler_take(a, &ad) == MO_ESTATE);
        weights_assembler_destroy(&a);
        CU_ASSERT(a == NULL);
        free(order);
    }
    free(flat);
}

/* The table on chunk 0 arrives last; each chunk's size is as specified. */
static void test_chunk_zero_last(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s;
    CU_ASSERT_FATAL(weights_split_init(&s, flat, total, g_table, N_T, NULL, 3, 500) == MO_OK);
    CU_ASSERT(s.n_chunks == 3);
    weights_assembler_t *a;
    CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
    for (uint32_t i = s.n_chunks; i-- > 0;) {
        msg_t c;
        wire_chunk(&s, i, &c);
        CU_ASSERT(c.weights_chunk.nbytes == (i == 2 ? 144u : 500u));
        CU_ASSERT((c.weights_chunk.n_table > 0) == (i == 0));
        CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == (i ? WEIGHTS_MORE : WEIGHTS_DONE));
        msg_free(&c);
    }
    weights_adapter_t ad;
    CU_ASSERT_FATAL(weights_assembler_take(a, &ad) == MO_OK);
    CU_ASSERT(memcmp(ad.data, flat, total) == 0 && ad.meta.n == 0 && ad.n_table == N_T);
    weights_adapter_free(&ad);
    weights_assembler_destroy(&a);
    free(flat);
}

/* ---- Refusals ---- */

static void test_duplicate(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s;
    CU_ASSERT_FATAL(weights_split_init(&s, flat, total, g_table, N_T, &g_meta, 1, 300) == MO_OK);
    weights_assembler_t *a;
    CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
    msg_t c;
    weights_split_chunk(&s, 2, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_MORE);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_DUPLICATE);
    /* the same index again with other bytes */
    uint8_t other[300];
    memcpy(other, c.weights_chunk.data, 300);
    other[17] ^= 0x40;
    c.weights_chunk.data = other;
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "chunk 2 of version 1 arrived twice with different bytes") !=
              NULL);
    uint64_t v;
    uint32_t have, n;
    weights_assembler_progress(a, &v, &have, &n);
    CU_ASSERT(v == 1 && have == 1 && n == 4);
    /* the rest still completes the version with the first bytes */
    for (uint32_t i = 0; i < s.n_chunks; i++) {
        if (i == 2)
            continue;
        weights_split_chunk(&s, i, &c);
        CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) ==
                  (i == 3 ? WEIGHTS_DONE : WEIGHTS_MORE));
    }
    weights_adapter_t ad;
    CU_ASSERT_FATAL(weights_assembler_take(a, &ad) == MO_OK);
    CU_ASSERT(memcmp(ad.data, flat, total) == 0);
    weights_adapter_free(&ad);
    weights_assembler_destroy(&a);
    free(flat);
}

static void test_inconsistent(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s;
    CU_ASSERT_FATAL(weights_split_init(&s, flat, total, g_table, N_T, &g_meta, 8, 256) == MO_OK);
    weights_assembler_t *a;
    CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
    msg_t c;
    weights_split_chunk(&s, 1, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_MORE);

    weights_split_chunk(&s, 2, &c);
    c.weights_chunk.checksum ^= 1;
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "weights_chunk.checksum: chunk 2 of version 8 disagrees") !=
              NULL);

    /* a different geometry for the same version: 4 chunks of 300 */
    weights_split_t s2;
    CU_ASSERT_FATAL(weights_split_init(&s2, flat, total, g_table, N_T, NULL, 8, 300) == MO_OK);
    weights_split_chunk(&s2, 2, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "weights_chunk.chunk_bytes") != NULL);

    /* a chunk that fails the message checks on its own */
    weights_split_chunk(&s, 3, &c);
    c.weights_chunk.nbytes = 10;
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "weights_chunk.data: 10 bytes") != NULL);
    weights_split_chunk(&s, 4, &c);
    c.weights_chunk.chunk_index = 5;
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == MO_EMALFORMED);

    uint64_t v;
    uint32_t have, n;
    weights_assembler_progress(a, &v, &have, &n);
    CU_ASSERT(v == 8 && have == 1 && n == 5);

    /* over the size this worker accepts */
    weights_assembler_t *small;
    CU_ASSERT_FATAL(weights_assembler_new(&small, 1000) == MO_OK);
    weights_split_chunk(&s, 0, &c);
    CU_ASSERT(weights_assembler_add(small, &c.weights_chunk) == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "more than the 1000 this worker accepts") != NULL);
    weights_assembler_destroy(&small);
    weights_assembler_destroy(&a);
    free(flat);
}

static void test_wrong_checksum(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s;
    CU_ASSERT_FATAL(weights_split_init(&s, flat, total, g_table, N_T, &g_meta, 2, 400) == MO_OK);
    weights_assembler_t *a;
    CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
    /* every chunk agrees on a checksum that does not match the bytes */
    msg_t c;
    int rc = 0;
    for (uint32_t i = 0; i < s.n_chunks; i++) {
        weights_split_chunk(&s, i, &c);
        c.weights_chunk.checksum = s.checksum + 1;
        rc = weights_assembler_add(a, &c.weights_chunk);
        if (i + 1 < s.n_chunks)
            CU_ASSERT(rc == WEIGHTS_MORE);
    }
    CU_ASSERT(rc == MO_EMALFORMED);
    CU_ASSERT(strstr(mo_last_error(), "weights_chunk.checksum: version 2 reassembled") != NULL);
    weights_adapter_t ad;
    CU_ASSERT(weights_assembler_take(a, &ad) == MO_ESTATE);
    uint64_t v;
    uint32_t have, n;
    weights_assembler_progress(a, &v, &have, &n);
    CU_ASSERT(have == 0 && n == 0);
    int has;
    weights_assembler_latest(a, &has, &v);
    CU_ASSERT(!has);

    /* the right checksum but one corrupted chunk */
    uint8_t bad[400];
    for (uint32_t i = 0; i < s.n_chunks; i++) {
        weights_split_chunk(&s, i, &c);
        if (i == 1) {
            memcpy(bad, c.weights_chunk.data, 400);
            bad[399] ^= 1;
            c.weights_chunk.data = bad;
        }
        rc = weights_assembler_add(a, &c.weights_chunk);
    }
    CU_ASSERT(rc == MO_EMALFORMED);
    /* a clean resend of the version then succeeds */
    for (uint32_t i = 0; i < s.n_chunks; i++) {
        weights_split_chunk(&s, i, &c);
        rc = weights_assembler_add(a, &c.weights_chunk);
    }
    CU_ASSERT(rc == WEIGHTS_DONE);
    weights_assembler_destroy(&a);
    free(flat);
}

static void test_missing_and_versions(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s5, s6, s7;
    CU_ASSERT_FATAL(weights_split_init(&s5, flat, total, g_table, N_T, NULL, 5, 200) == MO_OK);
    CU_ASSERT_FATAL(weights_split_init(&s6, flat, total, g_table, N_T, NULL, 6, 200) == MO_OK);
    CU_ASSERT_FATAL(weights_split_init(&s7, flat, total, g_table, N_T, NULL, 7, 200) == MO_OK);
    weights_assembler_t *a;
    CU_ASSERT_FATAL(weights_assembler_new(&a, 1 << 20) == MO_OK);
    msg_t c;
    /* all but chunk 3 */
    for (uint32_t i = 0; i < s5.n_chunks; i++) {
        if (i == 3)
            continue;
        weights_split_chunk(&s5, i, &c);
        CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_MORE);
    }
    uint64_t v;
    uint32_t have, n;
    weights_assembler_progress(a, &v, &have, &n);
    CU_ASSERT(v == 5 && have == s5.n_chunks - 1 && n == s5.n_chunks);
    weights_adapter_t ad;
    CU_ASSERT(weights_assembler_take(a, &ad) == MO_ESTATE);
    weights_split_chunk(&s5, 3, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_DONE);
    /* version 5 again, or older, is stale */
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_STALE);
    /* version 6 starts (the completed 5 was not taken: it is replaced) */
    weights_split_chunk(&s6, 0, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_MORE);
    /* version 7 arrives before 6 is complete: 6 is abandoned */
    weights_split_chunk(&s7, 4, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_MORE);
    weights_assembler_progress(a, &v, &have, &n);
    CU_ASSERT(v == 7 && have == 1);
    weights_split_chunk(&s6, 1, &c);
    CU_ASSERT(weights_assembler_add(a, &c.weights_chunk) == WEIGHTS_STALE);
    for (uint32_t i = 0; i < s7.n_chunks; i++) {
        weights_split_chunk(&s7, i, &c);
        int rc = weights_assembler_add(a, &c.weights_chunk);
        CU_ASSERT(rc == (i == 4                 ? WEIGHTS_DUPLICATE
                         : i == s7.n_chunks - 1 ? WEIGHTS_DONE
                                                : WEIGHTS_MORE));
    }
    CU_ASSERT_FATAL(weights_assembler_take(a, &ad) == MO_OK);
    CU_ASSERT(ad.version == 7 && memcmp(ad.data, flat, total) == 0);
    weights_adapter_free(&ad);
    weights_assembler_destroy(&a);
    free(flat);
}

static void test_split_errors(void) {
    uint64_t total;
    uint8_t *flat = make_flat(&total);
    weights_split_t s;
    CU_ASSERT(weights_split_init(&s, flat, total, g_table, N_T, NULL, 1, 0) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "chunk_bytes") != NULL);
    CU_ASSERT(weights_split_init(&s, flat, 0, g_table, N_T, NULL, 1, 10) == MO_EINVAL);
    CU_ASSERT(weights_split_init(&s, flat, total, g_table, 0, NULL, 1, 10) == MO_EINVAL);
    msg_tensor_entry_t t[N_T];
    memcpy(t, g_table, sizeof t);
    t[2].offset = 500; /* overlaps q_proj.lora_B */
    CU_ASSERT(weights_split_init(&s, flat, total, t, N_T, NULL, 1, 10) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "'v_proj.lora_A' overlaps 'q_proj.lora_B'") != NULL);
    memcpy(t, g_table, sizeof t);
    t[2].offset = 540; /* past the end */
    CU_ASSERT(weights_split_init(&s, flat, total, t, N_T, NULL, 1, 10) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "table[2].offset") != NULL);
    memcpy(t, g_table, sizeof t);
    t[3].name = "q_proj.lora_A";
    CU_ASSERT(weights_split_init(&s, flat, total, t, N_T, NULL, 1, 10) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "repeated name 'q_proj.lora_A'") != NULL);
    memcpy(t, g_table, sizeof t);
    t[0].shape[0] = -4;
    CU_ASSERT(weights_split_init(&s, flat, total, t, N_T, NULL, 1, 10) == MO_EINVAL);
    CU_ASSERT(strstr(mo_last_error(), "table[0].shape") != NULL);
    free(flat);
}

int main(void) {
    CU_TestInfo tests[] = {
        {"xxh64 reference vectors", test_hash_vectors},
        {"split and assemble in random order", test_split_assemble},
        {"chunk 0 (the table) last", test_chunk_zero_last},
        {"duplicate chunks", test_duplicate},
        {"inconsistent chunks", test_inconsistent},
        {"wrong checksum and corrupt chunk", test_wrong_checksum},
        {"missing chunk, stale and newer versions", test_missing_and_versions},
        {"splitter refuses bad tables", test_split_errors},
        CU_TEST_INFO_NULL,
    };
    return tu_main("weights", tests);
}
