// Persistent worker pool for the CPU Adam kernels.
//
// One process-wide pool; `parallel_for` splits [0, n) into chunks (boundaries
// on 64-element multiples so two threads never write the same cache line) that
// the workers and the calling thread take from a shared counter. Calls are serialized by a mutex, so the kernels may be invoked
// from any number of Python threads at once; small ranges run inline on the
// caller without touching the pool. fork() is handled: the child starts a
// fresh pool on first use.
#pragma once

#include <cstddef>
#include <functional>

namespace infinity_adam {

// fn(begin, end) is called once per non-empty range.
void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn);

// Number of threads used by parallel_for (>= 1). Default: the number of CPUs
// in this process's affinity mask.
int get_num_threads();
void set_num_threads(int n);  // n >= 1; joins the old workers, spawns lazily
int default_num_threads();

}  // namespace infinity_adam
