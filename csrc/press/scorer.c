/* The scorer table: the rows the scorer files registered (scorer.h's KVC_REGISTER_SCORER) in the linker
 * section "kvc_scorers". The GNU linker defines __start_/__stop_ of a section whose name is a C identifier;
 * declared hidden here (the linker exports them protected), so the library binds to its own table. The
 * section's order is the link order: the rows are ranked once, at first use (pthread_once; the decoding
 * presses ask a row's traits at every step of every layer): the built-in scorers by their code (core/backend.h's kvc_scorer), then the rows that say
 * code -1 by name, so a scorer added as one file gets the next index without a code of its own. A scorer's
 * index is what a config's `scorer` holds; bindings and clients name scorers, never use the index. */
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "../core/backend.h" /* KVC_MAX_SCORERS */
#include "../core/common.h"
#include "scorer.h"

extern const kvc_scorer_i *const __start_kvc_scorers[] __attribute__((visibility("hidden")));
extern const kvc_scorer_i *const __stop_kvc_scorers[] __attribute__((visibility("hidden")));

int32_t kvc_scorer_count(void) { return (int32_t)(__stop_kvc_scorers - __start_kvc_scorers); }

/* Whether row a ranks before row b: built-in codes first, in order, then the others by name. */
static int before(const kvc_scorer_i *a, const kvc_scorer_i *b) {
    if ((a->code >= 0) != (b->code >= 0)) return a->code >= 0;
    return a->code >= 0 ? a->code < b->code : strcmp(a->name, b->name) < 0;
}

/* The rows in index order, ranked once. */
static const kvc_scorer_i *ranked[KVC_MAX_SCORERS];
static pthread_once_t ranked_once = PTHREAD_ONCE_INIT;

static void rank_rows(void) {
    for (const kvc_scorer_i *const *r = __start_kvc_scorers; r < __stop_kvc_scorers; r++) {
        int32_t rank = 0;
        for (const kvc_scorer_i *const *o = __start_kvc_scorers; o < __stop_kvc_scorers; o++) rank += before(*o, *r);
        if (rank < KVC_MAX_SCORERS) ranked[rank] = *r;
    }
}

const kvc_scorer_i *kvc_scorer_of(int32_t code) { return kvc_scorer_at(code); }

int32_t kvc_scorer_index(const kvc_scorer_i *s) {
    for (int32_t i = 0; s && i < kvc_scorer_count(); i++)
        if (kvc_scorer_at(i) == s) return i;
    return -1;
}

const kvc_scorer_i *kvc_scorer_find(const char *name) {
    for (const kvc_scorer_i *const *r = __start_kvc_scorers; name && r < __stop_kvc_scorers; r++)
        if (strcmp((*r)->name, name) == 0) return *r;
    return NULL;
}

const kvc_scorer_i *kvc_scorer_at(int32_t i) {
    if (i < 0 || i >= kvc_scorer_count() || i >= KVC_MAX_SCORERS) return NULL;
    pthread_once(&ranked_once, rank_rows);
    return ranked[i];
}

const char *kvc_scorer_titles(uint32_t traits, char *buf, size_t size) {
    int32_t n = 0, k = 0;
    for (int32_t i = 0; i < kvc_scorer_count(); i++) n += (kvc_scorer_at(i)->traits & traits) != 0;
    size_t used = 0;
    buf[0] = '\0';
    for (int32_t i = 0; i < kvc_scorer_count() && used < size; i++) {
        const kvc_scorer_i *sc = kvc_scorer_at(i);
        if (!(sc->traits & traits)) continue;
        const char *sep = k == 0 ? "" : k == n - 1 ? " or " : ", ";
        const int w = snprintf(buf + used, size - used, "%s%s", sep, sc->title);
        used += w > 0 ? (size_t)w : 0;
        k++;
    }
    return buf;
}

kvc_status kvc_scorer_info(int32_t i, const char **name, int32_t *code, uint32_t *traits, const char *const **params) {
    const kvc_scorer_i *sc = kvc_scorer_at(i);
    if (!sc) return kvc_fail(KVC_ERR_ARG, "kvc_scorer_info: no scorer %d (there are %d)", i, kvc_scorer_count());
    /* a row's promises, checked where the tests read every row: a host scorer has its function, a window
     * scorer no fixed last query */
    if (!(sc->traits & KVC_SCORER_HOST) != !sc->host || ((sc->traits & KVC_SCORER_WINDOW) && (sc->traits & KVC_SCORER_LAST_QUERY)))
        return kvc_fail(KVC_ERR_INTERNAL, "scorer %s: its traits 0x%x disagree with its row", sc->name, (unsigned)sc->traits);
    if (name) *name = sc->name;
    if (code) *code = i;
    if (traits) *traits = sc->traits;
    if (params) *params = sc->params;
    return KVC_OK;
}
