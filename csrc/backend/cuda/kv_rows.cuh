/* What the kernels read a layer's K/V rows through (a row source, passed by value to a kernel): a source's
 * head(h, d) gives the rows of KV head h, key<N>(r, c0, out) / value<N> channels [c0, c0 + N) of row r as f32
 * (channels past d read 0; d the kernel's head_dim), key8 / value8 channels [c0, c0 + 8) as 8 packed bf16 (the prefill tiles).
 *   Bf16Rows   the native store: bf16 rows [len, d] per head (device tables of head pointers);
 *   TypedRows  a typed store (kv_typed.cu): rows < nq in the type, decoded by core/kv_type.h's functions (the
 *              formats' one home), rows [nq, len) from the f32 staging rows; ThinK-pruned rows read zeros in
 *              their dropped channels. Everything it reads comes from the store's device table, so a captured
 *              graph stays valid while the arena, the staging rows and nq move.
 * The attention kernels are templates over the source; the bf16 one compiles to the loads it always had. */
#ifndef KVC_CUDA_KV_ROWS_CUH
#define KVC_CUDA_KV_ROWS_CUH

#include "common.cuh"

namespace kvc {

/* N contiguous bf16 of a row at dimension e0: one vector load when the row is exactly 32 N (a warp's lanes
 * then read the row in one instruction), else element by element */
template <int N> __device__ __forceinline__ void load_bf16_row(const bf16 *src, int d, int e0, float *out) {
    if (N >= 2 && d == 32 * N) {
        if (N == 2) {
            const __nv_bfloat162 v = *(const __nv_bfloat162 *)(src + e0);
            out[0] = __low2float(v);
            out[1] = __high2float(v);
        } else if (N == 4) {
            const uint2 raw = *(const uint2 *)(src + e0);
            const bf16 *b = (const bf16 *)&raw;
            for (int t = 0; t < 4; t++) out[t] = __bfloat162float(b[t]);
        } else {
            const uint4 raw = *(const uint4 *)(src + e0);
            const bf16 *b = (const bf16 *)&raw;
            for (int t = 0; t < N; t++) out[t] = __bfloat162float(b[t]);
        }
    } else {
        for (int t = 0; t < N; t++) out[t] = e0 + t < d ? __bfloat162float(src[e0 + t]) : 0.f;
    }
}

struct Bf16Rows {
    const bf16 *const *kp, *const *vp; /* device tables [Hkv] */

    struct Head {
        const bf16 *K, *V;
        int32_t d;
        template <int N> __device__ __forceinline__ void key(int64_t r, int c0, float *out) const {
            load_bf16_row<N>(K + r * d, d, c0, out);
        }
        template <int N> __device__ __forceinline__ void value(int64_t r, int c0, float *out) const {
            load_bf16_row<N>(V + r * d, d, c0, out);
        }
        __device__ __forceinline__ uint4 key8(int64_t r, int c0) const { return *(const uint4 *)(K + r * d + c0); }
        __device__ __forceinline__ uint4 value8(int64_t r, int c0) const { return *(const uint4 *)(V + r * d + c0); }
    };
    __device__ __forceinline__ Head head(int h, int32_t d) const { return Head{kp[h], vp[h], d}; }
};

__device__ __forceinline__ uint4 pack8_bf16(const float *x) {
    uint4 u;
    __nv_bfloat162 *b = (__nv_bfloat162 *)&u;
    for (int t = 0; t < 4; t++) b[t] = __floats2bfloat162_rn(x[2 * t], x[2 * t + 1]);
    return u;
}

struct TypedRows {
    const KvTab *tab;  /* the store's device table */
    kvc_kv_format f;
    int32_t d;
    uint64_t krow, vrow, kblock;

    struct Head {
        const uint8_t *k, *v, *kp;
        const float *st;
        const int32_t *inv; /* this head's channel map (dk > 0) */
        int64_t np, nq;
        int32_t dk, d;
        kvc_kv_format f;
        uint64_t krow, vrow, kprow, kblock;

