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
// NF4 (QLoRA's 4-bit NormalFloat, bitsandbytes' numerics; infinity/quant/nf4.py): see
// nf4_quantize below.
// Written to auto-vectorize at -O3; the GIL is released around every call.
#include <pybind11/pybind11.h>

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>

namespace py = pybind11;

static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__,
              "the int4 packing writes the nibbles of a 32-bit word byte by byte");

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

// The block loops, built for AVX2 and the baseline and picked at load time (GCC
// function multi-versioning): the baseline SSE2 build cannot vectorize the unsigned max
// and the int clamps, AVX2 does (several times faster, the same results bit for bit).
__attribute__((target_clones("avx2", "default")))
void quantize_impl(uintptr_t src, int dtype, size_t n, size_t block, int bits, uintptr_t out,
                   uintptr_t scales, int qmin, int qmax) {
    float* sc = reinterpret_cast<float*>(scales);
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
            // element j of a 32-bit word sits in bits 4j..4j+3: on a little-endian host
            // that is byte j/2, low nibble first, so pairs pack byte by byte (vectorizes);
            // the unused nibbles of a last partial word stay zero
            uint8_t* ob = reinterpret_cast<uint8_t*>(q4 + off / 8);
            const size_t pairs = len / 2;
            for (size_t k = 0; k < pairs; ++k)
                ob[k] = static_cast<uint8_t>((qb[2 * k] + 8) | ((qb[2 * k + 1] + 8) << 4));
            size_t used = pairs;
            if (len % 2) ob[used++] = static_cast<uint8_t>(qb[len - 1] + 8);
            for (size_t k = used; k < (len + 7) / 8 * 4; ++k) ob[k] = 0;
        }
    }
}

void quantize(uintptr_t src, int dtype, size_t n, size_t block, int bits, uintptr_t out,
              uintptr_t scales) {
    if (dtype != kF32 && dtype != kBF16) throw std::invalid_argument("quantize: bad dtype code");
    if (bits != 8 && bits != 4) throw std::invalid_argument("quantize: bits must be 8 or 4");
    if (block == 0 || block > 65536) throw std::invalid_argument("quantize: bad block size");
    if (bits == 4 && block % 8) throw std::invalid_argument("quantize: int4 blocks must be a multiple of 8");
    if (n && (!src || !out || !scales)) throw std::invalid_argument("quantize: null pointer");
    const int qmax = (1 << (bits - 1)) - 1, qmin = -qmax - 1;
    py::gil_scoped_release nogil;
    quantize_impl(src, dtype, n, block, bits, out, scales, qmin, qmax);
}

__attribute__((target_clones("avx2", "default")))
void dequantize_impl(uintptr_t q, size_t n, size_t block, int bits, uintptr_t scales,
                     uintptr_t out, int out_dtype) {
    const float* sc = reinterpret_cast<const float*>(scales);
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
            const uint8_t* in = reinterpret_cast<const uint8_t*>(q4 + off / 8);
            float* x = tmp;                  // unpack + scale (vectorizes), then store
            const size_t pairs = len / 2;    // (byte k: elements 2k, 2k+1; see quantize)
            for (size_t k = 0; k < pairs; ++k) {
                x[2 * k] = static_cast<float>(static_cast<int>(in[k] & 0xfu) - 8) * s;
                x[2 * k + 1] = static_cast<float>(static_cast<int>(in[k] >> 4) - 8) * s;
            }
            if (len % 2)
                x[len - 1] = static_cast<float>(static_cast<int>(in[pairs] & 0xfu) - 8) * s;
            if (out_dtype == kF32) {
                std::memcpy(o32 + off, x, len * 4);
            } else {
                for (size_t i = 0; i < len; ++i) o16[off + i] = f32_to_bf16(x[i]);
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
    py::gil_scoped_release nogil;
    dequantize_impl(q, n, block, bits, scales, out, out_dtype);
}

// ---- NF4 (QLoRA's 4-bit NormalFloat), the numerics of infinity/quant/nf4.py bit for bit:
//   absmax per block (fp32; 0 for an all-zero block), inv = 1 / max(absmax, 1e-38),
//   v = clamp(x * inv, -1, 1), code = #{midpoints t_k : t_k < v} (nearest, ties lower);
//   packed two per byte, flat: element 2k in the high nibble, 2k+1 in the low one
//   (bitsandbytes' order), code 7 (0.0) in the low nibble after an odd last element;
//   dequantized: code_book[q] * absmax in fp32 (then bf16, round to nearest even).
//   A block holding inf/NaN (Python refuses those first): absmax NaN, codes 7 (-> NaN).
// The blocks are even (whole bytes each), so a block of bytes dequantizes alone.

const float kNF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f,
    -0.28444138169288635f, -0.18477343022823334f, -0.09105003625154495f, 0.0f,
    0.07958029955625534f, 0.16093020141124725f, 0.24611230194568634f, 0.33791524171829224f,
    0.44070982933044434f, 0.5626170039176941f, 0.7229568362236023f, 1.0f};

