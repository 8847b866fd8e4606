/* A small strict JSON parser (RFC 8259): recursive descent, depth-limited, bounds-checked. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "json.h"

#define MAX_DEPTH 64

typedef struct parser {
    const char *s, *end, *start;
    const char *what;
    int depth;
} parser;

static kvc_status perr(parser *p, const char *msg) {
    return kvc_fail(KVC_ERR_FORMAT, "%s: invalid JSON at byte %zu: %s", p->what, (size_t)(p->s - p->start), msg);
}

static void skip_ws(parser *p) {
    while (p->s < p->end && (*p->s == ' ' || *p->s == '\t' || *p->s == '\n' || *p->s == '\r')) p->s++;
}

static kvc_status parse_value(parser *p, json_value *v);

static int hexval(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
}

static kvc_status read_hex4(parser *p, uint32_t *out) {
    if (p->end - p->s < 4) return perr(p, "truncated \\u escape");
    uint32_t v = 0;
    for (int i = 0; i < 4; i++) {
        int h = hexval(p->s[i]);
        if (h < 0) return perr(p, "bad \\u escape");
        v = v * 16 + (uint32_t)h;
    }
    p->s += 4;
    *out = v;
    return KVC_OK;
}

static size_t utf8_put(char *o, uint32_t cp) {
    if (cp < 0x80) { o[0] = (char)cp; return 1; }
    if (cp < 0x800) { o[0] = (char)(0xC0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* p->s at the opening quote. The output is never longer than the input (escapes shrink). */
static kvc_status parse_string(parser *p, char **out, size_t *out_len) {
    p->s++;
    const char *q = p->s;
    while (q < p->end && *q != '"') {
        if (*q == '\\') q++;
        q++;
    }
    if (q >= p->end) return perr(p, "unterminated string");
    char *buf = malloc((size_t)(q - p->s) + 1);
    if (!buf) return kvc_fail(KVC_ERR_NOMEM, "out of memory: JSON string");
    size_t n = 0;
    while (p->s < p->end && *p->s != '"') {
        unsigned char c = (unsigned char)*p->s;
        if (c < 0x20) {
            free(buf);
            return perr(p, "control character in string");
        }
        if (c != '\\') {
            buf[n++] = (char)c;
            p->s++;
            continue;
        }
        p->s++;
        if (p->s >= p->end) {
            free(buf);
            return perr(p, "truncated escape");
        }
        char e = *p->s++;
        switch (e) {
        case '"': buf[n++] = '"'; break;
        case '\\': buf[n++] = '\\'; break;
        case '/': buf[n++] = '/'; break;
        case 'b': buf[n++] = '\b'; break;
        case 'f': buf[n++] = '\f'; break;
        case 'n': buf[n++] = '\n'; break;
        case 'r': buf[n++] = '\r'; break;
        case 't': buf[n++] = '\t'; break;
        case 'u': {
            uint32_t cp;
            kvc_status st = read_hex4(p, &cp);
            if (st == KVC_OK && cp >= 0xD800 && cp <= 0xDBFF) {
                uint32_t lo;
                if (p->end - p->s >= 6 && p->s[0] == '\\' && p->s[1] == 'u') {
                    p->s += 2;
                    st = read_hex4(p, &lo);
                    if (st == KVC_OK && (lo < 0xDC00 || lo > 0xDFFF)) st = perr(p, "invalid surrogate pair");
                    if (st == KVC_OK) cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                } else {
                    st = perr(p, "lone high surrogate");
                }
            } else if (st == KVC_OK && cp >= 0xDC00 && cp <= 0xDFFF) {
                st = perr(p, "lone low surrogate");
            }
            if (st != KVC_OK) {
                free(buf);
                return st;
            }
            n += utf8_put(buf + n, cp); /* <= 4 bytes from a 6- or 12-byte escape */
            break;
        }
        default:
            free(buf);
            return perr(p, "unknown escape");
        }
    }
    p->s++; /* closing quote */
    buf[n] = '\0';
    *out = buf;
    *out_len = n;
    return KVC_OK;
}

static kvc_status parse_number(parser *p, json_value *v) {
    const char *b = p->s;
    if (p->s < p->end && *p->s == '-') p->s++;
    if (p->s >= p->end) return perr(p, "truncated number");
    if (*p->s == '0') {
        p->s++;
    } else if (*p->s >= '1' && *p->s <= '9') {
        while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
    } else {
        return perr(p, "bad number");
    }
    if (p->s < p->end && *p->s == '.') {
        p->s++;
        if (p->s >= p->end || *p->s < '0' || *p->s > '9') return perr(p, "bad fraction");
        while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
    }
    if (p->s < p->end && (*p->s == 'e' || *p->s == 'E')) {
        p->s++;
        if (p->s < p->end && (*p->s == '+' || *p->s == '-')) p->s++;
        if (p->s >= p->end || *p->s < '0' || *p->s > '9') return perr(p, "bad exponent");
        while (p->s < p->end && *p->s >= '0' && *p->s <= '9') p->s++;
    }
    char tmp[64];
    size_t len = (size_t)(p->s - b);
    if (len >= sizeof tmp) return perr(p, "number too long");
    memcpy(tmp, b, len);
    tmp[len] = '\0';
    v->kind = JSON_NUMBER;
    v->number = strtod(tmp, NULL);
    if (!isfinite(v->number)) return perr(p, "number out of range");
    return KVC_OK;
}

