/* What limits a one-row matrix-vector product's loads: a probe of the memory
 * system with the access pattern of mmv_direct's Q4_K lanes (cuda/matmul.cu)
 * and none of its arithmetic. Built and run by scripts/cuda-probe.sh.
 *
 * A warp owns a row of nb blocks of 144 bytes; a round of the warp takes 4
 * blocks, 8 lanes a block: each lane loads the block's 16-byte header (the
 * same address for its 8 lanes) and its own 16 bytes of values, as
 * type_q4_K::fetch does. Per round and lane, the variants add:
 *   act = 0   nothing;
 *   act = 1   the activations as k_act32::load reads them: two 16-byte loads
 *             of int8 values and one of the blocks' (d, sum), from one
 *             vector that every warp reads (L1 hits after the first);
 *   act = 2   the same loads from shared memory, where each CTA copied the
 *             vector once before its rows;
 * and `pad` integer multiply-adds in 4 independent chains (the decoding's
 * work, roughly: the real kernel issues about 107 instructions a round).
 * PF rounds of weight loads are in flight a lane (1: the kernel as it is).
 * Launches are 4-warp CTAs, a row a warp, on weight copies that rotate
 * through 8 buffers so that each launch's weights are cold in the L2.
 * Prints us a launch and the weight bytes' GB/s for each variant. */
#include <cuda_runtime.h>
#include <initializer_list>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda-probe.cuh"

#define WARPS 4
#define BLOCK_BYTES 144
#define COPIES 8


/* A round's work beside its weight loads, on x (the loaded words folded):
 * with ACT the activations as k_act32::load reads them (values at ib * 64
 * + 16 (p / 2) + 4 (p % 2) ints and 8 ints on, (d, sum) at ib * 8 + 2 (p /
 * 2) floats; stored here as 16 + 4 pieces a block) from x4, then pad
 * multiply-adds in the 4 chains c. Returns x with the activations folded. */
template <int ACT>
__device__ __forceinline__ unsigned round_work(unsigned x, int ib, int p, int nb, const int4 *x4, int pad,
                                               unsigned (&c)[4])
{
    if (ACT) {
        const int v = ib * 16 + 4 * (p / 2) + (p % 2), d = nb * 16 + ib * 4 + p / 2;
        int4 a = x4[v], b = x4[v + 2], e = x4[d];
        x += (unsigned)(a.x ^ a.w ^ b.y ^ e.z);
    }
    for (int k = 0; k < pad; k += 4) {
        c[0] = c[0] * 1664525u + x;
        c[1] = c[1] * 22695477u + x;
        c[2] = c[2] * 1103515245u + x;
        c[3] = c[3] * 134775813u + x;
    }
    c[0] += x;
    return x;
}

template <int PF, int ACT>
__global__ void __launch_bounds__(WARPS * 32)
probe(const uint8_t *__restrict__ w, int rows, int nb, const int4 *__restrict__ act, int pad, unsigned *out)
{
    extern __shared__ int4 xs[];
    const int lane = threadIdx.x % 32, p = lane % 8;
    const int act16 = nb * 20;   /* 16-byte pieces of the vector: 256 int8 + 8 (d, sum) floats a block */
    if (ACT == 2) {
        for (int i = threadIdx.x; i < act16; i += blockDim.x) xs[i] = act[i];
        __syncthreads();
    }
    const int row = blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= rows) return;
    const uint8_t *r = w + (size_t)row * nb * BLOCK_BYTES;
    const int rounds = (nb + 3) / 4;
    int4 hdr[PF], q[PF];
#pragma unroll
    for (int s = 0; s < PF; s++) {
        int ib = s * 4 + lane / 8;
        if (ib < nb) {
            hdr[s] = *(const int4 *)(r + (size_t)ib * BLOCK_BYTES);
            q[s] = *(const int4 *)(r + (size_t)ib * BLOCK_BYTES + 16 + 16 * p);
        }
    }
    unsigned c[4] = { (unsigned)lane, (unsigned)row, 7, 11 };
    for (int it = 0; it < rounds; it += PF) {
#pragma unroll
        for (int s = 0; s < PF; s++) {
            const int ib = (it + s) * 4 + lane / 8;
            if (it + s < rounds && ib < nb) {
                unsigned x = (unsigned)(hdr[s].x ^ q[s].x ^ q[s].y ^ q[s].z ^ q[s].w);
                const int nx = ib + PF * 4;
                if (nx < nb) {
                    hdr[s] = *(const int4 *)(r + (size_t)nx * BLOCK_BYTES);
                    q[s] = *(const int4 *)(r + (size_t)nx * BLOCK_BYTES + 16 + 16 * p);
                }
                round_work<ACT>(x, ib, p, nb, ACT == 2 ? xs : act, pad, c);
            }
        }
    }
    if ((c[0] ^ c[1] ^ c[2] ^ c[3]) == 0x9e3779b9u) out[0] = c[0];   /* keeps the loads and the chains live */
}