struct NF4Thresholds {
    float t[15];
    NF4Thresholds() {
        // (c[i] + c[i+1]) / 2 in fp32, as torch computes (NF4_CODE[:-1] + NF4_CODE[1:]) / 2
        for (int i = 0; i < 15; ++i) {
            const float sum = kNF4[i] + kNF4[i + 1];
            t[i] = sum / 2.0f;
        }
    }
};
const NF4Thresholds kNF4T;

__attribute__((target_clones("avx2", "default")))
void nf4_quantize_impl(uintptr_t src, int dtype, size_t n, size_t block, uintptr_t out,
                       uintptr_t absmax) {
    float* am = reinterpret_cast<float*>(absmax);
    uint8_t* ob = reinterpret_cast<uint8_t*>(out);
    float tmp[4096];
    uint8_t ctmp_small[4096];
    float* buf = tmp;
    uint8_t* codes = ctmp_small;
    std::unique_ptr<float[]> big;
    std::unique_ptr<uint8_t[]> cbig;
    if (block > 4096) {
        big.reset(new float[block]);
        cbig.reset(new uint8_t[block]);
        buf = big.get();
        codes = cbig.get();
    }
    float t[15];
    for (int k = 0; k < 15; ++k) t[k] = kNF4T.t[k];
    const size_t nb = (n + block - 1) / block;
    for (size_t b = 0; b < nb; ++b) {
        const size_t off = b * block, len = off + block <= n ? block : n - off;
        bool bad = false;
        const float amax = load_block(reinterpret_cast<const void*>(src), dtype, off, len, buf, &bad);
        if (bad) {
            am[b] = NAN;
            for (size_t i = 0; i < len; ++i) codes[i] = 7;
        } else {
            am[b] = amax;
            const float inv = 1.0f / (amax < 1e-38f ? 1e-38f : amax);
            for (size_t i = 0; i < len; ++i) {
                float v = buf[i] * inv;
                v = v < -1.0f ? -1.0f : v;
                v = v > 1.0f ? 1.0f : v;
                int c = 0;
                for (int k = 0; k < 15; ++k) c += v > t[k] ? 1 : 0;
                codes[i] = static_cast<uint8_t>(c);
            }
        }
        uint8_t* o = ob + off / 2;                // off is even (block is even)
        const size_t pairs = len / 2;
        for (size_t k = 0; k < pairs; ++k)
            o[k] = static_cast<uint8_t>((codes[2 * k] << 4) | codes[2 * k + 1]);
        if (len % 2) o[pairs] = static_cast<uint8_t>((codes[len - 1] << 4) | 7);
    }
}

void nf4_quantize(uintptr_t src, int dtype, size_t n, size_t block, uintptr_t out,
                  uintptr_t absmax) {
    if (dtype != kF32 && dtype != kBF16) throw std::invalid_argument("nf4_quantize: bad dtype code");
    if (block == 0 || block % 2 || block > 65536)
        throw std::invalid_argument("nf4_quantize: block must be even, in [2, 65536]");
    if (n && (!src || !out || !absmax)) throw std::invalid_argument("nf4_quantize: null pointer");
    py::gil_scoped_release nogil;
    nf4_quantize_impl(src, dtype, n, block, out, absmax);
}

