// Tail-biting Viterbi search over the 2^16-state EXL3 trellis on an NVIDIA GPU (built by viterbi_cuda.py with
// nvcc, called through ctypes on torch's current stream).
//
// One block of 1024 threads searches one tile. Every step evaluates all 65,536 (state, predecessor) pairs:
// thread t owns 64 of them for the whole search and keeps their codebook values in registers as fp16 pairs,
// so a candidate costs one half of an fp16x2 subtraction, a conversion, an FFMA, a LOP3 and half a 3-way
// integer min. Costs are non-negative floats compared as unsigned integers with the candidate's K-bit index
// packed into their low mantissa bits: the min gives the cost and the argmin at once (ties and costs closer
// than 2^K ulp resolve to the lowest index). The two cost arrays (previous and next step) live in shared
// memory; the chosen indices go to a traceback history in global memory, one 32-bit word per thread and step,
// and one thread per tile walks it back in a second kernel. This search runs at K >= 3.
//
// At K <= 2 a second search does the same in 16-bit fixed point with Hopper's DPX SIMD instructions, two edges
// per register: targets and codebook values are scaled per tile (by its RMS), a candidate's squared difference is
// one HSUB2 and one HFMA2 that adds 2^10, whose fp16 bits above 0x6400 are then the error in integer units
// (larger errors compress monotonically), and one IMAD scales it past the K index bits and adds the predecessor's cost
// with that predecessor's index in its low K bits. A 16-bit min then gives cost and argmin at once. Costs are
// renormalized every step by the block's lowest cost and clamped to a cap well above any competitive path (a clamped
// edge records index 2^K - 1), so the keys never wrap. Fewer instructions per candidate; quality within noise of the
// fp32 search.
//
// Passes as ExLlamaV3 1.6.5 runs them: pass 1 searches the ring rotated so that it starts `before` positions
// ahead of position 0 and ends `after` positions past it, from free start states; the traceback of its best path
// gives the state bits shared by positions 255 and 0 (the seam). Pass 2 searches positions 0..255 starting from
// the seam and is traced back from it, which closes the ring.
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>

namespace {

constexpr int THREADS = 1024;
constexpr float UNREACHABLE = 1e30f;

template <int K>
struct Layout {
    static constexpr int KR = 16 - K;
    static constexpr int EDGES = 1 << KR;                     // cost entries: the 16-K bits a state shares
    static constexpr int NC = 1 << K;                         // candidate predecessors per edge
    static constexpr int CT = NC < 64 ? NC : 64;              // candidates of one edge handled by one thread
    static constexpr int SPLIT = NC / CT;                     // threads sharing one edge (K >= 7)
    static constexpr int LT = NC * NC <= 64 ? NC : (NC <= 64 ? 64 / NC : 1);  // edges of one group per thread
    static constexpr int JT = 64 / (CT * LT);                 // groups (states sharing predecessors) per thread
    static constexpr int EL_BLOCKS = NC / LT;
    static constexpr int J_STRIDE = THREADS / (SPLIT * EL_BLOCKS);
    static constexpr int EDGES_PER_THREAD = JT * LT;
    static constexpr int CHUNK = CT < 8 ? CT : 8;             // predecessor costs held in registers at once
    static constexpr uint32_t CMASK = NC - 1;
    static_assert(JT * J_STRIDE == (1 << (16 - 2 * K)), "every group owned once");
    static_assert(EDGES_PER_THREAD * K <= 32, "one history word per thread and step");
};

__device__ __forceinline__ uint32_t min3(uint32_t a, uint32_t b, uint32_t c) { return __vimin3_u32(a, b, c); }

// The cost's bits with the candidate index in the low K bits: one LOP3 with the index in a register.
template <uint32_t CMASK>
__device__ __forceinline__ uint32_t pack(float cost, uint32_t index)
{
    uint32_t key;
    asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(key) : "r"(__float_as_uint(cost)), "n"(~CMASK), "r"(index));
    return key;
}

__device__ __forceinline__ __half2 as_half2(uint32_t bits) { return *reinterpret_cast<__half2*>(&bits); }

