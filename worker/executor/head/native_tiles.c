/*
 * Compiled LM-head tile reduction (worker/executor/native.py builds and loads this file).
 *
 * One call folds a [n, t] tile of transformed logits z (float32, row stride ld; vocabulary ids
 * v0 .. v0 + t - 1) into per-row running state, as tiles.OnlineLogSumExp and topk.OnlineTopK
 * do with several torch ops, in one read of each row while it sits in L1:
 *
 *   y = z * factor                (base-2 logits: factor = log2(e) / T)
 *   m' = max(m, max_j y_j)        (m starts at -FLT_MAX, never -inf)
 *   s' = s * 2^(m - m') + sum_j 2^(y_j - m')
 *   ent' = (ent + (m - m') s) 2^(m - m') + sum_j 2^(y_j - m') (y_j - m')      (optional)
 *   top k: a min-heap per row of the best k (value, id) seen (only the 16 strided groups
 *   of a row whose max beats the heap's minimum are read again); tail sums 2^(y - m') of every
 *   other token seen (those at or below the heap's minimum, and those the heap evicts), kept
 *   against the running max like s                                            (optional)
 *
 * Rows are split over the calling process's OpenMP threads; loaded after torch, the library
 * binds to torch's own libgomp (same soname), so it shares torch's thread pool.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define SW_ABI 1

int sw_abi(void) { return SW_ABI; }

/* 2^x for x <= 0, vectorisable: round to an integer xi, a degree-7 polynomial of e^u with
   u = (x - xi) ln 2 in [-0.35, 0.35] (truncation ~6e-9 relative), times 2^xi from the exponent
   bits. Below -126 (2^x under FLT_MIN, and -inf) it returns 0. */
static inline float exp2_neg(float x) {
    float xc = x < -126.0f ? -126.0f : x;
    float xi = rintf(xc);
    float u = (xc - xi) * 0.6931471805599453f;
    float p = 1.0f / 5040.0f; /* Horner in explicit fused multiply-adds (the build turns off
                                   contraction elsewhere, so that z * factor rounds alike) */
    p = fmaf(p, u, 1.0f / 720.0f);
    p = fmaf(p, u, 1.0f / 120.0f);
    p = fmaf(p, u, 1.0f / 24.0f);
    p = fmaf(p, u, 1.0f / 6.0f);
    p = fmaf(p, u, 0.5f);
    p = fmaf(p, u, 1.0f);
    p = fmaf(p, u, 1.0f);
    int32_t bits = ((int32_t)xi + 127) << 23;
    float two_xi;
    memcpy(&two_xi, &bits, sizeof two_xi);
    return x < -126.0f ? 0.0f : p * two_xi;
}

#define LANES 16

/* g[l] = max of z[c] over c % LANES == l (a strided group per lane: a vertical max, no
   horizontal step per group); returns the row's max */
static inline float group_max(const float *z, int64_t t, float *g) {
    for (int l = 0; l < LANES; l++) g[l] = -INFINITY;
    int64_t c = 0;
    for (; c + LANES <= t; c += LANES)
#pragma omp simd
        for (int l = 0; l < LANES; l++) g[l] = z[c + l] > g[l] ? z[c + l] : g[l];
    for (int l = 0; c + l < t; l++) g[l] = z[c + l] > g[l] ? z[c + l] : g[l];
    float m = -INFINITY;
    for (int l = 0; l < LANES; l++) m = g[l] > m ? g[l] : m;
    return m;
}

/* sum 2^(y - m') over a row */
static float sum_row(const float *z, int64_t t, float f, float nm) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < t; c++) s += exp2_neg(z[c] * f - nm);
    return s;
}

/* out: sum e, sum e * (y - m') (entropy; the clamp keeps -inf logits at 0 * -126 = 0), and
   sum e over y <= bar (the tail's share of the tokens the heap does not look at) */
static void sums_row(const float *z, int64_t t, float f, float nm, float bar, float *out) {
    float s = 0.0f, en = 0.0f, tl = 0.0f;
#pragma omp simd reduction(+ : s, en, tl)
    for (int64_t c = 0; c < t; c++) {
        float y = z[c] * f;
        float d = y - nm;
        float e = exp2_neg(d);
        float dc = d < -126.0f ? -126.0f : d;
        s += e;
        en += e * dc;
        tl += y <= bar ? e : 0.0f;
    }
    out[0] = s;
    out[1] = en;
    out[2] = tl;
}

