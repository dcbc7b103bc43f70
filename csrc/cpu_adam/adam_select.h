// Picks one ISA's Adam kernel instantiation for the dtypes of a call; shared by
// adam_scalar.cpp, adam_avx2.cpp and adam_avx512.cpp.
//
// `K` is a struct defined in the ISA file's anonymous namespace with
//   template <int G, int S, int O> static bool run(const AdamArgs&, size_t, size_t);
// (G: grad dtype, S: state dtype, O: low-precision output dtype or kNone). Because
// K has internal linkage, every instantiation below is private to that file and
// compiled with that file's ISA flags: no AVX-512 code can be picked by the linker
// for another file's copy.
#pragma once

#include "adam_kernel.h"

namespace infinity_adam {

template <class K, int G, int S>
AdamRangeFn select_out(int o) {
    switch (o) {
        case kF32: return &K::template run<G, S, kF32>;
        case kBF16: return &K::template run<G, S, kBF16>;
        case kF16: return &K::template run<G, S, kF16>;
        default: return &K::template run<G, S, kNone>;
    }
}

template <class K, int G>
AdamRangeFn select_state(int s, int o) {
    return s == kBF16 ? select_out<K, G, kBF16>(o) : select_out<K, G, kF32>(o);
}

// Run K's kernel for a.grad_dtype / a.state_dtype / a.out_dtype over [begin, end);
// true when a result is non-finite (adam_kernel.h).
template <class K>
bool run_selected(const AdamArgs& a, size_t begin, size_t end) {
    AdamRangeFn fn;
    switch (a.grad_dtype) {
        case kBF16: fn = select_state<K, kBF16>(a.state_dtype, a.out_dtype); break;
        case kF16: fn = select_state<K, kF16>(a.state_dtype, a.out_dtype); break;
        default: fn = select_state<K, kF32>(a.state_dtype, a.out_dtype); break;
    }
    return fn(a, begin, end);
}

}  // namespace infinity_adam