// The block's lowest (cost << 32 | edge) key over every thread's `key`; thread 0 writes its edge to *out (the lowest
// cost, then the lowest edge). Every thread of the block calls it.
__device__ void write_lowest_edge(unsigned long long key, unsigned long long* reduce, int32_t* out)
{
    const int t = threadIdx.x;
    #pragma unroll
    for (int off = 16; off > 0; off >>= 1) key = min(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
    if ((t & 31) == 0) reduce[t >> 5] = key;
    __syncthreads();
    if (t < 32) {
        key = reduce[t];
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) key = min(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
        if (t == 0) *out = (int32_t) (key & 0xFFFFFFFFu);
    }
}

template <int K>
__global__ void __launch_bounds__(THREADS, 1) forward_kernel(
    const float* __restrict__ targets,      // [n][256] ring-ordered
    const uint32_t* __restrict__ pairs,     // [2^(K-1)][2^(16-K)] values of states (2c << 16-K | e, +1 << 16-K)
    int roll, int steps, int store_below,   // positions (roll + i) & 255; history kept for positions < store_below
    const int32_t* __restrict__ start_edge, // [n] seam of each tile (pass 2) or null (pass 1: free start)
    uint32_t* __restrict__ hist,            // [n][256][THREADS]
    int32_t* __restrict__ best_edge)        // [n] out: lowest-cost final edge (pass 1) or null
{
    using L = Layout<K>;
    extern __shared__ __align__(16) unsigned char smem[];
    __half2* xs = reinterpret_cast<__half2*>(smem);                    // [256] target, twice
    unsigned long long* reduce = reinterpret_cast<unsigned long long*>(xs + 256);  // [32]
    float* costs = reinterpret_cast<float*>(reduce + 32);                // [2][EDGES]

    const int tile = blockIdx.x;
    const int t = threadIdx.x;
    const int part = t % L::SPLIT;
    const int u = t / L::SPLIT;
    const int elb = u % L::EL_BLOCKS;
    const int jb = u / L::EL_BLOCKS;
    const uint32_t cbase = part * L::CT;

    // Codebook values of this thread's candidates, as fp16 (cc, cc + 1) pairs in one register each (loaded as
    // 32-bit words: from 16-bit loads the compiler keeps the halves apart and re-packs them every step).
    uint32_t values[L::JT][L::LT][L::CT / 2];
    #pragma unroll
    for (int m = 0; m < L::JT; ++m)
        #pragma unroll
        for (int l = 0; l < L::LT; ++l)
            #pragma unroll
            for (int p = 0; p < L::CT / 2; ++p) {
                const uint32_t j = jb + m * L::J_STRIDE, el = elb * L::LT + l;
                values[m][l][p] = pairs[(((cbase >> 1) + p) << L::KR) | (j << K) | el];
            }

    for (int i = t; i < 256; i += THREADS) xs[i] = __float2half2_rn(targets[(size_t) tile * 256 + i]);
    const int seam = start_edge ? start_edge[tile] : -1;
    for (int e = t; e < L::EDGES; e += THREADS)
        costs[e] = seam < 0 || e == seam ? 0.0f : UNREACHABLE;
    __syncthreads();

    uint32_t* tile_hist = hist + (size_t) tile * 256 * THREADS;
    for (int i = 0; i < steps; ++i) {
        const int ri = (roll + i) & 255;
        const float* prev = costs + (i & 1) * L::EDGES;
        float* next = costs + ((i + 1) & 1) * L::EDGES;
        const __half2 x = xs[ri];
        uint32_t word = 0;
        #pragma unroll
        for (int m = 0; m < L::JT; ++m) {
            const uint32_t j = jb + m * L::J_STRIDE;
            // Each edge's running minimum over its candidates, in chunks of predecessor costs.
            uint32_t best[L::LT];
            #pragma unroll
            for (int l = 0; l < L::LT; ++l) best[l] = 0xFFFFFFFFu;
            #pragma unroll
            for (int c0 = 0; c0 < L::CT; c0 += L::CHUNK) {
                float pc[L::CHUNK];
                #pragma unroll
                for (int cc = 0; cc < L::CHUNK; ++cc) {
                    const uint32_t at = ((cbase + c0 + cc) << (L::KR - K)) + j;  // + (not |): folds into the load
                    pc[cc] = prev[at];
                }
                #pragma unroll
                for (int l = 0; l < L::LT; ++l) {
                    #pragma unroll
                    for (int cc = 0; cc < L::CHUNK; cc += 2) {
                        const float2 d = __half22float2(__hsub2(as_half2(values[m][l][(c0 + cc) / 2]), x));
                        const uint32_t ka = pack<L::CMASK>(fmaf(d.x, d.x, pc[cc]), cbase + c0 + cc);
                        const uint32_t kb = pack<L::CMASK>(fmaf(d.y, d.y, pc[cc + 1]), cbase + c0 + cc + 1);
                        best[l] = min3(best[l], ka, kb);
                    }
                    if (c0 + L::CHUNK == L::CT) {  // last chunk: the edge is decided
                        #pragma unroll
                        for (int off = 1; off < L::SPLIT; off <<= 1)
                            best[l] = min(best[l], __shfl_xor_sync(0xFFFFFFFFu, best[l], off));
                        const uint32_t e = (j << K) + elb * L::LT + l;
                        next[e] = __uint_as_float(best[l]);
                        word = __funnelshift_r(word, best[l], K);
                    }
                }
            }
        }
        if (ri < store_below) tile_hist[(size_t) ri * THREADS + t] = word;
        __syncthreads();
    }

    if (best_edge) {
        // Lowest final cost over the block; the edge index breaks ties (lowest first).
        const float* final_costs = costs + (steps & 1) * L::EDGES;
        unsigned long long key = ~0ull;
        for (int e = t; e < L::EDGES; e += THREADS) {
            const float c = final_costs[e];
            key = min(key, ((unsigned long long) __float_as_uint(c) << 32) | (uint32_t) e);
        }
        write_lowest_edge(key, reduce, best_edge + tile);
    }
}

template <int K>
struct Fixed {
    static constexpr int KR = 16 - K;
    static constexpr int EDGES = 1 << KR;
    static constexpr int NC = 1 << K;
    static constexpr int GROUPS = 1 << (16 - 2 * K);          // edges sharing their NC predecessors: j = e >> K
    static constexpr int PAIRS = GROUPS / 2 / THREADS;        // group pairs (2g, 2g + 1) per thread: 8 at K = 1, 2 at K = 2
    static constexpr int WORDS = PAIRS * NC;                  // edge pairs (one per lane pair) per thread
    static constexpr uint32_t LANES = 0x00010001u;
    static constexpr uint32_t IMASK = (NC - 1) * LANES;       // the index bits of both lanes
    static constexpr uint32_t MAGIC = 0x6400u;                // fp16 bits of 2^10
    static constexpr uint32_t MAX_ERROR = 0x7C00u - MAGIC;    // +inf: the largest error a candidate can add
    static constexpr uint32_t CAP = K == 1 ? 26000u : 10000u; // cost clamp (units of the HFMA2's ulp)
    static constexpr uint32_t CAPS = ((CAP << K) | (NC - 1)) * LANES;  // the clamp in both lanes
    static constexpr float PER_RMS = K == 1 ? 5.0f : 20.0f;    // tile scale x RMS (calibrated in docs/encode.md)
    static constexpr uint32_t BIAS = 0u - (MAGIC << K) * LANES;
    static_assert(PAIRS * 2 * THREADS == GROUPS && K <= 2, "fixed-point layout covers K = 1, 2");
    static_assert(((CAP + MAX_ERROR) << K) + NC - 1 < 65536u, "keys never wrap");
    static_assert(WORDS % 2 == 0 && WORDS / 2 * K == 8, "one history word per thread and step");
};

__device__ __forceinline__ uint32_t as_u32(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }

// The tile's scale: `per_rms` over the RMS of its fp16-rounded targets (summed in order by one thread, so that the
// torch model repeats it bit for bit) as an fp16 multiple of 16, at most 64, halved until its largest target and
// codebook value scaled stay within 256 (finite fp16 squared errors). The RMS sets the resolution: competitive
// squared errors land in the 2^10 units of the HFMA2's linear binade, neither rounded away nor compressed.
__device__ float tile_scale(const float* __restrict__ x, float codebook_peak, float per_rms, uint32_t* scratch)
{
    const int t = threadIdx.x;
    uint32_t peak = t < 256 ? __float_as_uint(fabsf(x[t])) : 0u;  // non-negative floats order as integers
    peak = __reduce_max_sync(0xFFFFFFFFu, peak);
    if ((t & 31) == 0) scratch[t >> 5] = peak;
    if (t == 0) {
        float total = 0.0f;
        for (int i = 0; i < 256; ++i) {
            const float h = __half2float(__float2half_rn(x[i]));
            total = __fadd_rn(total, __fmul_rn(h, h));
        }
        scratch[32] = __float_as_uint(total);
    }
    __syncthreads();
    peak = __reduce_max_sync(0xFFFFFFFFu, scratch[t & 31]);
    const float rms = sqrtf(__uint_as_float(scratch[32]) / 256.0f);
    float scale = __half2float(__float2half_rn(fminf(per_rms / rms, 64.0f) / 16.0f)) * 16.0f;
    while ((__uint_as_float(peak) + codebook_peak) * scale > 256.0f) scale *= 0.5f;
    return scale;
}

// The fixed-point search (K <= 2): same passes and arguments as forward_kernel; `values` holds the codebook's values
// scaled by 16 as fp16, one per state (rescaled to the tile's scale on loading); codebook_peak is their largest
// magnitude (unscaled). Each position's HFMA2 adds 2^10 less a floor under its smallest squared error (non-zero for
// targets beyond the codebook's range), which keeps every candidate's result at or above 2^10 and the competitive ones
// in its linear binade.
//
// Thread t owns the group pairs g = t + q THREADS, groups 2g and 2g + 1 in the low and high lanes: the two groups'
// costs of one predecessor candidate are one 32-bit shared load, and their 2 NC edges one contiguous store. Costs are
// stored without labels: the predecessor bias adds each candidate's index c (its slot), removes the magic's bits past
// the index and renormalizes by the previous step's lowest cost, all in one IADD3 per candidate and group pair; the
// edge's min over its candidates and the clamp are one or two 3-way 16-bit mins.
template <int K>
__global__ void __launch_bounds__(THREADS, 1) forward_fixed_kernel(
    const float* __restrict__ targets, const uint16_t* __restrict__ values, float codebook_peak, int roll,
    int steps, int store_below, const int32_t* __restrict__ start_edge, uint32_t* __restrict__ hist,
    int32_t* __restrict__ best_edge)
{
    using F = Fixed<K>;
    extern __shared__ __align__(16) unsigned char smem[];
    uint2* xa = reinterpret_cast<uint2*>(smem);                          // [256] (scaled target, addend), each twice
    uint32_t* lows = reinterpret_cast<uint32_t*>(xa + 256);             // [2][32] per-warp lowest costs
    unsigned long long* reduce = reinterpret_cast<unsigned long long*>(lows + 64);  // [32]
    uint16_t* costs = reinterpret_cast<uint16_t*>(reduce + 32);          // [2][EDGES]

    const int tile = blockIdx.x;
    const int t = threadIdx.x;
    const float* x_tile = targets + (size_t) tile * 256;
    const float scale = tile_scale(x_tile, codebook_peak, F::PER_RMS, lows);
    const __half2 rescale = __float2half2_rn(scale / 16.0f);
    uint32_t pair_values[F::PAIRS][F::NC][F::NC];  // [q][el][c]: states (c, 2g, el) and (c, 2g + 1, el)
    #pragma unroll
    for (int q = 0; q < F::PAIRS; ++q)
        #pragma unroll
        for (int el = 0; el < F::NC; ++el)
            #pragma unroll
            for (int c = 0; c < F::NC; ++c) {
                const uint32_t state = (c << F::KR) | ((2 * (t + q * THREADS)) << K) | el;
                const uint32_t word = values[state] | ((uint32_t) values[state + F::NC] << 16);
                pair_values[q][el][c] = as_u32(__hmul2(as_half2(word), rescale));
            }

    for (int i = t; i < 256; i += THREADS) {
        const __half x = __float2half_rn(x_tile[i] * scale);
        const float over = fmaxf(fabsf(__half2float(x)) - codebook_peak * scale, 0.0f);
        const float floor_error = floorf(over * over * (1.0f - 1.0f / 512.0f));
        xa[i] = make_uint2(as_u32(__half2half2(x)), as_u32(__half2half2(__float2half_ru(1024.0f - floor_error))));
    }
    __syncthreads();  // tile_scale's scratch is reused below
    const int seam = start_edge ? start_edge[tile] : -1;
    for (int e = t; e < F::EDGES; e += THREADS) costs[e] = (uint16_t) ((seam < 0 || e == seam ? 0u : F::CAP) << K);
    if (t < 32) lows[t] = 0;  // the lowest start cost is 0 in both passes
    __syncthreads();

    uint32_t* thread_hist = hist + (size_t) tile * 256 * THREADS + t;
    for (int i = 0; i < steps; ++i) {
        const int ri = (roll + i) & 255;
        const uint32_t* prev = reinterpret_cast<const uint32_t*>(costs + (i & 1) * F::EDGES);
        uint16_t* next = costs + ((i + 1) & 1) * F::EDGES;
        const uint2 here = xa[ri];
        const __half2 x = as_half2(here.x), add = as_half2(here.y);
        const uint32_t low = __reduce_min_sync(0xFFFFFFFFu, lows[(i & 1) * 32 + (t & 31)]) & ~(uint32_t) (F::NC - 1);
        const uint32_t bias = F::BIAS - low * F::LANES;
        // History: the kept words w = 2p, 2p + 1 put their 4 lanes' indices in the 4 bytes of the word, at bit K p.
        uint32_t word = 0, lowest = 0xFFFFFFFFu, held = 0;
        #pragma unroll
        for (int q = 0; q < F::PAIRS; ++q) {
            const int g = t + q * THREADS;
            uint32_t pred[F::NC];  // both groups' cost of predecessor c, biased
            #pragma unroll
            for (int c = 0; c < F::NC; ++c) pred[c] = prev[c * (F::GROUPS / 2) + g] + bias + c * F::LANES;
            uint32_t out[F::NC];
            #pragma unroll
            for (int el = 0; el < F::NC; ++el) {
                uint32_t key[F::NC];
                #pragma unroll
                for (int c = 0; c < F::NC; ++c) {
                    const __half2 d = __hsub2(as_half2(pair_values[q][el][c]), x);
                    key[c] = as_u32(__hfma2(d, d, add)) * (1u << K) + pred[c];
                }
                // The lowest key, clamped: the next step's cost with the chosen index in its low bits.
                uint32_t kept;
                if constexpr (K == 1) kept = __vimin3_u16x2(key[0], key[1], F::CAPS);
                else kept = __vimin3_u16x2(__vimin3_u16x2(key[0], key[1], key[2]), key[3], F::CAPS);
                out[el] = kept & ~F::IMASK;
                const int w = q * F::NC + el;
                if (w % 2 == 0) {
                    held = kept;
                } else {
                    const uint32_t bytes = __byte_perm(held, kept, 0x6420);  // low bytes of the 4 lanes
                    const uint32_t field = ((F::NC - 1) << (K * (w / 2))) * 0x01010101u;
                    // bits K (w / 2) .. of every byte from `bytes`, the rest from `word` (filled from the bottom)
                    word = w == 1 ? bytes : (((bytes << (K * (w / 2))) & field) | (word & ~field));
                    lowest = __vimin3_u16x2(lowest, held, kept);
                }
            }
            if constexpr (K == 1) {
                *reinterpret_cast<uint2*>(next + (g << 2)) =
                    make_uint2(__byte_perm(out[0], out[1], 0x5410), __byte_perm(out[0], out[1], 0x7632));
            } else {
                *reinterpret_cast<uint4*>(next + (g << 3)) =
                    make_uint4(__byte_perm(out[0], out[1], 0x5410), __byte_perm(out[2], out[3], 0x5410),
                               __byte_perm(out[0], out[1], 0x7632), __byte_perm(out[2], out[3], 0x7632));
            }
        }
        if (ri < store_below) thread_hist[ri * THREADS] = word;
        lowest = __reduce_min_sync(0xFFFFFFFFu, min(lowest & 0xFFFFu, lowest >> 16));
        if ((t & 31) == 0) lows[((i + 1) & 1) * 32 + (t >> 5)] = lowest;
        __syncthreads();
    }

    if (best_edge) {
        const uint16_t* final_costs = costs + (steps & 1) * F::EDGES;
        unsigned long long key = ~0ull;
        for (int e = t; e < F::EDGES; e += THREADS)
            key = min(key, ((unsigned long long) (final_costs[e] >> K) << 32) | (uint32_t) e);
        write_lowest_edge(key, reduce, best_edge + tile);
    }
}

// Walks one tile's history back from `edge` over positions last..first (one thread per tile). With `states`,
// writes each position's state; always leaves the edge before position `first` in edges[tile].
template <int K, bool FIXED>
__global__ void trace_kernel(const uint32_t* __restrict__ hist, int n, int first, int last,
                             int32_t* __restrict__ edges, int32_t* __restrict__ states)
{
    constexpr uint32_t CMASK = (1u << K) - 1;
    const int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= n) return;
    const uint32_t* tile_hist = hist + (size_t) tile * 256 * THREADS;
    uint32_t edge = edges[tile];
    for (int ri = last; ri >= first; --ri) {
        const uint32_t j = edge >> K, el = edge & CMASK;
        uint32_t c;
        if constexpr (FIXED) {  // group pair g = j / 2 (lane j % 2) of thread g % THREADS, word w: byte 2 (w % 2) + lane
            using F = Fixed<K>;
            const uint32_t g = j / 2, w = (g / THREADS) * F::NC + el, byte = 2 * (w % 2) + (j & 1);
            const uint32_t word = tile_hist[(size_t) ri * THREADS + g % THREADS];
            c = (word >> (8 * byte + K * (w / 2))) & CMASK;
        } else {
            using L = Layout<K>;
            const uint32_t m = j / L::J_STRIDE, owner = ((j % L::J_STRIDE) * L::EL_BLOCKS + el / L::LT) * L::SPLIT;
            const uint32_t slot = m * L::LT + el % L::LT;
            const uint32_t word = tile_hist[(size_t) ri * THREADS + owner];
            c = (word >> (32 - (L::EDGES_PER_THREAD - slot) * K)) & CMASK;
        }
        const uint32_t state = (c << (16 - K)) | edge;
        if (states) states[(size_t) tile * 256 + ri] = (int32_t) state;
        edge = state >> K;
    }
    edges[tile] = (int32_t) edge;
}

