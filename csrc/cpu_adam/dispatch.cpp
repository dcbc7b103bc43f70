// Run-time kernel choice: the widest ISA this CPU (and OS, via XGETBV, which
// __builtin_cpu_supports checks) supports, unless select_simd() picks another.
// This file is compiled for the baseline ISA so it is safe on any x86-64.
#include "dispatch.h"

#include <atomic>
#include <stdexcept>

namespace infinity_adam {
namespace {

std::atomic<int> g_level{-1};

bool has(const char* f) {
    // __builtin_cpu_supports needs a literal: map the names we use.
    const std::string s(f);
    if (s == "avx2") return __builtin_cpu_supports("avx2");
    if (s == "fma") return __builtin_cpu_supports("fma");
    if (s == "f16c") return __builtin_cpu_supports("f16c");
    if (s == "avx512f") return __builtin_cpu_supports("avx512f");
    if (s == "avx512bw") return __builtin_cpu_supports("avx512bw");
    if (s == "avx512vl") return __builtin_cpu_supports("avx512vl");
    if (s == "avx512dq") return __builtin_cpu_supports("avx512dq");
    if (s == "avx512bf16") return __builtin_cpu_supports("avx512bf16");
    return false;
}

const char* const kAVX2Needs[] = {"avx2", "fma", "f16c"};
const char* const kAVX512Needs[] = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"};

}  // namespace

const char* simd_name(int level) {
    switch (level) {
        case kAVX512: return "avx512";
        case kAVX2: return "avx2";
        default: return "scalar";
    }
}

int simd_from_name(const std::string& name) {
    if (name == "scalar") return kScalar;
    if (name == "avx2") return kAVX2;
    if (name == "avx512") return kAVX512;
    return -1;
}

bool cpu_supports(int level) {
    __builtin_cpu_init();
    if (level == kScalar) return true;
    if (level == kAVX2) {
        for (const char* f : kAVX2Needs) if (!has(f)) return false;
        return true;
    }
    if (level == kAVX512) {
        for (const char* f : kAVX512Needs) if (!has(f)) return false;
        return true;
    }
    return false;
}

int best_simd() {
    if (cpu_supports(kAVX512)) return kAVX512;
    if (cpu_supports(kAVX2)) return kAVX2;
    return kScalar;
}

int current_simd() {
    int l = g_level.load(std::memory_order_acquire);
    if (l < 0) {
        l = best_simd();
        g_level.store(l, std::memory_order_release);
    }
    return l;
}

void select_simd(int level) {
    if (level < kScalar || level > kAVX512)
        throw std::invalid_argument("unknown SIMD level " + std::to_string(level));
    if (!cpu_supports(level))
        throw std::invalid_argument(std::string("this CPU (or OS) lacks the instructions the ") +
                                    simd_name(level) + " Adam kernel needs");
    g_level.store(level, std::memory_order_release);
}

std::vector<std::pair<std::string, bool>> cpu_features() {
    __builtin_cpu_init();
    std::vector<std::pair<std::string, bool>> out;
    for (const char* f : {"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512bf16"})
        out.emplace_back(f, has(f));
    return out;
}

AdamRangeFn adam_kernel() {
    switch (current_simd()) {
        case kAVX512: return adam_range_avx512;
        case kAVX2: return adam_range_avx2;
        default: return adam_range_scalar;
    }
}

TriadRangeFn triad_kernel() {
    switch (current_simd()) {
        case kAVX512: return triad_range_avx512;
        case kAVX2: return triad_range_avx2;
        default: return triad_range_scalar;
    }
}

}  // namespace infinity_adam