/* The same loads with the work spread flat: the weight's rounds (4 blocks
 * of one row) cut into equal runs, one a warp, over a grid of `ctas` CTAs
 * (so that the warps an SM are what the registers allow, not what the
 * rows give); a warp crossing a row's end sums its lanes (5 shuffles) and
 * stores, as a kernel that writes partial rows would. PF 1. */
template <int ACT>
__global__ void __launch_bounds__(WARPS * 32)
probe_flat(const uint8_t *__restrict__ w, int rows, int nb, const int4 *__restrict__ act, int pad, unsigned *out,
           float *part)
{
    const int lane = threadIdx.x % 32, p = lane % 8;
    const int per_row = nb / 4;
    const long total = (long)rows * per_row, nw = (long)gridDim.x * WARPS;
    const long wi = (long)blockIdx.x * WARPS + threadIdx.x / 32;
    const long r0 = total * wi / nw, r1 = total * (wi + 1) / nw;
    if (r0 >= r1) return;
    int row = (int)(r0 / per_row), col = (int)(r0 % per_row) * 4 + lane / 8;
    const uint8_t *b = w + ((size_t)row * nb + col) * BLOCK_BYTES;
    int4 hdr = *(const int4 *)b, q = *(const int4 *)(b + 16 + 16 * p);
    unsigned c[4] = { (unsigned)lane, (unsigned)row, 7, 11 };
    float sum = 0.0f;
    for (long r = r0; r < r1; r++) {
        unsigned x = (unsigned)(hdr.x ^ q.x ^ q.y ^ q.z ^ q.w);
        const int ib = col;
        b += 4 * BLOCK_BYTES;   /* the rows are contiguous: the next round is 4 blocks on */
        if (r + 1 < r1) {
            hdr = *(const int4 *)b;
            q = *(const int4 *)(b + 16 + 16 * p);
        }
        x = round_work<ACT>(x, ib, p, nb, act, pad, c);
        sum += (float)(x & 255);
        col += 4;
        if (col >= nb || r + 1 == r1) {   /* the row's end or the run's: a partial row's sum */
            for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (lane == 0) part[row] = sum;
            sum = 0.0f;
            col -= nb;
            row++;
        }
    }
    if ((c[0] ^ c[1] ^ c[2] ^ c[3]) == 0x9e3779b9u) out[0] = c[0];
}

struct shape {
    const char *name;
    int rows, nb;
};

/* us a launch: the best of 3 runs of 4 x COPIES launches, launch(i)
 * queuing one on weight copy i (after one launch on each as a warm-up). */
template <class F>
static double time_launches(F launch)
{
    for (int i = 0; i < COPIES; i++) launch(i);
    CHECK(cudaGetLastError());
    cudaEvent_t e0, e1;
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    const int reps = 4 * COPIES;
    float best = 1e30f;
    for (int t = 0; t < 3; t++) {
        CHECK(cudaEventRecord(e0));
        for (int i = 0; i < reps; i++) launch(i % COPIES);
        CHECK(cudaEventRecord(e1));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        if (ms < best) best = ms;
    }
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    return best * 1e3 / reps;
}

template <int PF, int ACT>
static void run(const shape &sh, uint8_t *const *w, const int4 *act, int pad, unsigned *out)
{
    const int ctas = (sh.rows + WARPS - 1) / WARPS;
    const size_t smem = ACT == 2 ? (size_t)sh.nb * 20 * 16 : 0;
    if (smem > 48 * 1024)
        CHECK(cudaFuncSetAttribute(probe<PF, ACT>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
    int per_sm = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, probe<PF, ACT>, WARPS * 32, smem));
    cudaFuncAttributes fa;
    CHECK(cudaFuncGetAttributes(&fa, probe<PF, ACT>));
    const double us = time_launches([&](int i) {
        probe<PF, ACT><<<ctas, WARPS * 32, smem>>>(w[i], sh.rows, sh.nb, act, pad, out);
    });
    const double bytes = (double)sh.rows * sh.nb * BLOCK_BYTES;
    static const char *acts[] = { "none", "global", "shared" };
    printf("%-8s %6d x %3d  PF %d  act %-6s  pad %3d  regs %3d  CTAs/SM %2d  %8.2f us  %7.0f GB/s\n", sh.name,
           sh.rows, sh.nb, PF, acts[ACT], pad, fa.numRegs, per_sm, us, bytes / us / 1e3);
}

