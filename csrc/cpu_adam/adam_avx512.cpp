// AVX-512 (F/BW/VL/DQ + F16C) Adam/AdamW kernel: 16 lanes, masked tails.
// Loads and stores are unaligned, so any element offset works; a masked head step
// first brings param to a 64-byte boundary (peeling).
// Compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c (setup.py);
// only called after CPUID says the CPU has these (dispatch.cpp).
#include <immintrin.h>

// GCC 12 headers trip -Wmaybe-uninitialized inside _mm512_cvtepi32_epi16 (a known false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#include "adam_kernel.h"
#include "adam_select.h"

// No FMA contraction: every ISA must round exactly like the scalar reference (and torch).
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {
namespace {

constexpr size_t W = 16;

inline __m512 bf16x16_to_f32(__m256i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

// Round to nearest even, NaN -> quiet NaN with sign and top payload kept.
inline __m256i f32x16_to_bf16(__m512 x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    const __m512i rounded = _mm512_srli_epi32(
        _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x0040));
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

template <int G, bool Tail>
inline __m512 load_grad(const void* p, size_t i, __mmask16 k) {
    if constexpr (G == kF32) {
        const float* f = static_cast<const float*>(p) + i;
        return Tail ? _mm512_maskz_loadu_ps(k, f) : _mm512_loadu_ps(f);
    } else {
        const uint16_t* h = static_cast<const uint16_t*>(p) + i;
        const __m256i v = Tail ? _mm256_maskz_loadu_epi16(k, h)
                               : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h));
        if constexpr (G == kBF16) return bf16x16_to_f32(v);
        else return _mm512_cvtph_ps(v);
    }
}

template <int S, bool Tail>
inline __m512 load_state(const void* p, size_t i, __mmask16 k) {
    if constexpr (S == kF32) {
        const float* f = static_cast<const float*>(p) + i;
        return Tail ? _mm512_maskz_loadu_ps(k, f) : _mm512_loadu_ps(f);
    } else {
        const uint16_t* h = static_cast<const uint16_t*>(p) + i;
        return bf16x16_to_f32(Tail ? _mm256_maskz_loadu_epi16(k, h)
                                   : _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h)));
    }
}

template <bool Tail>
inline void store_f32(float* f, __m512 x, __mmask16 k) {
    if (Tail) _mm512_mask_storeu_ps(f, k, x);
    else _mm512_storeu_ps(f, x);
}

template <bool Tail>
inline void store_h16(void* p, size_t i, __m256i h, __mmask16 k) {
    uint16_t* d = static_cast<uint16_t*>(p) + i;
    if (Tail) _mm256_mask_storeu_epi16(d, k, h);
    else _mm256_storeu_si256(reinterpret_cast<__m256i*>(d), h);
}

template <int S, bool Tail>
inline void store_state(void* p, size_t i, __m512 x, __mmask16 k) {
    if constexpr (S == kF32) store_f32<Tail>(static_cast<float*>(p) + i, x, k);
    else store_h16<Tail>(p, i, f32x16_to_bf16(x), k);
}

template <int O, bool Tail>
inline void store_out(void* p, size_t i, __m512 x, __mmask16 k) {
    if constexpr (O == kF32) store_f32<Tail>(static_cast<float*>(p) + i, x, k);
    else if constexpr (O == kBF16) store_h16<Tail>(p, i, f32x16_to_bf16(x), k);
    else if constexpr (O == kF16)
        store_h16<Tail>(p, i, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC), k);
}

struct Consts {
    __m512 grad_scale, wd, decay, lerp_w, lerp_1mw, beta2, omb2, bc2s, eps, nss;
    bool l2, decoupled, lerp_small;
    explicit Consts(const AdamArgs& a)
        : grad_scale(_mm512_set1_ps(a.grad_scale)), wd(_mm512_set1_ps(a.weight_decay)),
          decay(_mm512_set1_ps(a.decay_factor)), lerp_w(_mm512_set1_ps(a.lerp_w)),
          lerp_1mw(_mm512_set1_ps(a.lerp_1mw)), beta2(_mm512_set1_ps(a.beta2)),
          omb2(_mm512_set1_ps(a.one_minus_beta2)), bc2s(_mm512_set1_ps(a.bc2_sqrt)),
          eps(_mm512_set1_ps(a.eps)), nss(_mm512_set1_ps(a.neg_step_size)),
          l2(!a.adamw && a.weight_decay != 0.f), decoupled(a.adamw && a.weight_decay != 0.f),
          lerp_small(a.lerp_small) {}
};

