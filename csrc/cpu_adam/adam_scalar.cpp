// Portable scalar Adam/AdamW kernel (baseline x86-64, no ISA flags).
// The reference the SIMD paths must match bit for bit in fp32.
#include "adam_kernel.h"
#include "adam_select.h"

// No FMA contraction: every ISA must round exactly like the scalar reference (and torch).
#pragma GCC optimize("fp-contract=off")

namespace infinity_adam {
namespace {

template <int G>
inline float load_grad(const void* p, size_t i) {
    if constexpr (G == kF32) return static_cast<const float*>(p)[i];
    else if constexpr (G == kBF16) return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
    else return f16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int S>
inline float load_state(const void* p, size_t i) {
    if constexpr (S == kF32) return static_cast<const float*>(p)[i];
    else return bf16_to_f32(static_cast<const uint16_t*>(p)[i]);
}

template <int S>
inline void store_state(void* p, size_t i, float x) {
    if constexpr (S == kF32) static_cast<float*>(p)[i] = x;
    else static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
}

template <int O>
inline void store_out(void* p, size_t i, float x) {
    if constexpr (O == kF32) static_cast<float*>(p)[i] = x;
    else if constexpr (O == kBF16) static_cast<uint16_t*>(p)[i] = f32_to_bf16(x);
    else if constexpr (O == kF16) static_cast<uint16_t*>(p)[i] = f32_to_f16(x);
}

template <int G, int S, int O>
bool kernel(const AdamArgs& a, size_t begin, size_t end) {
    const bool l2 = !a.adamw && a.weight_decay != 0.f;
    const bool decoupled = a.adamw && a.weight_decay != 0.f;
    constexpr float lp = param_limit<O>(), ls = store_limit<S>();
    bool bad = false;
    for (size_t i = begin; i < end; ++i) {
        float p = a.param[i];
        float g = load_grad<G>(a.grad, i) * a.grad_scale;
        if (l2) g = g + a.weight_decay * p;
        if (decoupled) p = p * a.decay_factor;
        float m = load_state<S>(a.exp_avg, i);
        float v = load_state<S>(a.exp_avg_sq, i);
        const float diff = g - m;
        m = a.lerp_small ? m + a.lerp_w * diff : g - diff * a.lerp_1mw;
        v = v * a.beta2 + (a.one_minus_beta2 * g) * g;
        const float d = std::sqrt(v) / a.bc2_sqrt + a.eps;
        p = p + a.neg_step_size * (m / d);
        a.param[i] = p;
        store_state<S>(a.exp_avg, i, m);
        store_state<S>(a.exp_avg_sq, i, v);
        store_out<O>(a.param_out, i, p);
        bad |= !(std::fabs(p) < lp) | !(std::fabs(m) < ls) | !(std::fabs(v) < ls);
    }
    return bad;
}

struct ScalarKernel {
    template <int G, int S, int O>
    static bool run(const AdamArgs& a, size_t begin, size_t end) { return kernel<G, S, O>(a, begin, end); }
};

}  // namespace

bool adam_range_scalar(const AdamArgs& a, size_t begin, size_t end) {
    return run_selected<ScalarKernel>(a, begin, end);
}

void triad_range_scalar(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end) {
    for (size_t i = begin; i < end; ++i) {
        const float x = g[i] * s;
        p[i] = p[i] + x;
        m[i] = m[i] + x;
        v[i] = v[i] + x;
    }
}

}  // namespace infinity_adam
