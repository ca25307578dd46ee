// Tail-biting Viterbi search over the 2^16-state EXL3 trellis, for the CPU.
// W tiles are searched at once, one per SIMD lane, so every step is the same dense vector code
// (GCC vector extensions; compiled with -march=native and without FMA contraction, so the result
// matches the torch reference bit for bit). W is one native register of floats: GCC lowers the
// compare-and-select of a wider vector to scalar code (on AVX2, W = 16 ran 5x slower than W = 8).
// Cost arrays are indexed by the 16-K bits a state shares with its successor; hist keeps the chosen
// top K bits per step for the traceback. A state's 2^K candidates lie 2^(16-2K) cost vectors and 2^(16-K)
// codebook entries apart: strides of a multiple of 4 KiB up to K4 (K6 in the codebook), which put all of a state's
// candidate lines in one L1 set, more of them than its 8 ways from K3 on (K4-K6 ran 2.7x slower than K2-K3 on a
// Zen 3). So both are stored in rows padded by one cache line (`Layout`); the arithmetic and its order are unchanged.
#include <cstdint>
#include <cstring>
#include <cmath>
#include <utility>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX2__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(4 * W)));
typedef int32_t vi __attribute__((vector_size(4 * W)));
typedef uint8_t vb __attribute__((vector_size(W)));

// Traceback history: the chosen candidate c of every lane, per step and edge. With AVX-512 or AVX2 it
// is kept as K bit planes of W bits, one mask instruction each (GCC turns the narrowing of a vector of
// candidates into per-lane scalar code, which cost as much as the search itself on AVX2); elsewhere as
// one byte per lane. All give the same paths.
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
typedef uint16_t plane_t;
static inline plane_t lane_bits(vi arg, int b) { return _mm512_test_epi32_mask((__m512i) arg, _mm512_set1_epi32(1 << b)); }
#else
typedef uint8_t plane_t;
static inline plane_t lane_bits(vi arg, int b) { return _mm256_movemask_ps((__m256) (arg << (31 - b))); }
#endif
template <int K> struct Hist {
    static constexpr int64_t bytes_per_edge = K * sizeof(plane_t);
    static void store(uint8_t* row, int e, vi arg) {
        plane_t* p = reinterpret_cast<plane_t*>(row) + (size_t) e * K;
        for (int b = 0; b < K; ++b) p[b] = lane_bits(arg, b);
    }
    static int load(const uint8_t* row, int e, int lane) {
        const plane_t* p = reinterpret_cast<const plane_t*>(row) + (size_t) e * K;
        int c = 0;
        for (int b = 0; b < K; ++b) c |= ((p[b] >> lane) & 1) << b;
        return c;
    }
};
#else
template <int K> struct Hist {
    static constexpr int64_t bytes_per_edge = W;
    static void store(uint8_t* row, int e, vi arg) { reinterpret_cast<vb*>(row)[e] = __builtin_convertvector(arg, vb); }
    static int load(const uint8_t* row, int e, int lane) { return row[(size_t) e * W + lane]; }
};
#endif

// Where a state's cost vector and a codebook entry lie: rows of the states (entries) of one top-K value, each row
// padded by a cache line where rows are long enough for their stride to alias in L1 (2 KiB and over).
template <int K> struct Layout {
    static constexpr int KR = 16 - K, NK = 1 << K, E = 1 << KR;
    static constexpr int ROW = E / NK;  // cost vectors per row: the states that share their top K bits
    static constexpr int ROW_PAD = ROW * sizeof(vf) >= 2048 ? (64 + sizeof(vf) - 1) / sizeof(vf) : 0;
    static constexpr int COSTS = E + NK * ROW_PAD;  // cost vectors per array
    static constexpr int LUT_PAD = E * sizeof(float) >= 2048 ? 64 / sizeof(float) : 0;
    static constexpr int LUT = 65536 + NK * LUT_PAD;  // floats of the padded codebook
    static int cost_at(int s) { return s + (s / ROW) * ROW_PAD; }
    static int lut_at(int i) { return i + (i >> KR) * LUT_PAD; }
    static constexpr int64_t scratch_bytes()
    {
        return (int64_t) LUT * sizeof(float) + (2 * (int64_t) COSTS + 257) * sizeof(vf) +
               257 * (int64_t) E * Hist<K>::bytes_per_edge + 2 * sizeof(vf);  // + alignment slack
    }
};

template <int K>
static void step(const vf* __restrict prev, vf* __restrict next, uint8_t* __restrict hist,
                 const float* __restrict lut, vf x)
{
    using L = Layout<K>;
    constexpr int KR = L::KR, NK = L::NK, E = L::E;
    constexpr int PREV_STRIDE = L::ROW + L::ROW_PAD, LUT_STRIDE = E + L::LUT_PAD;
    for (int e = 0; e < E; ++e) {
        const int j = e >> K;  // its predecessors' shared bits: candidate c is state (c << (KR - K)) | j
        vf d = lut[e] - x;
        vf best = prev[j] + d * d;
        vi arg = {};
        for (int c = 1; c < NK; ++c) {
            d = lut[c * LUT_STRIDE + e] - x;
            const vf val = prev[c * PREV_STRIDE + j] + d * d;
            const vi m = val < best;
            best = m ? val : best;
            arg = m ? (vi{} + c) : arg;
        }
        next[L::cost_at(e)] = best;
        Hist<K>::store(hist, e, arg);
    }
}

