/* The presses' states in a saved cache (press_state.h): named arrays written by the presses' save_state hooks and
 * read back by their load_state hooks, which check every value against their settings and the loaded cache. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "press_state.h"

#define CORRUPT "; the file is corrupt"

void kvc_state_writer_init(kvc_state_io *io) { memset(io, 0, sizeof *io); }

kvc_status kvc_state_reader_init(kvc_state_io *io, const st_file *st, const char *path) {
    memset(io, 0, sizeof *io);
    io->st = st;
    io->path = path;
    io->used = calloc((size_t)(st_n_tensors(st) > 0 ? st_n_tensors(st) : 1), 1);
    return io->used ? KVC_OK : kvc_fail(KVC_ERR_NOMEM, "out of memory: reading a press's state");
}

void kvc_state_io_free(kvc_state_io *io) {
    for (int32_t i = 0; i < io->n; i++) free(io->arr[i].data);
    free(io->arr);
    free(io->used);
    memset(io, 0, sizeof *io);
}

kvc_status kvc_state_slot(kvc_state_io *io, const char *slot) {
    const int n = snprintf(io->prefix, sizeof io->prefix, KVC_STATE_PREFIX "%s.", slot);
    if (n < 0 || (size_t)n >= sizeof io->prefix) return kvc_fail(KVC_ERR_ARG, "a press's state: slot name '%s' too long", slot);
    io->plen = (size_t)n;
    return KVC_OK;
}

size_t kvc_state_scope(kvc_state_io *io, const char *scope) {
    const size_t mark = io->plen;
    const int n = snprintf(io->prefix + mark, sizeof io->prefix - mark, "%s.", scope);
    if (n > 0 && mark + (size_t)n < sizeof io->prefix) io->plen = mark + (size_t)n;
    else io->prefix[mark] = '\0'; /* too long: names stay in the slot (every scope name is short) */
    return mark;
}

void kvc_state_unscope(kvc_state_io *io, size_t mark) {
    io->plen = mark;
    io->prefix[mark] = '\0';
}

static kvc_status full_name(const kvc_state_io *io, const char *name, char *out) {
    const int n = snprintf(out, KVC_STATE_NAME, "%.*s%s", (int)io->plen, io->prefix, name);
    if (n < 0 || n >= KVC_STATE_NAME) return kvc_fail(KVC_ERR_ARG, "a press's state: array name '%s' too long", name);
    return KVC_OK;
}

kvc_status kvc_state_put(kvc_state_io *io, const char *name, int32_t dtype, const void *data, int64_t n) {
    if (!io || io->st || !name || (dtype != KVC_I64 && dtype != KVC_F32) || n < 0 || (n > 0 && !data))
        return kvc_fail(KVC_ERR_INTERNAL, "kvc_state_put: bad arguments (%s)", name ? name : "no name");
    if (io->n == io->cap) {
        const int32_t cap = io->cap ? io->cap * 2 : 16;
        kvc_state_array *a = realloc(io->arr, sizeof *a * (size_t)cap);
        if (!a) return kvc_fail(KVC_ERR_NOMEM, "out of memory: a press's state");
        io->arr = a;
        io->cap = cap;
    }
    kvc_state_array *a = &io->arr[io->n];
    KVC_TRY(full_name(io, name, a->name));
    for (int32_t i = 0; i < io->n; i++)
        if (strcmp(io->arr[i].name, a->name) == 0) return kvc_fail(KVC_ERR_INTERNAL, "a press's state: '%s' twice", a->name);
    const size_t bytes = (size_t)n * kvc_dtype_size(dtype);
    if (!(a->data = malloc(bytes ? bytes : 1))) return kvc_fail(KVC_ERR_NOMEM, "out of memory: a press's state");
    if (bytes) memcpy(a->data, data, bytes);
    a->dtype = dtype;
    a->n = n;
    io->n++;
    return KVC_OK;
}

/* The file's tensor of `name` in the current slot, its index in *at; NULL when absent. */
static const st_tensor *find(const kvc_state_io *io, const char *name, int64_t *at, kvc_status *st) {
    char full[KVC_STATE_NAME];
    *st = full_name(io, name, full);
    if (*st != KVC_OK) return NULL;
    for (int64_t i = 0; i < st_n_tensors(io->st); i++) {
        const st_tensor *t = st_tensor_at(io->st, i);
        if (strcmp(t->name, full) == 0) {
            *at = i;
            return t;
        }
    }
    return NULL;
}

