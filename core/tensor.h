/* tensor: a typed, shaped view of memory on a device. */
#ifndef MOERL_CORE_TENSOR_H
#define MOERL_CORE_TENSOR_H

#include <stddef.h>
#include <stdint.h>

#include "core/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum { DEV_CPU = 0, DEV_CUDA = 1, DEV_COUNT } device_t;

const char *device_name(device_t dev);
/* "cpu" or "cuda"; MO_EINVAL otherwise. */
int device_from_name(const char *name, device_t *out);

#define TENSOR_MAX_DIMS 6

/* A tensor does not own its memory unless it came from tensor_alloc. */
typedef struct tensor {
    dtype_t dtype;
    device_t device;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    void *data;
    int owned; /* 1 when tensor_free must release data through the backend */
} tensor_t;

tensor_t tensor_view(void *data, dtype_t dt, device_t dev, int ndim, const int64_t *shape);
int64_t tensor_numel(const tensor_t *t);
size_t tensor_nbytes(const tensor_t *t);
/* Allocates through the device's backend; data is not initialised. */
int tensor_alloc(tensor_t *t, dtype_t dt, device_t dev, int ndim, const int64_t *shape);
void tensor_free(tensor_t *t);
int tensor_same_shape(const tensor_t *a, const tensor_t *b);
/* Writes "(2, 3, 4)" into buf. */
void tensor_shape_str(const tensor_t *t, char *buf, size_t cap);

#ifdef __cplusplus
}
#endif
#endif
