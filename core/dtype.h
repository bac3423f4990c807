/* dtype: element types, their sizes and names, and rounding conversions. */
#ifndef MOERL_CORE_DTYPE_H
#define MOERL_CORE_DTYPE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum {
    DT_F32 = 0,
    DT_BF16,
    DT_F16,
    DT_F8E4M3, /* OCP float8 e4m3fn: bias 7, max 448, no infinities, NaN = S.1111.111 */
    DT_F64,
    DT_I64,
    DT_I32,
    DT_I16,
    DT_U16,
    DT_I8,
    DT_U8,
    DT_BOOL,
    DT_COUNT
} dtype_t;

size_t dtype_size(dtype_t dt);
/* safetensors spelling: "F32", "BF16", "F16", "F8_E4M3", "I64", ... */
const char *dtype_name(dtype_t dt);
/* Parses a safetensors dtype name; returns MO_EINVAL for an unknown one. */
int dtype_from_name(const char *name, dtype_t *out);
/* True for the float types that convert to and from f32. */
int dtype_is_float(dtype_t dt);

/* Scalar conversions, round-to-nearest-even; NaN stays NaN. f32 -> f16
 * overflows to infinity; f32 -> fp8-e4m3 gives 448 up to 464 (the tie
 * rounds to even) and NaN above it, where rounding reaches the NaN code, as
 * PyTorch's float8_e4m3fn does. */
uint16_t f32_to_bf16(float f);
float bf16_to_f32(uint16_t h);
uint16_t f32_to_f16(float f);
float f16_to_f32(uint16_t h);
uint8_t f32_to_fp8e4m3(float f);
float fp8e4m3_to_f32(uint8_t b);

/* Bulk conversions of n elements between a float dtype and f32. */
void convert_to_f32(float *dst, const void *src, dtype_t src_dt, size_t n);
void convert_from_f32(void *dst, dtype_t dst_dt, const float *src, size_t n);

#ifdef __cplusplus
}
#endif
#endif
