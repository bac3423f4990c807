/* backend: choosing the backend of a device. */
#include "core/backend.h"

#include "core/status.h"

const backend_t *backend_get(device_t dev) {
    switch (dev) {
    case DEV_CPU:
        return backend_cpu();
    case DEV_CUDA:
#ifdef MOERL_HAVE_CUDA
        return backend_cuda();
#else
        mo_errorf(MO_EDEVICE, "this moerl was built without CUDA (configure with -DMOERL_CUDA=ON "
                              "on a machine with the CUDA Toolkit)");
        return NULL;
#endif
    default:
        mo_errorf(MO_EINVAL, "unknown device %d", (int)dev);
        return NULL;
    }
}