        /* channels [c0, c0 + n) of key row r, n <= d - c0 */
        __device__ void key_n(int64_t r, int c0, int n, float *out) const {
            if (r >= nq) {
                const float *s = st + (r - nq) * 2 * d + c0;
                for (int t = 0; t < n; t++) out[t] = s[t];
            } else if (kvc_kv_type_key_blocks(f.type)) {
                const int64_t G = f.group;
                kvc_kivi_decode_cols(&f, k + (r / G) * kblock, d, (int32_t)(r % G), 1, c0, n, out, (size_t)n);
                if (r < np) /* a pruned row keeps the block's width: its dropped channels read zero */
                    for (int t = 0; t < n; t++) out[t] = inv[c0 + t] < 0 ? 0.f : out[t];
            } else if (r < np) { /* a narrow row: its kept channels only */
                const uint8_t *row = kp + r * kprow;
                for (int t = 0; t < n; t++) {
                    const int j = inv[c0 + t];
                    if (j < 0) out[t] = 0.f;
                    else kvc_kv_decode_span(&f, row, dk, j, 1, out + t);
                }
            } else {
                kvc_kv_decode_span(&f, k + (r - np) * krow, d, c0, n, out);
            }
        }
        __device__ void value_n(int64_t r, int c0, int n, float *out) const {
            if (r >= nq) {
                const float *s = st + (r - nq) * 2 * d + d + c0;
                for (int t = 0; t < n; t++) out[t] = s[t];
            } else {
                kvc_kv_decode_span(&f, v + r * vrow, d, c0, n, out);
            }
        }
        template <int N> __device__ __forceinline__ void key(int64_t r, int c0, float *out) const {
            const int n = d - c0 < N ? d - c0 : N;
            if (n > 0) key_n(r, c0, n, out);
            for (int t = n > 0 ? n : 0; t < N; t++) out[t] = 0.f;
        }
        template <int N> __device__ __forceinline__ void value(int64_t r, int c0, float *out) const {
            const int n = d - c0 < N ? d - c0 : N;
            if (n > 0) value_n(r, c0, n, out);
            for (int t = n > 0 ? n : 0; t < N; t++) out[t] = 0.f;
        }
        __device__ __forceinline__ uint4 key8(int64_t r, int c0) const {
            float x[8];
            key<8>(r, c0, x);
            return pack8_bf16(x);
        }
        __device__ __forceinline__ uint4 value8(int64_t r, int c0) const {
            float x[8];
            value<8>(r, c0, x);
            return pack8_bf16(x);
        }
    };
    __device__ __forceinline__ Head head(int h, int32_t d) const {
        Head o;
        o.k = tab->k[h];
        o.v = tab->v[h];
        o.kp = tab->kp[h];
        o.st = tab->st[h];
        o.dk = tab->dk;
        o.inv = tab->inv + (size_t)h * d;
        o.np = tab->np[h];
        o.nq = tab->nq[h];
        o.d = d;
        o.f = f;
        o.krow = krow;
        o.vrow = vrow;
        o.kprow = tab->kprow;
        o.kblock = kblock;
        return o;
    }
};

/* The attention kernels' typed source: the store's type fixed when the kernel is compiled, so the formats' switch
 * folds away and a lane decodes its channels in registers (one kernel per type). */
template <int T> struct TypedRowsOf : TypedRows {
    __device__ __forceinline__ Head head(int h, int32_t d) const {
        Head o = TypedRows::head(h, d);
        o.f.type = T;
        return o;
    }
};

/* Every row source the attention kernels are compiled for (explicit instantiations: X(source)). */
#define KVC_ROW_SOURCES(X)                                                                                          \
    X(Bf16Rows) X(TypedRowsOf<KVC_KV_F32>) X(TypedRowsOf<KVC_KV_F16>) X(TypedRowsOf<KVC_KV_Q8_0>)                 \
        X(TypedRowsOf<KVC_KV_KIVI4>) X(TypedRowsOf<KVC_KV_KIVI2>)

/* The typed store's source (kv_typed.cu; the layout kernels read any type through it). */
TypedRows typed_rows(const kvc_kv *kv);

/* f(source) with the typed store's source of its type (the attention entries). */
template <class F> kvc_status with_typed_rows(const kvc_kv *kv, F &&f) {
    const TypedRows t = typed_rows(kv);
    switch (kv->fmt.type) {
    case KVC_KV_F32: return f(TypedRowsOf<KVC_KV_F32>{t});
    case KVC_KV_F16: return f(TypedRowsOf<KVC_KV_F16>{t});
    case KVC_KV_Q8_0: return f(TypedRowsOf<KVC_KV_Q8_0>{t});
    case KVC_KV_KIVI4: return f(TypedRowsOf<KVC_KV_KIVI4>{t});
    case KVC_KV_KIVI2: return f(TypedRowsOf<KVC_KV_KIVI2>{t});
    default: return fail(KVC_ERR_INTERNAL, "K/V store of type %d: no attention kernel", kv->fmt.type);
    }
}

} // namespace kvc

#endif
