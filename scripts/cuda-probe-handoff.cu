/* What a kernel boundary costs in a recorded chain, and whether a flag
 * polled in memory hands over faster than the programmatic launch's wait.
 *
 * A chain of N kernels, recorded in a CUDA graph and replayed; kernel k
 * reads one word that kernel k - 1's CTAs wrote and writes its own, so
 * every kernel depends on the one before, as a decode step's do. Each
 * kernel's CTAs do W rounds of dependent integer work (about 30 cycles
 * each) after the handoff, so that a kernel holds the chain for a set
 * time. Handoffs:
 *   plain  ordinary launches (the stream's order);
 *   pdl    programmatic dependent launch as the engine's kernels use it
 *          (cuda/launch.cuh): griddepcontrol.wait, then launch_dependents;
 *   flag   programmatic launch for placement only: launch_dependents at
 *          once, then the CTAs poll kernel k - 1's count of finished CTAs
 *          (ld.acquire.gpu) until it reaches that kernel's grid, and each
 *          CTA, once done, adds itself to kernel k's count (red.release.gpu).
 *          Sound where every CTA of the kernel before is placed before any
 *          CTA of this one polls: launch_dependents releases the next
 *          kernel only once every CTA of this one has run it. The counts
 *          are zeroed by a memset at the graph's start.
 * Printed: us a kernel (the chain's time over N) for each handoff, grid
 * size and work. Nothing here is engine code: it asks the hardware one
 * question (cuda/NOTES.md, "A decode step's chain, traced").
 *
 * nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/probe-handoff scripts/cuda-probe-handoff.cu */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#include "cuda-probe.cuh"

#define N 512

enum { PLAIN, PDL, FLAG };

static __device__ __forceinline__ unsigned ld_acquire(const unsigned *p)
{
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

static __device__ __forceinline__ void red_release(unsigned *p, unsigned v)
{
    asm volatile("red.release.gpu.global.add.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

template <int MODE>
static __global__ void link(int k, const unsigned *data_in, unsigned *data_out, unsigned *counts, unsigned prev_ctas,
                            int work)
{
    if (MODE == PDL) {
        asm volatile("griddepcontrol.wait;" ::: "memory");
        asm volatile("griddepcontrol.launch_dependents;");
    } else if (MODE == FLAG) {
        asm volatile("griddepcontrol.launch_dependents;");
        if (k > 0) {
            if (threadIdx.x == 0)
                while (ld_acquire(counts + k - 1) < prev_ctas) {
                }
            __syncthreads();
        }
    }
    unsigned v = data_in[blockIdx.x % prev_ctas] + threadIdx.x;
    for (int i = 0; i < work; i++) v = v * 1664525u + 1013904223u + (v >> 7);
    __syncthreads();
    if (threadIdx.x == 0) {
        data_out[blockIdx.x] = v;
        if (MODE == FLAG) red_release(counts + k, 1u);
    }
}

template <int MODE>
static void record(cudaStream_t s, unsigned **bufs, unsigned *counts, unsigned ctas, int work)
{
    for (int k = 0; k < N; k++) {
        cudaLaunchConfig_t cfg = {};
        cudaLaunchAttribute attr;
        cfg.gridDim = ctas;
        cfg.blockDim = 128;
        cfg.stream = s;
        attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attr.val.programmaticStreamSerializationAllowed = MODE != PLAIN;
        cfg.attrs = &attr;
        cfg.numAttrs = 1;
        CHECK(cudaLaunchKernelEx(&cfg, link<MODE>, k, (const unsigned *)bufs[k % 2], bufs[(k + 1) % 2], counts,
                                 k == 0 ? ctas : ctas, work));
    }
}

static float run(int mode, unsigned ctas, int work)
{
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    unsigned *bufs[2], *counts;
    CHECK(cudaMalloc(&bufs[0], 4096 * sizeof(unsigned)));
    CHECK(cudaMalloc(&bufs[1], 4096 * sizeof(unsigned)));
    CHECK(cudaMalloc(&counts, N * sizeof(unsigned)));
    CHECK(cudaMemset(bufs[0], 0, 4096 * sizeof(unsigned)));
    CHECK(cudaMemset(bufs[1], 0, 4096 * sizeof(unsigned)));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    CHECK(cudaMemsetAsync(counts, 0, N * sizeof(unsigned), s));
    if (mode == PLAIN) record<PLAIN>(s, bufs, counts, ctas, work);
    else if (mode == PDL) record<PDL>(s, bufs, counts, ctas, work);
    else record<FLAG>(s, bufs, counts, ctas, work);
    CHECK(cudaStreamEndCapture(s, &g));
    const float us = graph_us(s, g, 10, N);
    cudaFree(bufs[0]);
    cudaFree(bufs[1]);
    cudaFree(counts);
    cudaStreamDestroy(s);
    return us;
}

int main(void)
{
    static const unsigned grids[] = { 1, 8, 132, 1024 };
    static const int works[] = { 0, 64, 512 };
    printf("%8s %6s %10s %10s %10s   (us a kernel, %d kernels a graph)\n", "CTAs", "work", "plain", "pdl", "flag", N);
    for (unsigned gi = 0; gi < sizeof grids / sizeof grids[0]; gi++)
        for (unsigned wi = 0; wi < sizeof works / sizeof works[0]; wi++) {
            const unsigned ctas = grids[gi];
            const int work = works[wi];
            printf("%8u %6d %10.2f %10.2f %10.2f\n", ctas, work, run(PLAIN, ctas, work), run(PDL, ctas, work),
                   run(FLAG, ctas, work));
        }
    return 0;
}
