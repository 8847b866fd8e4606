/* The presses' states in a saved cache (core/press_i.h, kvc_state_io): written as named arrays that the cache file
 * stores as its state.<slot>.<name> tensors (one-dimensional, I64 or F32), read back from the file's tensors. */
#ifndef KVC_PRESS_STATE_H
#define KVC_PRESS_STATE_H

#include "../core/press_i.h"
#include "../model/safetensors.h"

#define KVC_STATE_PREFIX "state."
#define KVC_STATE_NAME 160 /* a state tensor's full name, NUL included, at most */

typedef struct kvc_state_array {
    char name[KVC_STATE_NAME]; /* state.<slot>.<name> */
    int32_t dtype;             /* KVC_I64 or KVC_F32 */
    int64_t n;
    void *data;
} kvc_state_array;

struct kvc_state_io {
    char prefix[KVC_STATE_NAME]; /* state.<slot>.[scopes.] */
    size_t plen;
    /* writing */
    kvc_state_array *arr;
    int32_t n, cap;
    /* reading */
    const st_file *st;
    const char *path;
    char *used; /* [st_n_tensors]: read by the press */
};

/* A writer (every slot's arrays go into one), or a reader of st's tensors (path: for messages). */
void kvc_state_writer_init(kvc_state_io *io);
kvc_status kvc_state_reader_init(kvc_state_io *io, const st_file *st, const char *path);
void kvc_state_io_free(kvc_state_io *io);
/* Names from here on belong to the press of slot `slot` (state.<slot>.); KVC_ERR_ARG if the name is too long. */
kvc_status kvc_state_slot(kvc_state_io *io, const char *slot);
/* KVC_ERR_FORMAT naming the first array of the current slot the press did not read. */
kvc_status kvc_state_all_read(const kvc_state_io *io);
/* A state tensor's structure: its name inside state.<slot>.<name> (KVC_STATE_NAME), one dimension, I64 or F32. */
kvc_status kvc_state_check_tensor(const st_tensor *t, const char *path);

#endif