static const char *dtype_name(int32_t dtype) { return dtype == KVC_I64 ? "I64" : "F32"; }

kvc_status kvc_state_count(kvc_state_io *io, const char *name, int32_t dtype, int64_t *n) {
    if (!io || !io->st || !name || !n) return kvc_fail(KVC_ERR_INTERNAL, "kvc_state_count: bad arguments");
    int64_t at = -1;
    kvc_status st = KVC_OK;
    const st_tensor *t = find(io, name, &at, &st);
    *n = -1;
    if (st != KVC_OK || !t) return st;
    if (strcmp(t->dtype_name, dtype_name(dtype)) != 0 || t->n_dims != 1)
        return kvc_fail(KVC_ERR_FORMAT, "'%s': state tensor %s is %s with %d dimensions, not the one-dimensional %s its press "
                        "keeps" CORRUPT, io->path, t->name, t->dtype_name, t->n_dims, dtype_name(dtype));
    *n = t->shape[0];
    return KVC_OK;
}

kvc_status kvc_state_get(kvc_state_io *io, const char *name, int32_t dtype, void *out, int64_t n) {
    int64_t have = -1, at = -1;
    KVC_TRY(kvc_state_count(io, name, dtype, &have));
    if (have < 0)
        return kvc_fail(KVC_ERR_FORMAT, "'%s' has no state tensor %.*s%s, which the press attached keeps (saved with a "
                        "press of other settings?)", io->path, (int)io->plen, io->prefix, name);
    if (have != n)
        return kvc_fail(KVC_ERR_FORMAT, "'%s': state tensor %.*s%s holds %lld values where the press attached keeps %lld "
                        "(saved with a press of other settings?)", io->path, (int)io->plen, io->prefix, name,
                        (long long)have, (long long)n);
    kvc_status st = KVC_OK;
    const st_tensor *t = find(io, name, &at, &st);
    if (n > 0) memcpy(out, t->data, (size_t)n * kvc_dtype_size(dtype)); /* the mapping may be unaligned: a copy */
    io->used[at] = 1;
    return KVC_OK;
}

kvc_status kvc_state_bad(kvc_state_io *io, const char *fmt, ...) {
    char what[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof what, fmt, ap);
    va_end(ap);
    return kvc_fail(KVC_ERR_FORMAT, "'%s': %s", io && io->path ? io->path : "a saved cache", what);
}

int kvc_state_present(const kvc_state_io *io) {
    for (int64_t i = 0; io->st && i < st_n_tensors(io->st); i++)
        if (strncmp(st_tensor_at(io->st, i)->name, io->prefix, io->plen) == 0) return 1;
    return 0;
}

kvc_status kvc_state_all_read(const kvc_state_io *io) {
    for (int64_t i = 0; io->st && i < st_n_tensors(io->st); i++) {
        const char *name = st_tensor_at(io->st, i)->name;
        if (strncmp(name, io->prefix, io->plen) == 0 && !io->used[i])
            return kvc_fail(KVC_ERR_FORMAT, "'%s' holds state tensor %s, which the press attached does not keep (a press "
                            "with other settings?)", io->path, name);
    }
    return KVC_OK;
}

kvc_status kvc_state_check_tensor(const st_tensor *t, const char *path) {
    const char *rest = t->name + strlen(KVC_STATE_PREFIX), *dot = strchr(rest, '.');
    if (strlen(t->name) >= KVC_STATE_NAME || !dot || dot == rest || !dot[1])
        return kvc_fail(KVC_ERR_FORMAT, "'%s': state tensor '%.60s' is not named state.<press>.<array>" CORRUPT, path, t->name);
    if (t->n_dims != 1 || (strcmp(t->dtype_name, "I64") != 0 && strcmp(t->dtype_name, "F32") != 0))
        return kvc_fail(KVC_ERR_FORMAT, "'%s': state tensor %s is %s with %d dimensions, not a one-dimensional I64 or F32 "
                        "array" CORRUPT, path, t->name, t->dtype_name, t->n_dims);
    return KVC_OK;
}
