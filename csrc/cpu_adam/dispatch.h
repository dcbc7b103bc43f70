// Run-time choice of the Adam kernel from CPUID (see dispatch.cpp).
#pragma once

#include <string>
#include <vector>
#include <utility>

#include "adam_kernel.h"

namespace infinity_adam {

enum SimdLevel : int { kScalar = 0, kAVX2 = 1, kAVX512 = 2 };

const char* simd_name(int level);
int simd_from_name(const std::string& name);  // -1 if unknown
bool cpu_supports(int level);                   // CPU and OS support every flag the kernel needs
int best_simd();
int current_simd();
void select_simd(int level);                   // throws std::invalid_argument if unsupported
std::vector<std::pair<std::string, bool>> cpu_features();

AdamRangeFn adam_kernel();
using TriadRangeFn = void (*)(float*, const float*, float*, float*, float, size_t, size_t);
TriadRangeFn triad_kernel();

}  // namespace infinity_adam
