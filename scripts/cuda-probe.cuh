/* What the standalone probes (scripts/cuda-probe*.cu) share: a CUDA call
 * checked, and a recorded chain of kernels replayed and timed. */
#ifndef LUMA_CUDA_PROBE_CUH
#define LUMA_CUDA_PROBE_CUH

#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>

#define CHECK(x)                                                                                                    \
    do {                                                                                                           \
        cudaError_t e_ = (x);                                                                                      \
        if (e_ != cudaSuccess) {                                                                                   \
            fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));                    \
            exit(1);                                                                                               \
        }                                                                                                          \
    } while (0)

/* us a kernel of graph g, a chain of `kernels` launches captured on s:
 * replayed 3 times to warm up, then timed over reps replays. Destroys g. */
static float graph_us(cudaStream_t s, cudaGraph_t g, int reps, int kernels)
{
    cudaGraphExec_t ge;
    cudaEvent_t e0, e1;
    CHECK(cudaGraphInstantiate(&ge, g, 0));
    CHECK(cudaEventCreate(&e0));
    CHECK(cudaEventCreate(&e1));
    for (int i = 0; i < 3; i++) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e0, s));
    for (int i = 0; i < reps; i++) CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(e1, s));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    CHECK(cudaEventDestroy(e0));
    CHECK(cudaEventDestroy(e1));
    CHECK(cudaGraphExecDestroy(ge));
    CHECK(cudaGraphDestroy(g));
    return ms * 1000.0f / (float)(reps * kernels);
}

#endif