/* sum 2^(v - m') over a few values (the scan's rejects, vectorised in one go) */
static float sum_spill(const float *v, int n, float nm) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += exp2_neg(v[i] - nm);
    return s;
}

#define SPILL 256

/* replace the root of a min-heap of k (value, id) pairs and restore the order */
static void heap_replace_root(float *hv, int64_t *hid, int64_t k, float v, int64_t id) {
    int64_t i = 0;
    for (;;) {
        int64_t l = 2 * i + 1, r = l + 1, c;
        if (l >= k) break;
        c = (r < k && hv[r] < hv[l]) ? r : l;
        if (hv[c] >= v) break;
        hv[i] = hv[c];
        hid[i] = hid[c];
        i = c;
    }
    hv[i] = v;
    hid[i] = id;
}

typedef struct {
    const float *z;
    int64_t ld, t, k, v0;
    float factor;
    float *m, *s, *ent, *hv, *tail;
    int64_t *hid;
} tile_t;

static void reduce_row(const tile_t *a, int64_t r) {
    const float *z = a->z + r * a->ld;
    const int64_t t = a->t, k = a->k;
    const float f = a->factor;
    float groups[LANES];
    const float row_max = group_max(z, t, groups) * f; /* f > 0: the max of z * f */
    const float m = a->m[r];
    const float nm = row_max > m ? row_max : m;
    const float scale = exp2f(m - nm);
    float *hv = a->hv ? a->hv + r * k : 0;
    const float bar = hv ? hv[0] : INFINITY;
    float sums[3] = {0.0f, 0.0f, 0.0f};
    if (a->ent || hv)
        sums_row(z, t, f, nm, bar, sums);
    else
        sums[0] = sum_row(z, t, f, nm);
    if (a->ent) a->ent[r] = (a->ent[r] + (m - nm) * a->s[r]) * scale + sums[1];
    a->s[r] = a->s[r] * scale + sums[0];
    a->m[r] = nm;
    if (!hv) return;
    float tail = a->tail[r] * scale + sums[2];
    if (row_max > bar) {
        int64_t *hid = a->hid + r * k;
        float spill[SPILL]; /* values that leave or never enter the heap: their mass is tail */
        int ns = 0;
        for (int l = 0; l < LANES; l++) { /* the strided groups whose max beats the bar */
            if (groups[l] * f <= bar) continue;
            for (int64_t c = l; c < t; c += LANES) {
                const float y = z[c] * f;
                if (!(y > bar)) continue; /* counted in sums[2] */
                if (y > hv[0]) {
                    spill[ns++] = hv[0]; /* evicted (-inf while the heap fills: adds 0) */
                    heap_replace_root(hv, hid, k, y, a->v0 + c);
                } else {
                    spill[ns++] = y; /* beat the tile's bar, not the heap's new minimum */
                }
                if (ns == SPILL) {
                    tail += sum_spill(spill, ns, nm);
                    ns = 0;
                }
            }
        }
        tail += sum_spill(spill, ns, nm);
    }
    a->tail[r] = tail;
}

/* Fold one tile in; see the header. ent, or hv / hid / tail (the top-k: hv [n, k] starts at
   -inf, hid [n, k] int64, tail [n] at 0), may be NULL. Returns 0, or -1 on bad sizes. */
int sw_tile_reduce(const float *z, int64_t n, int64_t t, int64_t ld, float factor, float *m,
                   float *s, float *ent, float *hv, int64_t *hid, float *tail, int64_t k,
                   int64_t v0, int threads) {
    if (n < 0 || t < 1 || ld < t || !(factor > 0.0f)) return -1;
    if (hv && (k < 1 || !hid || !tail)) return -1;
    tile_t a = {z, ld, t, k, v0, factor, m, s, ent, hv, tail, hid};
    if (threads < 1) threads = 1;
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && n > 1)
    for (int64_t r = 0; r < n; r++) reduce_row(&a, r);
    return 0;
}
