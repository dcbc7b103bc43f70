// Adam / AdamW kernel interface shared by the per-ISA implementations.
//
// Every kernel is stateless: it updates `n` elements in place from raw
// pointers. The Python side owns step counts and computes the per-step
// scalars (bias corrections) in double precision exactly as torch does; the
// kernels reproduce torch's `_single_tensor_adam` arithmetic order:
//
//   g  = grad * grad_scale
//   if L2:    g = g + weight_decay * p
//   if AdamW: p = p * (1 - lr * weight_decay)
//   m  = lerp(m, g, 1 - beta1)                   (torch's lerp formula)
//   v  = v * beta2 + ((1 - beta2) * g) * g
//   d  = sqrt(v) / sqrt(bias_correction2) + eps
//   p  = p + (-step_size) * (m / d)
//
// with separate multiplies and adds (no FMA contraction), so the scalar,
// AVX2 and AVX-512 paths give bit-identical fp32 results.
//
// Every kernel also reports whether any result is non-finite as stored: the fp32
// master, exp_avg and exp_avg_sq (inf/NaN, or beyond what a bf16 state rounds to
// finitely), and param_out (beyond its dtype's range: an fp16 copy of a master above
// 65504 rounds to inf). The caller (infinity/optim/offload_step.py) turns that into a
// rolled-back or failed update instead of silently NaN weights.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cmath>

namespace infinity_adam {

// dtype codes shared with Python (infinity/optim/functional.py)
enum DType : int { kNone = 0, kF32 = 1, kBF16 = 2, kF16 = 3 };

struct AdamArgs {
    float* param = nullptr;      // fp32 master, updated in place
    const void* grad = nullptr;  // fp32 / bf16 / fp16
    void* exp_avg = nullptr;     // fp32 / bf16
    void* exp_avg_sq = nullptr;  // fp32 / bf16
    void* param_out = nullptr;   // nullptr or fp32 / bf16 / fp16
    size_t n = 0;
    int grad_dtype = kF32;
    int state_dtype = kF32;
    int out_dtype = kNone;
    // per-step scalars, already rounded to float the way torch does
    float grad_scale = 1.f;
    float weight_decay = 0.f;  // 0 disables both forms of decay
    bool adamw = true;
    float decay_factor = 1.f;  // 1 - lr * weight_decay (AdamW)
    float beta1 = 0.9f;        // unused except for documentation
    float lerp_w = 0.1f;       // 1 - beta1
    bool lerp_small = true;    // lerp weight < 0.5 (torch's branch)
    float lerp_1mw = 0.9f;     // 1 - lerp_w, computed in float as torch does
    float beta2 = 0.999f;
    float one_minus_beta2 = 0.001f;
    float bc2_sqrt = 1.f;      // sqrt(1 - beta2^step) (1 without bias correction)
    float eps = 1e-8f;
    float neg_step_size = -1e-3f;  // -(lr / (1 - beta1^step))
};

// Kernels: update elements [begin, end) of `a`; true when a result is non-finite
// as stored (see above; the update is written anyway).
using AdamRangeFn = bool (*)(const AdamArgs& a, size_t begin, size_t end);
bool adam_range_scalar(const AdamArgs& a, size_t begin, size_t end);
bool adam_range_avx2(const AdamArgs& a, size_t begin, size_t end);
bool adam_range_avx512(const AdamArgs& a, size_t begin, size_t end);

// The smallest magnitude a value of dtype D cannot hold finitely (round to nearest
// even): fp32 (and kNone) inf; bf16 0x1.FEp127 + half an ulp = 0x1.FFp127 (ties go to
// the odd 0x7F7F's even neighbour, inf); fp16 65520 (halfway between 65504 and 65536).
// A value x is finite as stored iff |x| < limit (false for NaN too).
template <int D>
constexpr float store_limit() {
    if constexpr (D == kBF16) return 0x1.FFp127f;
    else if constexpr (D == kF16) return 65520.0f;
    else return __builtin_inff();
}

// The limit of the master (fp32) and its low-precision copy, whichever is smaller.
template <int O>
constexpr float param_limit() { return O == kBF16 || O == kF16 ? store_limit<O>() : store_limit<kF32>(); }

// Roofline reference: the same memory traffic as the fp32 Adam step
// (read p, g, m, v; write p, m, v) with trivial arithmetic.
void triad_range_scalar(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end);
void triad_range_avx2(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end);
void triad_range_avx512(float* p, const float* g, float* m, float* v, float s, size_t begin, size_t end);

// ---- scalar conversions (also used for reference tails) -------------------

static inline uint32_t f32_bits(float f) { uint32_t u; std::memcpy(&u, &f, 4); return u; }
static inline float bits_f32(uint32_t u) { float f; std::memcpy(&f, &u, 4); return f; }

static inline float bf16_to_f32(uint16_t h) { return bits_f32(static_cast<uint32_t>(h) << 16); }

// Round to nearest even; NaN stays NaN (quiet bit set, sign and top payload kept).
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u = f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// IEEE binary16 <-> binary32, exact for all inputs (subnormals, inf, NaN), round
// to nearest even; the bit tricks of Maratyszcza's FP16 library (also used by c10::Half).
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = static_cast<uint32_t>(h) << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = bits_f32((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = bits_f32((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denorm_cutoff = 1u << 27;
    const uint32_t result = sign | (two_w < denorm_cutoff ? f32_bits(denormalized) : f32_bits(normalized));
    return bits_f32(result);
}

static inline uint16_t f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    float base = (std::fabs(f) * scale_to_inf) * scale_to_zero;
    const uint32_t w = f32_bits(f);
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    if (bias < 0x71000000u) bias = 0x71000000u;
    base = bits_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    if (shl1_w > 0xFF000000u) {  // NaN: keep sign and top payload bits, set quiet bit (as F16C does)
        return static_cast<uint16_t>((sign >> 16) | 0x7E00u | ((w >> 13) & 0x03FFu));
    }
    return static_cast<uint16_t>((sign >> 16) | nonsign);
}

}  // namespace infinity_adam
