/* fuzz_work: libFuzzer target for the decoders of the work messages; the
 * first byte picks the expected type (fuzz_common.h). */
#include <stddef.h>
#include <stdint.h>

#include "fuzz/fuzz_common.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    return fuzz_family(data, size, fuzz_work_types, FUZZ_COUNT(fuzz_work_types));
}
