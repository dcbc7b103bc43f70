// AVX2 (+FMA, F16C) Adam/AdamW kernel: 8 lanes; the head up to param's 32-byte
// boundary and the tail (< 8 elements each) are staged through stack buffers and run through the same vector code, so every
// element sees identical arithmetic whatever the length or alignment.
// Compiled with -mavx2 -mfma -mf16c (setup.py); only called after CPUID says so.
#include <immintrin.h>

#include "adam_kernel.h"
#include "adam_select.h"

// No FMA contraction: every ISA must round exactly like the scalar reference (and torch).
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {
namespace {

constexpr size_t W = 8;

inline __m256 bf16x8_to_f32(__m128i h) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Round to nearest even, NaN -> quiet NaN with sign and top payload kept.
inline __m128i f32x8_to_bf16(__m256 x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x0040));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    const __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    // values are <= 0xffff: unsigned-saturating pack is exact
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

inline __m128i loadu128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
inline void storeu128(void* p, __m128i h) { _mm_storeu_si128(static_cast<__m128i*>(p), h); }

template <int G>
inline __m256 load_grad(const void* p, size_t i) {
    if constexpr (G == kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    else if constexpr (G == kBF16) return bf16x8_to_f32(loadu128(static_cast<const uint16_t*>(p) + i));
    else return _mm256_cvtph_ps(loadu128(static_cast<const uint16_t*>(p) + i));
}

template <int S>
inline __m256 load_state(const void* p, size_t i) {
    if constexpr (S == kF32) return _mm256_loadu_ps(static_cast<const float*>(p) + i);
    else return bf16x8_to_f32(loadu128(static_cast<const uint16_t*>(p) + i));
}

template <int S>
inline void store_state(void* p, size_t i, __m256 x) {
    if constexpr (S == kF32) _mm256_storeu_ps(static_cast<float*>(p) + i, x);
    else storeu128(static_cast<uint16_t*>(p) + i, f32x8_to_bf16(x));
}

template <int O>
inline void store_out(void* p, size_t i, __m256 x) {
    if constexpr (O == kF32) _mm256_storeu_ps(static_cast<float*>(p) + i, x);
    else if constexpr (O == kBF16) storeu128(static_cast<uint16_t*>(p) + i, f32x8_to_bf16(x));
    else if constexpr (O == kF16)
        storeu128(static_cast<uint16_t*>(p) + i, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

struct Consts {
    __m256 grad_scale, wd, decay, lerp_w, lerp_1mw, beta2, omb2, bc2s, eps, nss;
    bool l2, decoupled, lerp_small;
    explicit Consts(const AdamArgs& a)
        : grad_scale(_mm256_set1_ps(a.grad_scale)), wd(_mm256_set1_ps(a.weight_decay)),
          decay(_mm256_set1_ps(a.decay_factor)), lerp_w(_mm256_set1_ps(a.lerp_w)),
          lerp_1mw(_mm256_set1_ps(a.lerp_1mw)), beta2(_mm256_set1_ps(a.beta2)),
          omb2(_mm256_set1_ps(a.one_minus_beta2)), bc2s(_mm256_set1_ps(a.bc2_sqrt)),
          eps(_mm256_set1_ps(a.eps)), nss(_mm256_set1_ps(a.neg_step_size)),
          l2(!a.adamw && a.weight_decay != 0.f), decoupled(a.adamw && a.weight_decay != 0.f),
          lerp_small(a.lerp_small) {}
};

// Lanes whose |x| is not below lim (inf/NaN, or beyond the stored dtype's range).
inline __m256 not_below(__m256 x, __m256 lim) {
    const __m256 abs = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff)));
    return _mm256_cmp_ps(abs, lim, _CMP_NLT_UQ);
}

template <int G, int S, int O>
inline void step8(const AdamArgs& a, const Consts& c, size_t i, __m256& bad) {
    float* pp = a.param + i;
    __m256 p = _mm256_loadu_ps(pp);
    __m256 g = _mm256_mul_ps(load_grad<G>(a.grad, i), c.grad_scale);
    if (c.l2) g = _mm256_add_ps(g, _mm256_mul_ps(c.wd, p));
    if (c.decoupled) p = _mm256_mul_ps(p, c.decay);
    __m256 m = load_state<S>(a.exp_avg, i);
    __m256 v = load_state<S>(a.exp_avg_sq, i);
    const __m256 diff = _mm256_sub_ps(g, m);
    m = c.lerp_small ? _mm256_add_ps(m, _mm256_mul_ps(c.lerp_w, diff))
                     : _mm256_sub_ps(g, _mm256_mul_ps(diff, c.lerp_1mw));
    v = _mm256_add_ps(_mm256_mul_ps(v, c.beta2), _mm256_mul_ps(_mm256_mul_ps(c.omb2, g), g));
    const __m256 d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), c.bc2s), c.eps);
    p = _mm256_add_ps(p, _mm256_mul_ps(c.nss, _mm256_div_ps(m, d)));
    _mm256_storeu_ps(pp, p);
    store_state<S>(a.exp_avg, i, m);
    store_state<S>(a.exp_avg_sq, i, v);
    store_out<O>(a.param_out, i, p);
    bad = _mm256_or_ps(bad, _mm256_or_ps(not_below(p, _mm256_set1_ps(param_limit<O>())),
                                         _mm256_or_ps(not_below(m, _mm256_set1_ps(store_limit<S>())),
                                                      not_below(v, _mm256_set1_ps(store_limit<S>())))));
}