// One group of up to W tiles; lut is the padded codebook (`Layout`), scratch holds the group's cost vectors,
// targets and history.
template <int K>
static void search_group(const float* __restrict targets, int64_t count, const float* __restrict lut,
                         uint16_t* __restrict out, vf* scratch)
{
    using L = Layout<K>;
    constexpr int KR = L::KR, E = L::E;
    vf* ca = scratch;
    vf* cb = ca + L::COSTS;
    vf* x = cb + L::COSTS;  // [256] targets, lane-major
    uint8_t* hist = reinterpret_cast<uint8_t*>(x + 256);  // [257][E]; row 256 absorbs unneeded pass-1 history
    constexpr int64_t ROW = E * Hist<K>::bytes_per_edge;
    for (int i = 0; i < 256; ++i)
        for (int l = 0; l < W; ++l)
            x[i][l] = targets[(l < count ? l : count - 1) * 256 + i];

    int edge[W];
    for (int pass = 0; pass < 2; ++pass) {
        // Pass 1 runs on the ring rotated by 128 from free start states and yields the state shared
        // by positions 255 and 0; pass 2 starts and ends there, closing the ring.
        const int roll = pass == 0 ? 128 : 0;
        if (pass == 0) {
            std::memset(ca, 0, sizeof(vf) * L::COSTS);
        } else {
            for (int e = 0; e < L::COSTS; ++e) ca[e] = vf{} + INFINITY;
            for (int l = 0; l < W; ++l) ca[L::cost_at(edge[l])][l] = 0.0f;
        }
        vf* prev = ca;
        vf* next = cb;
        for (int i = 0; i < 256; ++i) {
            const int ri = (i + roll) & 255;
            const int row = (pass == 1 || ri < 128) ? ri : 256;
            step<K>(prev, next, hist + row * ROW, lut, x[ri]);
            std::swap(prev, next);
        }
        if (pass == 0) {
            vf best = prev[0];
            vi arg = {};
            for (int e = 1; e < E; ++e) {
                const vf cost = prev[L::cost_at(e)];
                const vi m = cost < best;
                best = m ? cost : best;
                arg = m ? (vi{} + e) : arg;
            }
            for (int l = 0; l < W; ++l) {
                int e = arg[l];
                for (int i = 255; i >= 128; --i) {
                    const int ri = (i + 128) & 255;
                    e = ((Hist<K>::load(hist + ri * ROW, e, l) << KR) | e) >> K;
                }
                edge[l] = e;
            }
        } else {
            for (int l = 0; l < W && l < count; ++l) {
                int e = edge[l];
                for (int ri = 255; ri >= 0; --ri) {
                    const int s = (Hist<K>::load(hist + ri * ROW, e, l) << KR) | e;
                    out[l * 256 + ri] = (uint16_t) s;
                    e = s >> K;
                }
            }
        }
    }
}

// All n tiles at K: the codebook copied once into its padded rows, then the groups of W tiles.
template <int K>
static void search(const float* targets, int64_t n, const float* lut, uint16_t* out, uint8_t* scratch)
{
    using L = Layout<K>;
    vf* aligned = reinterpret_cast<vf*>(scratch + (-reinterpret_cast<uintptr_t>(scratch) & (sizeof(vf) - 1)));
    float* table = reinterpret_cast<float*>(aligned);
    for (int i = 0; i < 65536; ++i) table[L::lut_at(i)] = lut[i];
    vf* group = aligned + (L::LUT * sizeof(float) + sizeof(vf) - 1) / sizeof(vf);
    for (int64_t g = 0; g < n; g += W)
        search_group<K>(targets + g * 256, n - g < W ? n - g : W, table, out + g * 256, group);
}

extern "C" int64_t exl3_viterbi_lanes() { return W; }

extern "C" int64_t exl3_viterbi_scratch_bytes(int K)
{
    static const int64_t bytes[8] = {Layout<1>::scratch_bytes(), Layout<2>::scratch_bytes(), Layout<3>::scratch_bytes(),
                                     Layout<4>::scratch_bytes(), Layout<5>::scratch_bytes(), Layout<6>::scratch_bytes(),
                                     Layout<7>::scratch_bytes(), Layout<8>::scratch_bytes()};
    return K < 1 || K > 8 ? 0 : bytes[K - 1];
}

// targets: [n][256] fp32 in ring order; lut: [65536] fp32; out: [n][256] states.
extern "C" int exl3_viterbi(const float* targets, int64_t n, const float* lut, int K, uint16_t* out, uint8_t* scratch)
{
    typedef void (*fn_t)(const float*, int64_t, const float*, uint16_t*, uint8_t*);
    static const fn_t fns[8] = {search<1>, search<2>, search<3>, search<4>, search<5>, search<6>, search<7>, search<8>};
    if (K < 1 || K > 8) return -1;
    fns[K - 1](targets, n, lut, out, scratch);
    return 0;
}
