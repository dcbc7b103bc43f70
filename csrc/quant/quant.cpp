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

// one block of src (len elements) into fp32 tmp; returns absmax; *bad: inf/NaN present.
// The absmax is taken on the bits (|x| as uint32 orders like the float, NaN above inf),
// which vectorizes where a float max reduction would not (NaN semantics).
inline float load_block(const void* src, int dtype, size_t off, size_t len, float* tmp,
                        bool* bad) {
    uint32_t mx = 0;
    if (dtype == kF32) {
        const uint32_t* p = static_cast<const uint32_t*>(src) + off;
        for (size_t i = 0; i < len; ++i) {
            const uint32_t u = p[i];
            std::memcpy(&tmp[i], &u, 4);
            const uint32_t a = u & 0x7fffffffu;
            mx = a > mx ? a : mx;
        }
    } else {
        const uint16_t* p = static_cast<const uint16_t*>(src) + off;
        for (size_t i = 0; i < len; ++i) {
            const uint32_t u = static_cast<uint32_t>(p[i]) << 16;
            std::memcpy(&tmp[i], &u, 4);
            const uint32_t a = u & 0x7fffffffu;
            mx = a > mx ? a : mx;
        }
    }
    *bad = mx >= 0x7f800000u;
    float amax;
    std::memcpy(&amax, &mx, 4);
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
    int8_t qtmp_small[4096];
    float* buf = tmp;
    int8_t* qtmp = qtmp_small;
    std::unique_ptr<float[]> big;
    std::unique_ptr<int8_t[]> qbig;
    if (block > 4096) {
        big.reset(new float[block]);
        qbig.reset(new int8_t[block]);
        buf = big.get();
        qtmp = qbig.get();
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
        // q = clamp(round_half_even(x / s)): |x / s| <= qmax (+1 ulp), so adding and
        // subtracting 1.5 * 2^23 rounds to the nearest integer, ties to even (the FPU's
        // default mode; no -ffast-math here, so the compiler keeps both operations)
        int8_t* qb = qtmp;
        if (bad) {
            for (size_t i = 0; i < len; ++i) qb[i] = 0;
        } else {
            const float magic = 12582912.f;
            for (size_t i = 0; i < len; ++i) {
                const float v = (buf[i] / s + magic) - magic;
                int iv = static_cast<int>(v);
                iv = iv < qmin ? qmin : iv;
                iv = iv > qmax ? qmax : iv;
                qb[i] = static_cast<int8_t>(iv);
            }
        }
        if (bits == 8) {
            std::memcpy(q8 + off, qb, len);
        } else {
            // off is a multiple of 8 (block % 8 == 0): whole words, a partial last one
            // (past the end: 0 bits, as pack_bits pads)
            uint32_t* o = q4 + off / 8;
            const size_t full = len / 8;
            for (size_t w = 0; w < full; ++w) {
                const int8_t* e = qb + 8 * w;
                uint32_t word = 0;
                for (int j = 0; j < 8; ++j)
                    word |= static_cast<uint32_t>(e[j] + 8) << (4 * j);
                o[w] = word;
            }
            if (len % 8) {
                uint32_t word = 0;
                for (size_t j = 0; j < len % 8; ++j)
                    word |= static_cast<uint32_t>(qb[8 * full + j] + 8) << (4 * j);
                o[full] = word;
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
    std::unique_ptr<float[]> tmp_own(new float[block]);
    float* tmp = tmp_own.get();
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
            float* x = tmp;                  // unpack + scale (vectorizes), then store
            for (size_t i = 0; i < len; ++i) {
                const int v = static_cast<int>((in[i >> 3] >> ((i & 7u) << 2)) & 0xfu) - 8;
                x[i] = static_cast<float>(v) * s;
            }
            if (out_dtype == kF32) {
                std::memcpy(o32 + off, x, len * 4);
            } else {
                for (size_t i = 0; i < len; ++i) o16[off + i] = f32_to_bf16(x[i]);
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
