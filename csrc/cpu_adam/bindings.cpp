// pybind11 face of the CPU Adam kernels: raw pointers (uintptr_t), element
// counts and dtype codes; no torch headers. Python (infinity/optim/functional.py)
// validates tensors before calling. Every call that touches memory releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <cmath>
#include <stdexcept>

#include "adam_kernel.h"
#include "dispatch.h"
#include "thread_pool.h"

namespace py = pybind11;
using namespace infinity_adam;

namespace {

bool adam_step(uintptr_t param, uintptr_t grad, uintptr_t exp_avg, uintptr_t exp_avg_sq,
               uintptr_t param_out, size_t n, int grad_dtype, int state_dtype, int out_dtype,
               double lr, double beta1, double beta2, double eps, double weight_decay,
               bool adamw, double step_size, double bc2_sqrt, double grad_scale) {
    if (grad_dtype < kF32 || grad_dtype > kF16) throw std::invalid_argument("bad grad dtype code");
    if (state_dtype != kF32 && state_dtype != kBF16) throw std::invalid_argument("bad state dtype code");
    if (out_dtype < kNone || out_dtype > kF16) throw std::invalid_argument("bad param_out dtype code");
    if (n && (!param || !grad || !exp_avg || !exp_avg_sq || (out_dtype != kNone && !param_out)))
        throw std::invalid_argument("null pointer");
    AdamArgs a;
    a.param = reinterpret_cast<float*>(param);
    a.grad = reinterpret_cast<const void*>(grad);
    a.exp_avg = reinterpret_cast<void*>(exp_avg);
    a.exp_avg_sq = reinterpret_cast<void*>(exp_avg_sq);
    a.param_out = out_dtype == kNone ? nullptr : reinterpret_cast<void*>(param_out);
    a.n = n;
    a.grad_dtype = grad_dtype;
    a.state_dtype = state_dtype;
    a.out_dtype = out_dtype;
    // Scalars rounded to float the way torch rounds its Python-double scalars.
    a.grad_scale = static_cast<float>(grad_scale);
    a.weight_decay = static_cast<float>(weight_decay);
    a.adamw = adamw;
    a.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
    a.beta1 = static_cast<float>(beta1);
    a.lerp_w = static_cast<float>(1.0 - beta1);
    a.lerp_small = std::fabs(a.lerp_w) < 0.5f;
    a.lerp_1mw = 1.0f - a.lerp_w;
    a.beta2 = static_cast<float>(beta2);
    a.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    a.bc2_sqrt = static_cast<float>(bc2_sqrt);
    a.eps = static_cast<float>(eps);
    a.neg_step_size = static_cast<float>(-step_size);
    const AdamRangeFn fn = adam_kernel();
    std::atomic<bool> bad{false};
    parallel_for(n, [&](size_t b, size_t e) {
        if (fn(a, b, e)) bad.store(true, std::memory_order_relaxed);
    });
    return !bad.load();
}

void triad(uintptr_t p, uintptr_t g, uintptr_t m, uintptr_t v, size_t n, double s) {
    float* pp = reinterpret_cast<float*>(p);
    const float* gp = reinterpret_cast<const float*>(g);
    float* mp = reinterpret_cast<float*>(m);
    float* vp = reinterpret_cast<float*>(v);
    const float sf = static_cast<float>(s);
    const TriadRangeFn fn = triad_kernel();
    parallel_for(n, [&](size_t b, size_t e) { fn(pp, gp, mp, vp, sf, b, e); });
}

}  // namespace

PYBIND11_MODULE(_cpu_adam, m) {
    m.doc() = "SIMD Adam/AdamW kernels over raw pointers (use infinity.optim, not this module)";
    m.attr("DTYPE_NONE") = static_cast<int>(kNone);
    m.attr("DTYPE_F32") = static_cast<int>(kF32);
    m.attr("DTYPE_BF16") = static_cast<int>(kBF16);
    m.attr("DTYPE_F16") = static_cast<int>(kF16);
    m.def("adam_step", &adam_step, py::call_guard<py::gil_scoped_release>(),
          py::arg("param"), py::arg("grad"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
          py::arg("param_out"), py::arg("n"), py::arg("grad_dtype"), py::arg("state_dtype"),
          py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("adamw"), py::arg("step_size"), py::arg("bc2_sqrt"),
          py::arg("grad_scale"),
          "One Adam/AdamW update of n elements in place (pointers validated by the caller); "
          "False when a result (master, exp_avg, exp_avg_sq, param_out) is not finite as stored.");
    m.def("triad", &triad, py::call_guard<py::gil_scoped_release>(),
          "Roofline reference: p+=s*g; m+=s*g; v+=s*g over n fp32 elements (same bytes as an fp32 Adam step).");
    m.def("set_num_threads", [](int n) {
        if (n < 1) throw std::invalid_argument("thread count must be >= 1, got " + std::to_string(n));
        py::gil_scoped_release r;
        set_num_threads(n);
    });
    m.def("get_num_threads", &get_num_threads);
    m.def("default_num_threads", &default_num_threads);
    m.def("simd_level", [] { return std::string(simd_name(current_simd())); });
    m.def("best_simd", [] { return std::string(simd_name(best_simd())); });
    m.def("cpu_supports", [](const std::string& name) {
        const int l = simd_from_name(name);
        if (l < 0) throw std::invalid_argument("unknown SIMD level '" + name + "' (expected scalar, avx2 or avx512)");
        return cpu_supports(l);
    });
    m.def("select_simd", [](const std::string& name) {
        const int l = simd_from_name(name);
        if (l < 0) throw std::invalid_argument("unknown SIMD level '" + name + "' (expected scalar, avx2 or avx512)");
        select_simd(l);
    });
    m.def("cpu_features", &cpu_features);
}
