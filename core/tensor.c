/* tensor: a typed, shaped view of memory on a device. */
#include "core/tensor.h"

#include <stdio.h>
#include <string.h>

#include "core/backend.h"
#include "core/status.h"

const char *device_name(device_t dev) {
    switch (dev) {
    case DEV_CPU: return "cpu";
    case DEV_CUDA: return "cuda";
    default: return "?";
    }
}

int device_from_name(const char *name, device_t *out) {
    if (strcmp(name, "cpu") == 0) {
        *out = DEV_CPU;
        return MO_OK;
    }
    if (strcmp(name, "cuda") == 0) {
        *out = DEV_CUDA;
        return MO_OK;
    }
    return mo_errorf(MO_EINVAL, "unknown device '%s' (expected cpu or cuda)", name);
}

tensor_t tensor_view(void *data, dtype_t dt, device_t dev, int ndim, const int64_t *shape) {
    tensor_t t;
    memset(&t, 0, sizeof t);
    MO_ASSERT(ndim >= 0 && ndim <= TENSOR_MAX_DIMS);
    t.dtype = dt;
    t.device = dev;
    t.ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t.shape[i] = shape[i];
    t.data = data;
    return t;
}

int64_t tensor_numel(const tensor_t *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

size_t tensor_nbytes(const tensor_t *t) { return (size_t)tensor_numel(t) * dtype_size(t->dtype); }

int tensor_alloc(tensor_t *t, dtype_t dt, device_t dev, int ndim, const int64_t *shape) {
    if (ndim < 0 || ndim > TENSOR_MAX_DIMS)
        return mo_errorf(MO_EINVAL, "tensor rank %d outside 0..%d", ndim, TENSOR_MAX_DIMS);
    for (int i = 0; i < ndim; i++)
        if (shape[i] < 0)
            return mo_errorf(MO_EINVAL, "negative tensor dimension %lld", (long long)shape[i]);
    const backend_t *be = backend_get(dev);
    if (!be)
        return MO_EDEVICE;
    *t = tensor_view(NULL, dt, dev, ndim, shape);
    void *p = NULL;
    TRY(be->alloc(be, &p, tensor_nbytes(t)));
    t->data = p;
    t->owned = 1;
    return MO_OK;
}

void tensor_free(tensor_t *t) {
    if (t->owned && t->data) {
        const backend_t *be = backend_get(t->device);
        if (be)
            be->free(be, t->data);
    }
    t->data = NULL;
    t->owned = 0;
}

int tensor_same_shape(const tensor_t *a, const tensor_t *b) {
    if (a->ndim != b->ndim)
        return 0;
    for (int i = 0; i < a->ndim; i++)
        if (a->shape[i] != b->shape[i])
            return 0;
    return 1;
}

void tensor_shape_str(const tensor_t *t, char *buf, size_t cap) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, n < cap ? cap - n : 0, "(");
    for (int i = 0; i < t->ndim; i++)
        n += (size_t)snprintf(buf + n, n < cap ? cap - n : 0, "%s%lld", i ? ", " : "",
                              (long long)t->shape[i]);
    snprintf(buf + n, n < cap ? cap - n : 0, ")");
}
