/* A small strict JSON parser (RFC 8259): recursive descent, depth-limited, bounds-checked.
 * Strict means: no comments, no trailing commas, no NaN/Infinity, no leading zeros, strings must be
 * valid UTF-8 without raw control characters, and object keys must be unique (Python's json keeps
 * the last duplicate silently; a model file with duplicates is ambiguous, so it is rejected). */
#include <locale.h>
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

static kvc_status perr_at(parser *p, const char *at, const char *msg) {
    return kvc_fail(KVC_ERR_FORMAT, "%s: invalid JSON at byte %zu: %s", p->what, (size_t)(at - p->start), msg);
}

static kvc_status perr(parser *p, const char *msg) { return perr_at(p, p->s, msg); }

static kvc_status nomem(void) { return kvc_fail(KVC_ERR_NOMEM, "out of memory while parsing JSON"); }

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
        if (h < 0) return perr(p, "bad hex digit in \\u escape");
        v = v * 16 + (uint32_t)h;
    }
    p->s += 4;
    *out = v;
    return KVC_OK;
}

static size_t utf8_put(char *o, uint32_t cp) {
    if (cp < 0x80) {
        o[0] = (char)cp;
        return 1;
    }
    if (cp < 0x800) {
        o[0] = (char)(0xC0 | (cp >> 6));
        o[1] = (char)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        o[0] = (char)(0xE0 | (cp >> 12));
        o[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
        o[2] = (char)(0x80 | (cp & 0x3F));
        return 3;
    }
    o[0] = (char)(0xF0 | (cp >> 18));
    o[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    o[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    o[3] = (char)(0x80 | (cp & 0x3F));
    return 4;
}

/* Length of the well-formed UTF-8 sequence at s (lead byte >= 0x80), or 0 if it is malformed:
 * no overlong forms, no UTF-16 surrogates, nothing above U+10FFFF (RFC 3629). */
static size_t utf8_seq(const unsigned char *s, const unsigned char *end) {
    const unsigned char c = s[0];
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF; /* allowed range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c == 0xE0) n = 3, lo = 0xA0;
    else if (c >= 0xE1 && c <= 0xEC) n = 3;
    else if (c == 0xED) n = 3, hi = 0x9F;
    else if (c >= 0xEE && c <= 0xEF) n = 3;
    else if (c == 0xF0) n = 4, lo = 0x90;
    else if (c >= 0xF1 && c <= 0xF3) n = 4;
    else if (c == 0xF4) n = 4, hi = 0x8F;
    else return 0;
    if ((size_t)(end - s) < n) return 0;
    if (s[1] < lo || s[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if (s[i] < 0x80 || s[i] > 0xBF) return 0;
    return n;
}

/* \uXXXX (and a following low surrogate for a high one) -> code point; p->s just after "\u". */
static kvc_status read_escape_u(parser *p, uint32_t *out) {
    const char *at = p->s - 2;
    uint32_t cp;
    KVC_TRY(read_hex4(p, &cp));
    if (cp >= 0xDC00 && cp <= 0xDFFF) return perr_at(p, at, "lone low surrogate in \\u escape");
    if (cp >= 0xD800 && cp <= 0xDBFF) {
        if (p->end - p->s < 2 || p->s[0] != '\\' || p->s[1] != 'u')
            return perr_at(p, at, "high surrogate not followed by a low surrogate \\u escape");
        p->s += 2;
        uint32_t lo;
        KVC_TRY(read_hex4(p, &lo));
        if (lo < 0xDC00 || lo > 0xDFFF) return perr_at(p, at, "high surrogate not followed by a low surrogate \\u escape");
        cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
    }
    *out = cp;
    return KVC_OK;
}

/* p->s at the opening quote. The unescaped output is never longer than the input, so one buffer of
 * the raw length suffices. */
static kvc_status parse_string(parser *p, char **out, size_t *out_len) {
    const char *open = p->s;
    p->s++;
    const char *q = p->s;
    while (q < p->end && *q != '"') q += (*q == '\\' && q + 1 < p->end) ? 2 : 1;
    if (q >= p->end) return perr_at(p, open, "unterminated string");
    char *buf = malloc((size_t)(q - p->s) + 1);
    if (!buf) return nomem();
    size_t n = 0;
    kvc_status st = KVC_OK;
    while (st == KVC_OK && *p->s != '"') { /* the pre-scan guarantees a closing quote before end */
        const unsigned char c = (unsigned char)*p->s;
        if (c < 0x20) {
            st = perr(p, "raw control character in string (must be escaped)");
        } else if (c >= 0x80) {
            size_t k = utf8_seq((const unsigned char *)p->s, (const unsigned char *)p->end);
            if (k == 0) {
                st = perr(p, "invalid UTF-8 in string");
            } else {
                memcpy(buf + n, p->s, k);
                n += k;
                p->s += k;
            }
        } else if (c != '\\') {
            buf[n++] = (char)c;
            p->s++;
        } else {
            const char e = p->s[1]; /* in bounds: the closing quote follows */
            p->s += 2;
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
                uint32_t cp = 0;
                st = read_escape_u(p, &cp);
                if (st == KVC_OK) n += utf8_put(buf + n, cp); /* <= 4 bytes from a 6- or 12-byte escape */
                break;
            }
            default: st = perr_at(p, p->s - 2, "unknown escape sequence"); break;
            }
        }
    }
    if (st != KVC_OK) {
        free(buf);
        return st;
    }
    p->s++; /* closing quote */
    buf[n] = '\0';
    *out = buf;
    *out_len = n;
    return KVC_OK;
}

static int is_digit(const parser *p) { return p->s < p->end && *p->s >= '0' && *p->s <= '9'; }

/* Grammar checked here; the conversion is strtod's (correctly rounded) on a NUL-terminated copy
 * whose '.' is replaced by the current locale's decimal point, so a host program that changed
 * LC_NUMERIC still reads 1e-05 correctly. */
static kvc_status parse_number(parser *p, json_value *v) {
    const char *b = p->s;
    if (p->s < p->end && *p->s == '-') p->s++;
    if (!is_digit(p)) return perr(p, "bad number (expected a digit)");
    if (*p->s == '0') {
        p->s++;
        if (is_digit(p)) return perr(p, "bad number (leading zero)");
    } else {
        while (is_digit(p)) p->s++;
    }
    if (p->s < p->end && *p->s == '.') {
        p->s++;
        if (!is_digit(p)) return perr(p, "bad number (digit expected after '.')");
        while (is_digit(p)) p->s++;
    }
    if (p->s < p->end && (*p->s == 'e' || *p->s == 'E')) {
        p->s++;
        if (p->s < p->end && (*p->s == '+' || *p->s == '-')) p->s++;
        if (!is_digit(p)) return perr(p, "bad number (digit expected in the exponent)");
        while (is_digit(p)) p->s++;
    }
    const size_t len = (size_t)(p->s - b);
    const char *dp = localeconv()->decimal_point;
    const size_t dpl = (dp && *dp) ? strlen(dp) : 1;
    char small[128], *tmp = small;
    if (len * dpl + 1 > sizeof small && !(tmp = malloc(len * dpl + 1))) return nomem();
    size_t k = 0;
    for (size_t i = 0; i < len; i++) {
        if (b[i] == '.' && dp && *dp) {
            memcpy(tmp + k, dp, dpl);
            k += dpl;
        } else {
            tmp[k++] = b[i];
        }
    }
    tmp[k] = '\0';
    v->kind = JSON_NUMBER;
    v->number = strtod(tmp, NULL);
    if (tmp != small) free(tmp);
    if (!isfinite(v->number)) return perr_at(p, b, "number out of the double range");
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

static kvc_status grow(json_value *v, size_t *cap, int with_keys) {
    if (v->n < *cap) return KVC_OK;
    size_t nc = *cap ? *cap * 2 : 8;
    if (nc > SIZE_MAX / sizeof(json_value)) return nomem();
    json_value *items = realloc(v->items, nc * sizeof *items);
    if (!items) return nomem();
    v->items = items;
    if (with_keys) {
        char **keys = realloc(v->keys, nc * sizeof *keys);
        if (!keys) return nomem();
        v->keys = keys;
    }
    *cap = nc;
    return KVC_OK;
}

static int key_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Duplicate keys: pairwise for small objects, sorted copy for large ones (safetensors headers). */
static kvc_status check_unique_keys(parser *p, const json_value *v, const char *open) {
    const char *dup = NULL;
    if (v->n <= 16) {
        for (size_t i = 0; i < v->n && !dup; i++)
            for (size_t j = i + 1; j < v->n && !dup; j++)
                if (strcmp(v->keys[i], v->keys[j]) == 0) dup = v->keys[i];
    } else {
        char **sorted = malloc(v->n * sizeof *sorted);
        if (!sorted) return nomem();
        memcpy(sorted, v->keys, v->n * sizeof *sorted);
        qsort(sorted, v->n, sizeof *sorted, key_cmp);
        for (size_t i = 1; i < v->n && !dup; i++)
            if (strcmp(sorted[i - 1], sorted[i]) == 0) dup = sorted[i];
        free(sorted);
    }
    if (!dup) return KVC_OK;
    return kvc_fail(KVC_ERR_FORMAT, "%s: invalid JSON at byte %zu: the key \"%.200s\" appears twice in this object",
                    p->what, (size_t)(open - p->start), dup);
}

static kvc_status parse_container(parser *p, json_value *v, int object) {
    const char *open = p->s;
    if (++p->depth > MAX_DEPTH) return perr(p, "nesting deeper than 64 levels");
    v->kind = object ? JSON_OBJECT : JSON_ARRAY;
    const char close = object ? '}' : ']';
    p->s++;
    size_t cap = 0;
    skip_ws(p);
    if (p->s < p->end && *p->s == close) {
        p->s++;
        p->depth--;
        return KVC_OK;
    }
    for (;;) {
        KVC_TRY(grow(v, &cap, object));
        json_value *item = &v->items[v->n];
        memset(item, 0, sizeof *item);
        if (object) v->keys[v->n] = NULL;
        v->n++; /* counted before parsing so that a partial item is freed on failure */
        if (object) {
            skip_ws(p);
            if (p->s >= p->end || *p->s != '"') return perr(p, "expected a string key");
            const char *kat = p->s;
            size_t kl;
            KVC_TRY(parse_string(p, &v->keys[v->n - 1], &kl));
            if (strlen(v->keys[v->n - 1]) != kl) return perr_at(p, kat, "object key contains \\u0000");
            skip_ws(p);
            if (p->s >= p->end || *p->s != ':') return perr(p, "expected ':' after the key");
            p->s++;
        }
        KVC_TRY(parse_value(p, item));
        skip_ws(p);
        if (p->s >= p->end) return perr_at(p, open, object ? "unterminated object" : "unterminated array");
        if (*p->s == ',') {
            p->s++;
            continue;
        }
        if (*p->s == close) {
            p->s++;
            p->depth--;
            return object ? check_unique_keys(p, v, open) : KVC_OK;
        }
        return perr(p, object ? "expected ',' or '}'" : "expected ',' or ']'");
    }
}

static kvc_status parse_value(parser *p, json_value *v) {
    skip_ws(p);
    if (p->s >= p->end) return perr(p, "unexpected end of input");
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
    if (!text && len) return kvc_fail(KVC_ERR_ARG, "json_parse: NULL text");
    json_value *v = calloc(1, sizeof *v);
    if (!v) return nomem();
    parser p = {text, text + len, text, what ? what : "JSON", 0};
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