// byte -> its two values (high nibble first): one table load per two elements
struct NF4Pairs {
    float v[256][2];
    NF4Pairs() {
        for (int b = 0; b < 256; ++b) {
            v[b][0] = kNF4[b >> 4];
            v[b][1] = kNF4[b & 0xf];
        }
    }
};
const NF4Pairs kNF4P;

// f32_to_bf16 without a branch (vectorizes): NaN keeps its sign and gets a quiet bit
inline uint16_t f32_to_bf16_nb(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const uint32_t nan = (u >> 16) | 0x40u;
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

__attribute__((target_clones("avx2", "default")))
void nf4_dequantize_impl(uintptr_t packed, size_t n, size_t block, uintptr_t absmax,
                         uintptr_t out, int out_dtype) {
    const uint8_t* in = reinterpret_cast<const uint8_t*>(packed);
    const float* am = reinterpret_cast<const float*>(absmax);
    float* o32 = reinterpret_cast<float*>(out);
    uint16_t* o16 = reinterpret_cast<uint16_t*>(out);
    std::unique_ptr<float[]> tmp_own(new float[block]);
    float* x = tmp_own.get();
    const size_t nb = (n + block - 1) / block;
    for (size_t b = 0; b < nb; ++b) {
        const size_t off = b * block, len = off + block <= n ? block : n - off;
        const float s = am[b];
        const uint8_t* p = in + off / 2;
        const size_t pairs = len / 2;
        float* dst = out_dtype == kF32 ? o32 + off : x;
        for (size_t k = 0; k < pairs; ++k) {
            const float* e = kNF4P.v[p[k]];
            dst[2 * k] = e[0] * s;
            dst[2 * k + 1] = e[1] * s;
        }
        if (len % 2) dst[len - 1] = kNF4[p[pairs] >> 4] * s;
        if (out_dtype != kF32) {
            uint16_t* o = o16 + off;
            for (size_t i = 0; i < len; ++i) o[i] = f32_to_bf16_nb(x[i]);
        }
    }
}

void nf4_dequantize(uintptr_t packed, size_t n, size_t block, uintptr_t absmax, uintptr_t out,
                    int out_dtype) {
    if (out_dtype != kF32 && out_dtype != kBF16) throw std::invalid_argument("nf4_dequantize: bad dtype code");
    if (block == 0 || block % 2 || block > 65536)
        throw std::invalid_argument("nf4_dequantize: block must be even, in [2, 65536]");
    if (n && (!packed || !out || !absmax)) throw std::invalid_argument("nf4_dequantize: null pointer");
    py::gil_scoped_release nogil;
    nf4_dequantize_impl(packed, n, block, absmax, out, out_dtype);
}

}  // namespace

PYBIND11_MODULE(_quant, m) {
    m.doc() = "blockwise symmetric int8 / packed int4 quantization (ZeRO++) and NF4 (QLoRA), raw pointers";
    m.def("quantize", &quantize, py::arg("src"), py::arg("dtype"), py::arg("n"), py::arg("block"),
          py::arg("bits"), py::arg("out"), py::arg("scales"));
    m.def("dequantize", &dequantize, py::arg("q"), py::arg("n"), py::arg("block"), py::arg("bits"),
          py::arg("scales"), py::arg("out"), py::arg("out_dtype"));
    m.def("nf4_quantize", &nf4_quantize, py::arg("src"), py::arg("dtype"), py::arg("n"),
          py::arg("block"), py::arg("out"), py::arg("absmax"));
    m.def("nf4_dequantize", &nf4_dequantize, py::arg("packed"), py::arg("n"), py::arg("block"),
          py::arg("absmax"), py::arg("out"), py::arg("out_dtype"));
    m.attr("F32") = static_cast<int>(kF32);
    m.attr("BF16") = static_cast<int>(kBF16);
}
