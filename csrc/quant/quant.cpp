// Blockwise symmetric quantization for ZeRO++ (qwZ int8, qgZ int4 packed): one pass over
// the input per block (absmax, then quantize while the block is in cache), no torch
// headers: raw pointers, element counts and dtype codes; Python
// (infinity/quant/kernel.py) validates the tensors.  The numerics are those of
// infinity/quant/blockwise.py bit for bit:
//   s = absmax / qmax (fp32), 1 for an all-zero block, at least FLT_MIN;
//   q = clamp(nearbyint(x / s), qmin, qmax)  (round half to even, as torch.round);
//   a block holding inf/NaN: s = NaN, q = 0 (dequantizes to NaN).
// int4 is packed 8 per uint32 word, element j at bits 4j, stored with offset 8 (the
// layout of blockwise.pack_bits / compressed-tensors pack-quantized).
// Written to auto-vectorize at -O3; the GIL is released around every call.
#include <pybind11/pybind11.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace py = pybind11;

namespace {

enum Dtype { kF32 = 0, kBF16 = 1 };

inline float bf16_to_f32(uint16_t h) {
    uint32_t u = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}

inline uint16_t f32_to_bf16(float f) {           // round to nearest even, NaN kept
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<uint16_t>(u >> 16);
}

// one block of src (len elements) into fp32 tmp; returns absmax (NaN/inf if present)
inline float load_block(const void* src, int dtype, size_t off, size_t len, float* tmp,
                        bool* bad) {
    float amax = 0.f;
    bool nonfinite = false;
    if (dtype == kF32) {
        const float* p = static_cast<const float*>(src) + off;
        for (size_t i = 0; i < len; ++i) {
            tmp[i] = p[i];
        }
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(src) + off;
        for (size_t i = 0; i < len; ++i) {
            tmp[i] = bf16_to_f32(p[i]);
        }
    }
    for (size_t i = 0; i < len; ++i) {
        float a = std::fabs(tmp[i]);
        amax = a > amax ? a : amax;
    }
    for (size_t i = 0; i < len; ++i) {
        nonfinite |= !(std::fabs(tmp[i]) <= FLT_MAX);
    }
    *bad = nonfinite;
    return amax;
}

inline float block_scale(float amax, int qmax, bool bad) {
    if (bad) return NAN;
    if (amax == 0.f) return 1.f;
    float s = amax / static_cast<float>(qmax);
    return s < FLT_MIN ? FLT_MIN : s;
}

void quantize(uintptr_t src, int dtype, size_t n, size_t block, int bits, uintptr_t out,
              uintptr_t scales) {
    if (dtype != kF32 && dtype != kBF16) throw std::invalid_argument("quantize: bad dtype code");
    if (bits != 8 && bits != 4) throw std::invalid_argument("quantize: bits must be 8 or 4");
    if (block == 0 || block > 65536) throw std::invalid_argument("quantize: bad block size");
    if (bits == 4 && block % 8) throw std::invalid_argument("quantize: int4 blocks must be a multiple of 8");
    if (n && (!src || !out || !scales)) throw std::invalid_argument("quantize: null pointer");
    const int qmax = (1 << (bits - 1)) - 1, qmin = -qmax - 1;
    float* sc = reinterpret_cast<float*>(scales);
    py::gil_scoped_release nogil;
    float tmp[4096];
    float* buf = tmp;
    std::unique_ptr<float[]> big;
    if (block > 4096) {
        big.reset(new float[block]);
        buf = big.get();
    }
    int8_t* q8 = reinterpret_cast<int8_t*>(out);
    uint32_t* q4 = reinterpret_cast<uint32_t*>(out);
    const size_t nb = (n + block - 1) / block;
    for (size_t b = 0; b < nb; ++b) {
        const size_t off = b * block, len = off + block <= n ? block : n - off;
        bool bad = false;
        const float amax = load_block(reinterpret_cast<const void*>(src), dtype, off, len, buf, &bad);
        const float s = block_scale(amax, qmax, bad);
        sc[b] = s;
        const float div = bad ? 1.f : s;
        if (bits == 8) {
            int8_t* o = q8 + off;
            for (size_t i = 0; i < len; ++i) {
                float v = bad ? 0.f : std::nearbyint(buf[i] / div);
                v = v < qmin ? qmin : (v > qmax ? qmax : v);
                o[i] = static_cast<int8_t>(v);
            }
        } else {
            // off is a multiple of 8 (block % 8 == 0): whole words, a partial last one
            uint32_t* o = q4 + off / 8;
            const size_t words = (len + 7) / 8;
            for (size_t w = 0; w < words; ++w) {
                uint32_t word = 0;
                for (size_t j = 0; j < 8; ++j) {
                    const size_t i = w * 8 + j;
                    // past the end: 0 bits (as pack_bits pads); a bad block: 0 (+ offset)
                    uint32_t u = i < len ? 8u : 0u;
                    if (i < len && !bad) {
                        float v = std::nearbyint(buf[i] / div);
                        v = v < qmin ? qmin : (v > qmax ? qmax : v);
                        u = static_cast<uint32_t>(static_cast<int>(v) + 8);
                    }
                    word |= u << (4 * j);
                }
                o[w] = word;
            }
        }
    }
}

void dequantize(uintptr_t q, size_t n, size_t block, int bits, uintptr_t scales,
                uintptr_t out, int out_dtype) {
    if (out_dtype != kF32 && out_dtype != kBF16) throw std::invalid_argument("dequantize: bad dtype code");
    if (bits != 8 && bits != 4) throw std::invalid_argument("dequantize: bits must be 8 or 4");
    if (block == 0 || (bits == 4 && block % 8)) throw std::invalid_argument("dequantize: bad block size");
    if (n && (!q || !out || !scales)) throw std::invalid_argument("dequantize: null pointer");
    const float* sc = reinterpret_cast<const float*>(scales);
    py::gil_scoped_release nogil;
    const int8_t* q8 = reinterpret_cast<const int8_t*>(q);
    const uint32_t* q4 = reinterpret_cast<const uint32_t*>(q);
    float* o32 = reinterpret_cast<float*>(out);
    uint16_t* o16 = reinterpret_cast<uint16_t*>(out);
    const size_t nb = (n + block - 1) / block;
    for (size_t b = 0; b < nb; ++b) {
        const size_t off = b * block, len = off + block <= n ? block : n - off;
        const float s = sc[b];
        if (bits == 8) {
            const int8_t* in = q8 + off;
            if (out_dtype == kF32) {
                for (size_t i = 0; i < len; ++i) o32[off + i] = static_cast<float>(in[i]) * s;
            } else {
                for (size_t i = 0; i < len; ++i) o16[off + i] = f32_to_bf16(static_cast<float>(in[i]) * s);
            }
        } else {
            const uint32_t* in = q4 + off / 8;
            for (size_t i = 0; i < len; ++i) {
                const int v = static_cast<int>((in[i / 8] >> (4 * (i % 8))) & 0xfu) - 8;
                const float x = static_cast<float>(v) * s;
                if (out_dtype == kF32) o32[off + i] = x;
                else o16[off + i] = f32_to_bf16(x);
            }
        }
    }
}

}  // namespace

PYBIND11_MODULE(_quant, m) {
    m.doc() = "blockwise symmetric int8 / packed int4 quantization (ZeRO++), raw pointers";
    m.def("quantize", &quantize, py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("block"),
          py::arg("bits"), py::arg("out"), py::arg("scales"));
    m.def("dequantize", &dequantize, py::arg("q"), py::arg("n"), py::arg("block"), py::arg("bits"),
          py::arg("scales"), py::arg("out"), py::arg("out_dtype"));
    m.attr("F32") = static_cast<int>(kF32);
    m.attr("BF16") = static_cast<int>(kBF16);
}