// Lanes of k whose |x| is not below lim (inf/NaN, or beyond the stored dtype's range).
inline __mmask16 not_below(__mmask16 k, __m512 x, float lim) {
    return _mm512_mask_cmp_ps_mask(k, _mm512_abs_ps(x), _mm512_set1_ps(lim), _CMP_NLT_UQ);
}

template <int G, int S, int O, bool Tail>
inline void step16(const AdamArgs& a, const Consts& c, size_t i, __mmask16 k, __mmask16& bad) {
    float* pp = a.param + i;
    __m512 p = Tail ? _mm512_maskz_loadu_ps(k, pp) : _mm512_loadu_ps(pp);
    __m512 g = _mm512_mul_ps(load_grad<G, Tail>(a.grad, i, k), c.grad_scale);
    if (c.l2) g = _mm512_add_ps(g, _mm512_mul_ps(c.wd, p));
    if (c.decoupled) p = _mm512_mul_ps(p, c.decay);
    __m512 m = load_state<S, Tail>(a.exp_avg, i, k);
    __m512 v = load_state<S, Tail>(a.exp_avg_sq, i, k);
    const __m512 diff = _mm512_sub_ps(g, m);
    m = c.lerp_small ? _mm512_add_ps(m, _mm512_mul_ps(c.lerp_w, diff))
                     : _mm512_sub_ps(g, _mm512_mul_ps(diff, c.lerp_1mw));
    v = _mm512_add_ps(_mm512_mul_ps(v, c.beta2), _mm512_mul_ps(_mm512_mul_ps(c.omb2, g), g));
    const __m512 d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), c.bc2s), c.eps);
    p = _mm512_add_ps(p, _mm512_mul_ps(c.nss, _mm512_div_ps(m, d)));
    store_f32<Tail>(pp, p, k);
    store_state<S, Tail>(a.exp_avg, i, m, k);
    store_state<S, Tail>(a.exp_avg_sq, i, v, k);
    store_out<O, Tail>(a.param_out, i, p, k);
    bad |= not_below(k, p, param_limit<O>()) | not_below(k, m, store_limit<S>()) |
           not_below(k, v, store_limit<S>());
}

template <int G, int S, int O>
bool kernel(const AdamArgs& a, size_t begin, size_t end) {
    const Consts c(a);
    __mmask16 bad = 0;
    size_t i = begin;
    // Peel: one masked step up to the next 64-byte boundary of param (the widest
    // stream), so the main loop's fp32 loads/stores do not split cache lines.
    const size_t mis = (reinterpret_cast<uintptr_t>(a.param + i) & 63u) / sizeof(float);
    if (mis != 0 && (reinterpret_cast<uintptr_t>(a.param + i) & 3u) == 0 && end - i > W) {
        const size_t head = W - mis;
        step16<G, S, O, true>(a, c, i, static_cast<__mmask16>((1u << head) - 1u), bad);
        i += head;
    }
    for (; i + 2 * W <= end; i += 2 * W) {
        step16<G, S, O, false>(a, c, i, 0xffff, bad);
        step16<G, S, O, false>(a, c, i + W, 0xffff, bad);
    }
    for (; i + W <= end; i += W) step16<G, S, O, false>(a, c, i, 0xffff, bad);
    if (i < end) {
        const __mmask16 k = static_cast<__mmask16>((1u << (end - i)) - 1u);
        step16<G, S, O, true>(a, c, i, k, bad);
    }
    return bad != 0;
}

struct Avx512Kernel {
    template <int G, int S, int O>
    static bool run(const AdamArgs& a, size_t begin, size_t end) { return kernel<G, S, O>(a, begin, end); }
};

}  // namespace

bool adam_range_avx512(const AdamArgs& a, size_t begin, size_t end) {
    return run_selected<Avx512Kernel>(a, begin, end);
}

void triad_range_avx512(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end) {
    const __m512 vs = _mm512_set1_ps(s);
    size_t i = begin;
    for (; i + W <= end; i += W) {
        const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(g + i), vs);
        _mm512_storeu_ps(p + i, _mm512_add_ps(_mm512_loadu_ps(p + i), x));
        _mm512_storeu_ps(m + i, _mm512_add_ps(_mm512_loadu_ps(m + i), x));
        _mm512_storeu_ps(v + i, _mm512_add_ps(_mm512_loadu_ps(v + i), x));
    }
    triad_range_scalar(p, g, m, v, s, i, end);
}

}  // namespace infinity_adam