inline size_t esize(int dtype) { return dtype == kF32 ? 4 : (dtype == kNone ? 0 : 2); }

// Runs r < W elements starting at i through the vector body, staged in zero-padded
// stack buffers: the head (peeling) and the tail see exactly the arithmetic of the body.
template <int G, int S, int O>
void staged(const AdamArgs& a, const Consts& c, size_t i, size_t r, __m256& bad) {
    alignas(32) float p[W] = {};
    alignas(32) unsigned char g[W * 4] = {}, m[W * 4] = {}, v[W * 4] = {}, o[W * 4] = {};
    const size_t gs = esize(G), ss = esize(S), os = esize(O);
    std::memcpy(p, a.param + i, r * 4);
    std::memcpy(g, static_cast<const unsigned char*>(a.grad) + i * gs, r * gs);
    std::memcpy(m, static_cast<const unsigned char*>(a.exp_avg) + i * ss, r * ss);
    std::memcpy(v, static_cast<const unsigned char*>(a.exp_avg_sq) + i * ss, r * ss);
    AdamArgs t = a;
    t.param = p; t.grad = g; t.exp_avg = m; t.exp_avg_sq = v; t.param_out = o;
    step8<G, S, O>(t, c, 0, bad);   // (zero padding: finite lanes)
    std::memcpy(a.param + i, p, r * 4);
    std::memcpy(static_cast<unsigned char*>(a.exp_avg) + i * ss, m, r * ss);
    std::memcpy(static_cast<unsigned char*>(a.exp_avg_sq) + i * ss, v, r * ss);
    if (os) std::memcpy(static_cast<unsigned char*>(a.param_out) + i * os, o, r * os);
}

template <int G, int S, int O>
bool kernel(const AdamArgs& a, size_t begin, size_t end) {
    const Consts c(a);
    __m256 bad = _mm256_setzero_ps();
    size_t i = begin;
    // Peel up to the next 32-byte boundary of param so the body's fp32 accesses do not
    // split cache lines.
    const size_t mis = (reinterpret_cast<uintptr_t>(a.param + i) & 31u) / sizeof(float);
    if (mis != 0 && (reinterpret_cast<uintptr_t>(a.param + i) & 3u) == 0 && end - i > W) {
        staged<G, S, O>(a, c, i, W - mis, bad);
        i += W - mis;
    }
    for (; i + 2 * W <= end; i += 2 * W) {
        step8<G, S, O>(a, c, i, bad);
        step8<G, S, O>(a, c, i + W, bad);
    }
    for (; i + W <= end; i += W) step8<G, S, O>(a, c, i, bad);
    if (i < end) staged<G, S, O>(a, c, i, end - i, bad);
    return _mm256_movemask_ps(bad) != 0;
}

struct Avx2Kernel {
    template <int G, int S, int O>
    static bool run(const AdamArgs& a, size_t begin, size_t end) { return kernel<G, S, O>(a, begin, end); }
};

}  // namespace

bool adam_range_avx2(const AdamArgs& a, size_t begin, size_t end) {
    return run_selected<Avx2Kernel>(a, begin, end);
}

void triad_range_avx2(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end) {
    const __m256 vs = _mm256_set1_ps(s);
    size_t i = begin;
    for (; i + W <= end; i += W) {
        const __m256 x = _mm256_mul_ps(_mm256_loadu_ps(g + i), vs);
        _mm256_storeu_ps(p + i, _mm256_add_ps(_mm256_loadu_ps(p + i), x));
        _mm256_storeu_ps(m + i, _mm256_add_ps(_mm256_loadu_ps(m + i), x));
        _mm256_storeu_ps(v + i, _mm256_add_ps(_mm256_loadu_ps(v + i), x));
    }
    triad_range_scalar(p, g, m, v, s, i, end);
}

}  // namespace infinity_adam
