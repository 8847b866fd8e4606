/* A small strict JSON parser (RFC 8259) for config.json, safetensors headers and index files.
 * Depth- and size-limited; never reads past the given buffer. */
#ifndef KVC_JSON_H
#define KVC_JSON_H

#include "../core/common.h"

typedef enum json_kind { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT } json_kind;

typedef struct json_value {
    json_kind kind;
    int boolean;
    double number;
    char *string;              /* NUL-terminated, unescaped (UTF-8) */
    size_t string_len;
    struct json_value *items;  /* array elements or object values */
    char **keys;               /* object keys (same order as items) */
    size_t n;                  /* number of items */
} json_value;

/* Parse `len` bytes; on failure KVC_ERR_FORMAT with a message naming `what` and the byte offset. */
kvc_status json_parse(const char *text, size_t len, const char *what, json_value **out);
void json_free(json_value *v);
/* Object member by key, or NULL (also NULL if v is not an object). */
const json_value *json_get(const json_value *v, const char *key);

#endif
