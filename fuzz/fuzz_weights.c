/* fuzz_weights: libFuzzer target for the weights_chunk decoder and the
 * assembler. Input: one byte (ignored), then records of a 2-byte
 * little-endian length and that many bytes, each decoded as a
 * weights_chunk and fed to one assembler; a completed adapter must match
 * its checksum and keep every tensor inside its buffer. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include "fuzz/fuzz_common.h"
#include "transport/weights.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_adapter(const weights_adapter_t *ad) {
    if (weights_hash64(ad->data, (size_t)ad->total_bytes) != ad->checksum)
        abort();
    for (uint32_t i = 0; i < ad->n_table; i++) {
        uint64_t bytes;
        if (msg_tensor_entry_bytes(&ad->table[i], &bytes) != MO_OK)
            abort();
        if (ad->table[i].offset + bytes > ad->total_bytes)
            abort();
        if (weights_adapter_find(ad, ad->table[i].name) == NULL)
            abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1)
        return 0;
    weights_assembler_t *a;
    if (weights_assembler_new(&a, (uint64_t)1 << 20) != MO_OK)
        return 0;
    size_t at = 1;
    while (at < size) {
        size_t len = data[at];
        if (at + 1 < size)
            len |= (size_t)data[at + 1] << 8;
        at += 2;
        if (at > size)
            break;
        if (len > size - at)
            len = size - at;
        msg_t m;
        if (fuzz_decode(data + at, len, MSG_WEIGHTS_CHUNK, &m) == MO_OK) {
            int rc = weights_assembler_add(a, &m.weights_chunk);
            if (rc != WEIGHTS_MORE && rc != WEIGHTS_DONE && rc != WEIGHTS_DUPLICATE &&
                rc != WEIGHTS_STALE && rc != MO_EMALFORMED)
                abort();
            if (rc == WEIGHTS_DONE) {
                weights_adapter_t ad;
                if (weights_assembler_take(a, &ad) != MO_OK)
                    abort();
                check_adapter(&ad);
                weights_adapter_free(&ad);
            }
        }
        msg_free(&m);
        at += len;
    }
    weights_assembler_destroy(&a);
    return 0;
}
