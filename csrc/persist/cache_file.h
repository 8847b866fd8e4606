/* A saved KV cache (docs/ARCHITECTURE.md, "Saved caches"): a safetensors file that holds a ragged cache
 * exactly, per layer
 *   layer.<l>.rows         I64 [Hkv]        rows held per head
 *   layer.<l>.positions    I64 [sum rows]   their original positions, head after head
 *   layer.<l>.keys/.values F32 or BF16 [sum rows, d] (the store's type; ThinK-pruned rows with zeros in
 *                          their dropped channels)
 *   layer.<l>.pruned_rows  I64 [Hkv]        and layer.<l>.key_channels I32 [Hkv, dk]: ThinK's freed key
 *                          channels (only where a layer has pruned rows)
 * the presses' state between calls, as their save_state hooks give it (core/press_i.h; persist/press_state.h):
 *   state.<slot>.<name>   I64 or F32 [n]   (a decoding press's counters and buffered queries mid-answer, ...)
 * and, in __metadata__ (strings), kvc.format, kvc.version, kvc.position, kvc.dtype, kvc.device, kvc.presses, the model's identity
 * (kvc.model_config, kvc.model_digest: persist/model_id.h), the caller's own keys (anything not starting
 * with "kvc.") and kvc.digest: SHA-256 of the whole file with the digest's own 64 hex digits read as '0',
 * so a byte changed anywhere is caught. The safetensors package reads the file as any other. */
#ifndef KVC_CACHE_FILE_H
#define KVC_CACHE_FILE_H

#include "../cache/kv_cache.h"
#include "../core/press_i.h"

#define KVC_CACHE_FORMAT "kvpress_c.cache"

typedef struct kvc_cache_file kvc_cache_file;

/* Write cache c of a model (its configuration and weights' digest: model_id.h; position: the next token's;
 * attached: the names of the presses attached, comma separated, kvc.presses; state: their state arrays, or NULL) to
 * path (a new file renamed into place). The caller holds the backend lock (the digest is computed before: it takes
 * the model's lock). */
kvc_status kvc_cache_file_write(const kvc_cache *c, const kvc_config *cfg, const char *model_digest, int64_t position,
                                const char *attached, const kvc_state_io *state, const char *path, int32_t n_meta,
                                const char *const *keys, const char *const *values);
/* Open and check a saved cache: the safetensors structure, the format, its version, the digest. */
kvc_status kvc_cache_file_open(const char *path, kvc_cache_file **out);
void kvc_cache_file_close(kvc_cache_file *f);
/* The metadata as one JSON object of strings into out[cap] (NUL included; *needed says how many bytes). */
kvc_status kvc_cache_file_meta_json(const kvc_cache_file *f, char *out, size_t cap, size_t *needed);
/* A reader of the file's state tensors (kvc_state_io of persist/press_state.h; kvc_state_io_free it). */
kvc_status kvc_cache_file_state(const kvc_cache_file *f, kvc_state_io *io);
/* Fill the empty cache c of the model of configuration cfg and weights' digest model_digest from the file
 * (model identity and every tensor checked first; on a failure c is left empty, in its own type); *position
 * receives the saved position. The rows go into the storage type `as` (checked by the caller), or the file's
 * where as is NULL. The caller holds the backend lock. */
kvc_status kvc_cache_file_load(const kvc_cache_file *f, const kvc_config *cfg, const char *model_digest,
                               const kvc_kv_format *as, kvc_cache *c, int64_t *position);

#endif