static int literal(parser *p, const char *lit) {
    size_t n = strlen(lit);
    if ((size_t)(p->end - p->s) >= n && memcmp(p->s, lit, n) == 0) {
        p->s += n;
        return 1;
    }
    return 0;
}

static kvc_status push(json_value *v, size_t *cap, int with_keys) {
    if (v->n < *cap) return KVC_OK;
    size_t nc = *cap ? *cap * 2 : 8;
    json_value *items = realloc(v->items, nc * sizeof *items);
    if (!items) return kvc_fail(KVC_ERR_NOMEM, "out of memory: JSON");
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, nc * sizeof *keys);
        if (!keys) return kvc_fail(KVC_ERR_NOMEM, "out of memory: JSON");
        v->keys = keys;
    }
    *cap = nc;
    return KVC_OK;
}

static kvc_status parse_container(parser *p, json_value *v, int object) {
    if (++p->depth > MAX_DEPTH) return perr(p, "nesting deeper than 64");
    v->kind = object ? JSON_OBJECT : JSON_ARRAY;
    p->s++;
    size_t cap = 0;
    skip_ws(p);
    if (p->s < p->end && *p->s == (object ? '}' : ']')) {
        p->s++;
        p->depth--;
        return KVC_OK;
    }
    for (;;) {
        KVC_TRY(push(v, &cap, object));
        json_value *item = &v->items[v->n];
        memset(item, 0, sizeof *item);
        if (object) {
            v->keys[v->n] = NULL;
            skip_ws(p);
            if (p->s >= p->end || *p->s != '"') return perr(p, "expected a string key");
            size_t kl;
            v->n++; /* so that the key is freed on failure */
            KVC_TRY(parse_string(p, &v->keys[v->n - 1], &kl));
            skip_ws(p);
            if (p->s >= p->end || *p->s != ':') return perr(p, "expected ':'");
            p->s++;
            KVC_TRY(parse_value(p, item));
        } else {
            v->n++;
            KVC_TRY(parse_value(p, item));
        }
        skip_ws(p);
        if (p->s >= p->end) return perr(p, "unterminated container");
        if (*p->s == ',') {
            p->s++;
            continue;
        }
        if (*p->s == (object ? '}' : ']')) {
            p->s++;
            p->depth--;
            return KVC_OK;
        }
        return perr(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static kvc_status parse_value(parser *p, json_value *v) {
    skip_ws(p);
    if (p->s >= p->end) return perr(p, "unexpected end");
    switch (*p->s) {
    case '{': return parse_container(p, v, 1);
    case '[': return parse_container(p, v, 0);
    case '"': v->kind = JSON_STRING; return parse_string(p, &v->string, &v->string_len);
    case 't': if (literal(p, "true")) { v->kind = JSON_BOOL; v->boolean = 1; return KVC_OK; } break;
    case 'f': if (literal(p, "false")) { v->kind = JSON_BOOL; v->boolean = 0; return KVC_OK; } break;
    case 'n': if (literal(p, "null")) { v->kind = JSON_NULL; return KVC_OK; } break;
    default:
        if (*p->s == '-' || (*p->s >= '0' && *p->s <= '9')) return parse_number(p, v);
    }
    return perr(p, "unexpected character");
}

static void free_inner(json_value *v) {
    free(v->string);
    for (size_t i = 0; i < v->n; i++) {
        free_inner(&v->items[i]);
        if (v->keys) free(v->keys[i]);
    }
    free(v->items);
    free(v->keys);
}

void json_free(json_value *v) {
    if (!v) return;
    free_inner(v);
    free(v);
}

kvc_status json_parse(const char *text, size_t len, const char *what, json_value **out) {
    *out = NULL;
    json_value *v = calloc(1, sizeof *v);
    if (!v) return kvc_fail(KVC_ERR_NOMEM, "out of memory: JSON");
    parser p = {text, text + len, text, what, 0};
    kvc_status st = parse_value(&p, v);
    if (st == KVC_OK) {
        skip_ws(&p);
        if (p.s != p.end) st = perr(&p, "trailing characters after the value");
    }
    if (st != KVC_OK) {
        json_free(v);
        return st;
    }
    *out = v;
    return KVC_OK;
}

const json_value *json_get(const json_value *v, const char *key) {
    if (!v || v->kind != JSON_OBJECT) return NULL;
    for (size_t i = 0; i < v->n; i++)
        if (v->keys[i] && strcmp(v->keys[i], key) == 0) return &v->items[i];
    return NULL;
}