template <int K>
size_t shared_bytes()
{
    if constexpr (K <= 2) return 256 * sizeof(uint2) + 64 * 4 + 32 * 8 + 2 * Fixed<K>::EDGES * sizeof(uint16_t);
    else return 256 * sizeof(__half2) + 32 * 8 + 2 * Layout<K>::EDGES * sizeof(float);
}

template <int K>
cudaError_t search(const float* targets, int64_t n, const void* lut, float peak, int before, int after,
                   int32_t* states, uint32_t* hist, int32_t* edges, int64_t batch, cudaStream_t stream)
{
    constexpr bool fixed = K <= 2;
    const size_t smem = shared_bytes<K>();
    cudaError_t err;
    constexpr cudaFuncAttribute attribute = cudaFuncAttributeMaxDynamicSharedMemorySize;
    if constexpr (fixed) err = cudaFuncSetAttribute(forward_fixed_kernel<K>, attribute, (int) smem);
    else err = cudaFuncSetAttribute(forward_kernel<K>, attribute, (int) smem);
    if (err != cudaSuccess) return err;
    const auto forward = [&](const float* x, int count, int roll, int steps, int store_below, const int32_t* start,
                             int32_t* best) {
        if constexpr (fixed)
            forward_fixed_kernel<K><<<count, THREADS, smem, stream>>>(x, static_cast<const uint16_t*>(lut), peak,
                                                                      roll, steps, store_below, start, hist, best);
        else
            forward_kernel<K><<<count, THREADS, smem, stream>>>(x, static_cast<const uint32_t*>(lut), roll, steps,
                                                                store_below, start, hist, best);
    };
    for (int64_t start = 0; start < n; start += batch) {
        const int count = (int) (n - start < batch ? n - start : batch);
        const float* x = targets + start * 256;
        const int trace_blocks = (count + 127) / 128;
        forward(x, count, 256 - before, before + after, after, nullptr, edges);
        trace_kernel<K, fixed><<<trace_blocks, 128, 0, stream>>>(hist, count, 0, after - 1, edges, nullptr);
        forward(x, count, 0, 256, 256, edges, nullptr);
        trace_kernel<K, fixed><<<trace_blocks, 128, 0, stream>>>(hist, count, 0, 255, edges, states + start * 256);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace

// targets: [n][256] fp32 ring-ordered (device); lut: the codebook table for this K (device): at K <= 2 its 65,536
// fp16 values x 16, else its fp16 values in pairs of candidates (see forward_kernel);
// peak: the codebook's largest |value|; states: [n][256] int32 out; scratch for `batch` tiles at a time: hist
// [batch][256][1024] words, edges [batch] int32. 0 on success, else a cudaError_t (or -1 for bad arguments).
extern "C" int exl3_viterbi_cuda(const float* targets, int64_t n, const void* lut, float peak, int K, int before,
                                 int after, int32_t* states, uint32_t* hist, int32_t* edges, int64_t batch,
                                 void* stream)
{
    if (K < 1 || K > 8 || before < 0 || after < 1 || before + after > 256 || batch < 1) return -1;
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (K) {
        case 1: return search<1>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 2: return search<2>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 3: return search<3>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 4: return search<4>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 5: return search<5>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 6: return search<6>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        case 7: return search<7>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
        default: return search<8>(targets, n, lut, peak, before, after, states, hist, edges, batch, s);
    }
}

extern "C" const char* exl3_viterbi_cuda_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
