// Tail-biting Viterbi search over the 2^16-state EXL3 trellis on an NVIDIA GPU (built by viterbi_cuda.py with
// nvcc, called through ctypes on torch's current stream).
//
// One block of 1024 threads searches one tile. Every step evaluates all 65,536 (state, predecessor) pairs:
// thread t owns 64 of them for the whole search and keeps their codebook values in registers as fp16 pairs,
// so a candidate costs one half of an fp16x2 subtraction, a conversion, an FFMA, a LOP3 and half a 3-way
// integer min. Costs are non-negative floats compared as unsigned integers with the candidate's K-bit index
// packed into their low mantissa bits: the min gives the cost and the argmin at once (ties and costs closer
// than 2^K ulp resolve to the lowest index). The two cost arrays (previous and next step) live in shared
// memory (global memory at K = 1, whose 2 x 128 KB do not fit); the chosen indices go to a traceback history in
// global memory, one 32-bit word per thread and step, and one thread per tile walks it back in a second kernel.
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
    static constexpr bool GLOBAL_COSTS = K == 1;
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

template <int K>
__global__ void __launch_bounds__(THREADS, 1) forward_kernel(
    const float* __restrict__ targets,      // [n][256] ring-ordered
    const uint32_t* __restrict__ pairs,     // [2^(K-1)][2^(16-K)] codebook values of states (2c << 16-K | e, +1 << 16-K)
    int roll, int steps, int store_below,   // positions (roll + i) & 255; history kept for positions < store_below
    const int32_t* __restrict__ start_edge, // [n] seam of each tile (pass 2) or null (pass 1: free start)
    uint32_t* __restrict__ hist,            // [n][256][THREADS]
    int32_t* __restrict__ best_edge,        // [n] out: lowest-cost final edge (pass 1) or null
    float* __restrict__ global_costs)       // [gridDim][2][EDGES] when Layout::GLOBAL_COSTS
{
    using L = Layout<K>;
    extern __shared__ __align__(16) unsigned char smem[];
    __half2* xs = reinterpret_cast<__half2*>(smem);                    // [256] target, twice
    unsigned long long* reduce = reinterpret_cast<unsigned long long*>(xs + 256);  // [32]
    float* costs = L::GLOBAL_COSTS ? global_costs + (size_t) blockIdx.x * 2 * L::EDGES
                                   : reinterpret_cast<float*>(reduce + 32);

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
                    pc[cc] = L::GLOBAL_COSTS ? __ldcg(prev + at) : prev[at];
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
                        if (L::GLOBAL_COSTS) __stcg(next + e, __uint_as_float(best[l]));
                        else next[e] = __uint_as_float(best[l]);
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
            const float c = L::GLOBAL_COSTS ? __ldcg(final_costs + e) : final_costs[e];
            key = min(key, ((unsigned long long) __float_as_uint(c) << 32) | (uint32_t) e);
        }
        #pragma unroll
        for (int off = 16; off > 0; off >>= 1) key = min(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
        if ((t & 31) == 0) reduce[t >> 5] = key;
        __syncthreads();
        if (t < 32) {
            key = reduce[t];
            #pragma unroll
            for (int off = 16; off > 0; off >>= 1) key = min(key, __shfl_xor_sync(0xFFFFFFFFu, key, off));
            if (t == 0) best_edge[tile] = (int32_t) (key & 0xFFFFFFFFu);
        }
    }
}

// Walks one tile's history back from `edge` over positions last..first (one thread per tile). With `states`,
// writes each position's state; always leaves the edge before position `first` in edges[tile].
template <int K>
__global__ void trace_kernel(const uint32_t* __restrict__ hist, int n, int first, int last,
                             int32_t* __restrict__ edges, int32_t* __restrict__ states)
{
    using L = Layout<K>;
    const int tile = blockIdx.x * blockDim.x + threadIdx.x;
    if (tile >= n) return;
    const uint32_t* tile_hist = hist + (size_t) tile * 256 * THREADS;
    uint32_t edge = edges[tile];
    for (int ri = last; ri >= first; --ri) {
        const uint32_t j = edge >> K, el = edge & L::CMASK;
        const uint32_t m = j / L::J_STRIDE, owner = ((j % L::J_STRIDE) * L::EL_BLOCKS + el / L::LT) * L::SPLIT;
        const uint32_t slot = m * L::LT + el % L::LT;
        const uint32_t word = tile_hist[(size_t) ri * THREADS + owner];
        const uint32_t c = (word >> (32 - (L::EDGES_PER_THREAD - slot) * K)) & L::CMASK;
        const uint32_t state = (c << L::KR) | edge;
        if (states) states[(size_t) tile * 256 + ri] = (int32_t) state;
        edge = state >> K;
    }
    edges[tile] = (int32_t) edge;
}

template <int K>
size_t shared_bytes() { return 256 * sizeof(__half2) + 32 * 8 + (Layout<K>::GLOBAL_COSTS ? 0 : 2 * Layout<K>::EDGES * 4); }

template <int K>
cudaError_t search(const float* targets, int64_t n, const uint32_t* lut, int before, int after, int32_t* states,
                   uint32_t* hist, int32_t* edges, float* global_costs, int64_t batch, cudaStream_t stream)
{
    const size_t smem = shared_bytes<K>();
    cudaError_t err = cudaFuncSetAttribute(forward_kernel<K>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem);
    if (err != cudaSuccess) return err;
    for (int64_t start = 0; start < n; start += batch) {
        const int count = (int) (n - start < batch ? n - start : batch);
        const float* x = targets + start * 256;
        const int trace_blocks = (count + 127) / 128;
        forward_kernel<K><<<count, THREADS, smem, stream>>>(x, lut, 256 - before, before + after, after, nullptr,
                                                            hist, edges, global_costs);
        trace_kernel<K><<<trace_blocks, 128, 0, stream>>>(hist, count, 0, after - 1, edges, nullptr);
        forward_kernel<K><<<count, THREADS, smem, stream>>>(x, lut, 0, 256, 256, edges, hist, nullptr, global_costs);
        trace_kernel<K><<<trace_blocks, 128, 0, stream>>>(hist, count, 0, 255, edges, states + start * 256);
        err = cudaGetLastError();
        if (err != cudaSuccess) return err;
    }
    return cudaSuccess;
}

}  // namespace

// targets: [n][256] fp32 ring-ordered (device); lut: the codebook's fp16 values in pairs for this K (see
// forward_kernel), device; states: [n][256] int32 out; scratch for `batch` tiles at a time: hist
// [batch][256][1024] words, edges [batch] int32, global_costs [batch][2][32768] floats (K = 1 only).
// 0 on success, else a cudaError_t (or -1 for bad arguments).
extern "C" int exl3_viterbi_cuda(const float* targets, int64_t n, const void* lut, int K, int before, int after,
                                 int32_t* states, uint32_t* hist, int32_t* edges, float* global_costs, int64_t batch,
                                 void* stream)
{
    if (K < 1 || K > 8 || before < 0 || after < 1 || before + after > 256 || batch < 1) return -1;
    const uint32_t* table = static_cast<const uint32_t*>(lut);
    cudaStream_t s = static_cast<cudaStream_t>(stream);
    switch (K) {
        case 1: return search<1>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 2: return search<2>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 3: return search<3>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 4: return search<4>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 5: return search<5>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 6: return search<6>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        case 7: return search<7>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
        default: return search<8>(targets, n, table, before, after, states, hist, edges, global_costs, batch, s);
    }
}

extern "C" const char* exl3_viterbi_cuda_error(int code) { return cudaGetErrorString(static_cast<cudaError_t>(code)); }
