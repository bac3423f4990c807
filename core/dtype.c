/* dtype: element types and rounding conversions. */
#include "core/dtype.h"

#include <math.h>
#include <string.h>

#include "core/status.h"

static const struct {
    const char *name;
    size_t size;
} g_dtypes[DT_COUNT] = {
    [DT_F32] = {"F32", 4},    [DT_BF16] = {"BF16", 2}, [DT_F16] = {"F16", 2},
    [DT_F8E4M3] = {"F8_E4M3", 1}, [DT_F64] = {"F64", 8}, [DT_I64] = {"I64", 8},
    [DT_I32] = {"I32", 4},    [DT_I16] = {"I16", 2},   [DT_U16] = {"U16", 2},
    [DT_I8] = {"I8", 1},      [DT_U8] = {"U8", 1},     [DT_BOOL] = {"BOOL", 1},
};

size_t dtype_size(dtype_t dt) { return (unsigned)dt < DT_COUNT ? g_dtypes[dt].size : 0; }

const char *dtype_name(dtype_t dt) { return (unsigned)dt < DT_COUNT ? g_dtypes[dt].name : "?"; }

int dtype_from_name(const char *name, dtype_t *out) {
    for (int i = 0; i < DT_COUNT; i++) {
        if (strcmp(name, g_dtypes[i].name) == 0) {
            *out = (dtype_t)i;
            return MO_OK;
        }
    }
    return mo_errorf(MO_EINVAL, "unknown dtype '%s'", name);
}

int dtype_is_float(dtype_t dt) {
    return dt == DT_F32 || dt == DT_BF16 || dt == DT_F16 || dt == DT_F8E4M3;
}

static inline uint32_t f2u(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float u2f(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u = f2u(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN, sign kept */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float bf16_to_f32(uint16_t h) { return u2f((uint32_t)h << 16); }

uint16_t f32_to_f16(float f) {
    uint32_t x = f2u(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u)
        return sign | 0x7e00u;
    if (x >= 0x477ff000u) /* 65520 and above round to infinity */
        return sign | 0x7c00u;
    if (x < 0x38800000u) { /* below 2^-14: subnormal or zero */
        float t = u2f(x) + 0.5f;
        return sign | (uint16_t)(f2u(t) - (126u << 23));
    }
    uint32_t odd = (x >> 13) & 1u;
    x += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
    return sign | (uint16_t)(x >> 13);
}

float f16_to_f32(uint16_t h) {
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    float v;
    if (e == 0)
        v = ldexpf((float)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexpf((float)(1024u + m), (int)e - 25);
    return (h & 0x8000u) ? -v : v;
}

uint8_t f32_to_fp8e4m3(float f) {
    uint32_t x = f2u(f);
    uint32_t sign = x & 0x80000000u;
    uint8_t r;
    x ^= sign;
    if (x >= (1087u << 20)) { /* >= 480, infinity or NaN */
        r = 0x7f;
    } else if (x < (121u << 23)) { /* below 2^-6: subnormal or zero */
        float t = u2f(x) + u2f(141u << 23);
        r = (uint8_t)(f2u(t) - (141u << 23));
    } else {
        uint32_t odd = (x >> 20) & 1u;
        x += ((uint32_t)(7 - 127) << 23) + 0x7ffffu + odd;
        r = (uint8_t)(x >> 20);
    }
    return r | (uint8_t)(sign >> 24);
}

float fp8e4m3_to_f32(uint8_t b) {
    uint32_t e = (b >> 3) & 0xfu, m = b & 7u;
    float v;
    if (e == 15 && m == 7)
        v = NAN;
    else if (e == 0)
        v = ldexpf((float)m, -9);
    else
        v = ldexpf((float)(8u + m), (int)e - 10);
    return (b & 0x80u) ? -v : v;
}

void convert_to_f32(float *dst, const void *src, dtype_t dt, size_t n) {
    switch (dt) {
    case DT_F32:
        memmove(dst, src, n * 4);
        break;
    case DT_BF16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = bf16_to_f32(s[i]);
        break;
    }
    case DT_F16: {
        const uint16_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = f16_to_f32(s[i]);
        break;
    }
    case DT_F8E4M3: {
        const uint8_t *s = src;
        for (size_t i = 0; i < n; i++)
            dst[i] = fp8e4m3_to_f32(s[i]);
        break;
    }
    default:
        MO_ASSERT(!"convert_to_f32: not a float dtype");
    }
}

void convert_from_f32(void *dst, dtype_t dt, const float *src, size_t n) {
    switch (dt) {
    case DT_F32:
        memmove(dst, src, n * 4);
        break;
    case DT_BF16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = f32_to_bf16(src[i]);
        break;
    }
    case DT_F16: {
        uint16_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = f32_to_f16(src[i]);
        break;
    }
    case DT_F8E4M3: {
        uint8_t *d = dst;
        for (size_t i = 0; i < n; i++)
            d[i] = f32_to_fp8e4m3(src[i]);
        break;
    }
    default:
        MO_ASSERT(!"convert_from_f32: not a float dtype");
    }
}