/* probe_flat on `per_sm` CTAs an SM (at most what its registers allow) */
template <int ACT>
static void run_flat(const shape &sh, uint8_t *const *w, const int4 *act, int pad, unsigned *out, float *part,
                     int per_sm, int sms)
{
    int most = 0;
    CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&most, probe_flat<ACT>, WARPS * 32, 0));
    if (per_sm > most) return;
    cudaFuncAttributes fa;
    CHECK(cudaFuncGetAttributes(&fa, probe_flat<ACT>));
    const int ctas = per_sm * sms;
    const double us = time_launches([&](int i) {
        probe_flat<ACT><<<ctas, WARPS * 32>>>(w[i], sh.rows, sh.nb, act, pad, out, part);
    });
    const double bytes = (double)sh.rows * sh.nb * BLOCK_BYTES;
    static const char *acts[] = { "none", "global", "shared" };
    printf("%-8s %6d x %3d  flat  act %-6s  pad %3d  regs %3d  CTAs/SM %2d  %8.2f us  %7.0f GB/s\n", sh.name,
           sh.rows, sh.nb, acts[ACT], pad, fa.numRegs, per_sm, us, bytes / us / 1e3);
}

template <int ACT>
static void run_pfs(const shape &sh, uint8_t *const *w, const int4 *act, int pad, unsigned *out)
{
    run<1, ACT>(sh, w, act, pad, out);
    run<2, ACT>(sh, w, act, pad, out);
    run<4, ACT>(sh, w, act, pad, out);
}

int main(int argc, char **argv)
{
    /* the 7B's one-row products: down (a single wave), o, gate and up together */
    const shape shapes[] = { { "down", 4096, 56 }, { "o", 4096, 16 }, { "gate/up", 28672, 16 } };
    size_t most = 0;
    for (const shape &sh : shapes) {
        size_t b = (size_t)sh.rows * sh.nb * BLOCK_BYTES;
        if (b > most) most = b;
    }
    uint8_t *w[COPIES];
    for (int i = 0; i < COPIES; i++) {
        CHECK(cudaMalloc(&w[i], most));
        CHECK(cudaMemset(w[i], 0x5a + i, most));
    }
    int4 *act;
    CHECK(cudaMalloc(&act, (size_t)56 * 20 * 16));
    CHECK(cudaMemset(act, 0x11, (size_t)56 * 20 * 16));
    unsigned *out;
    CHECK(cudaMalloc(&out, sizeof(unsigned)));
    cudaDeviceProp prop;
    CHECK(cudaGetDeviceProperties(&prop, 0));
    printf("cuda-probe: %s, %d SMs, %.0f MB of L2\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize / 1e6);
    float *part;
    CHECK(cudaMalloc(&part, 28672 * sizeof(float)));
    if (argc > 1 && argv[1][0] == 'f') {   /* "flat": rows a warp against runs a warp */
        for (const shape &sh : shapes) {
            for (int pad : { 0, 64 }) {
                const int a = pad ? 1 : 0;
                if (a) run<1, 1>(sh, w, act, pad, out);
                else run<1, 0>(sh, w, act, pad, out);
                for (int per_sm : { 8, 10, 12, 14, 16 }) {
                    if (a) run_flat<1>(sh, w, act, pad, out, part, per_sm, prop.multiProcessorCount);
                    else run_flat<0>(sh, w, act, pad, out, part, per_sm, prop.multiProcessorCount);
                }
            }
        }
        return 0;
    }
    for (const shape &sh : shapes) {
        for (int pad : { 0, 64 }) {
            run_pfs<0>(sh, w, act, pad, out);
            run_pfs<1>(sh, w, act, pad, out);
            run_pfs<2>(sh, w, act, pad, out);
        }
    }
    for (int i = 0; i < COPIES; i++) CHECK(cudaFree(w[i]));
    CHECK(cudaFree(act));
    CHECK(cudaFree(out));
    CHECK(cudaFree(part));
    return 0;
}
