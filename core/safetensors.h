/* safetensors: validated memory-mapped reading, sharded checkpoints, and atomic writing. */
#ifndef MOERL_CORE_SAFETENSORS_H
#define MOERL_CORE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/kernels.h"
#include "core/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Format (https://github.com/huggingface/safetensors): an 8-byte little-endian
 * header length N, N bytes of UTF-8 JSON starting with '{' (trailing spaces
 * allowed), then the data section. The JSON maps tensor names to
 * {"dtype", "shape", "data_offsets": [begin, end]} (offsets relative to the
 * data section) plus an optional "__metadata__" string-to-string map. The
 * tensors must cover the data section exactly: no overlap, no hole, nothing
 * after the last one. */

#define ST_MAX_HEADER_BYTES (100u << 20) /* 100 MiB */

/* One tensor as the header describes it. */
typedef struct st_info {
    const char *name;
    dtype_t dtype;
    int ndim;
    int64_t shape[TENSOR_MAX_DIMS];
    uint64_t begin, end; /* byte range [begin, end) within the data section */
} st_info_t;

/* One opened file. Its tensors are views into a read-only mapping: never write
 * through their data pointers. Views stay valid until st_close. A view is
 * aligned to its element size when the file was written aligned (this
 * writer and the reference one both do). */
typedef struct st_file st_file_t;

/* Maps and validates a file. MO_EIO when it cannot be read, MO_EMALFORMED
 * when it breaks the format; the message names the file and the tensor. */
int st_open(st_file_t **out, const char *path);
/* Validates a safetensors image already in memory; buf is borrowed and must
 * outlive the st_file_t. display_name is used in messages. */
int st_open_buffer(st_file_t **out, const void *buf, size_t size, const char *display_name);
void st_close(st_file_t **f);

const char *st_path(const st_file_t *f);
/* Tensors in file order: ascending data offset (header order among
 * zero-sized tensors at the same offset). */
int st_count(const st_file_t *f);
const st_info_t *st_info(const st_file_t *f, int i);
/* A CPU view of tensor i. */
tensor_t st_tensor(const st_file_t *f, int i);
/* Index of a tensor by name, or -1. O(1) expected. */
int st_find(const st_file_t *f, const char *name);
/* A view of the named tensor; MO_ENOTFOUND (naming the file) when absent. */
int st_get(const st_file_t *f, const char *name, tensor_t *out);

/* The "__metadata__" map, in header order. st_metadata returns NULL for an
 * absent key. */
int st_metadata_count(const st_file_t *f);
void st_metadata_at(const st_file_t *f, int i, const char **key, const char **value);
const char *st_metadata(const st_file_t *f, const char *key);

/* A tensor to write and a metadata entry. */
typedef struct st_item {
    const char *name;
    tensor_t tensor; /* CPU, contiguous row-major */
} st_item_t;

typedef struct st_meta {
    const char *key;
    const char *value;
} st_meta_t;

/* Writes a safetensors file atomically: a temporary file in the same
 * directory, fsync, rename over path, fsync of the directory. Tensors are laid
 * out by element size, largest first, keeping the caller's order among equal
 * sizes, so every tensor is aligned to its element size; the header lists
 * them in that order, "__metadata__" first, and is padded with spaces to a
 * multiple of 8 bytes. The same inputs always give the same bytes. */
int st_write(const char *path, const st_item_t *items, int n, const st_meta_t *meta, int n_meta);

/* A checkpoint: one model.safetensors, or model.safetensors.index.json whose
 * "weight_map" names, for every tensor, the shard file (in the same
 * directory) that holds it. Each shard is opened once. Every tensor the index
 * names must be in its shard, and every tensor in a shard must be named by the
 * index for that shard. */
typedef struct st_checkpoint st_checkpoint_t;

#define ST_INDEX_NAME "model.safetensors.index.json"
#define ST_SINGLE_NAME "model.safetensors"

/* path: a directory holding model.safetensors.index.json (preferred) or
 * model.safetensors, an index file, or a single .safetensors file. */
int st_checkpoint_open(st_checkpoint_t **out, const char *path);
void st_checkpoint_close(st_checkpoint_t **ck);

/* Shards in file-name order. */
int st_checkpoint_num_shards(const st_checkpoint_t *ck);
const st_file_t *st_checkpoint_shard(const st_checkpoint_t *ck, int i);
/* All tensors: shard by shard, each in file order. */
int st_checkpoint_num_tensors(const st_checkpoint_t *ck);
const st_info_t *st_checkpoint_info(const st_checkpoint_t *ck, int i);
tensor_t st_checkpoint_tensor(const st_checkpoint_t *ck, int i);
/* Lookup across shards; MO_ENOTFOUND naming the checkpoint when absent. */
int st_checkpoint_find(const st_checkpoint_t *ck, const char *name);
int st_checkpoint_get(const st_checkpoint_t *ck, const char *name, tensor_t *out);

/* A 2-D weight (rows, cols) as a kernel reads it. For a float weight *scale is
 * NULL and w carries no scales. For an F8_E4M3 weight named "X.weight" the
 * DeepSeek-style inverse scales "X.weight_scale_inv" must exist, be 2-D of
 * shape (ceil(rows / b), ceil(cols / b)) and hold finite floats; they are
 * converted to f32 into *scale (caller frees with free()) and w->scale and
 * w->block are set. block > 0 fixes b (quantization_config's
 * weight_block_size); block == 0 derives it from the shapes: 128 when it
 * fits, else the smallest power of two that does. A float weight that has a
 * scale tensor, or an fp8 weight without one, is MO_EMALFORMED. *wt receives
 * the weight's view (for its shape). */
int st_checkpoint_weight(const st_checkpoint_t *ck, const char *name, int block, tensor_t *wt,
                         wview_t *w, float **scale);
/* The same within one file. */
int st_file_weight(const st_file_t *f, const char *name, int block, tensor_t *wt, wview_t *w,
                   float **scale);

#ifdef __cplusplus
}
#endif
#endif
