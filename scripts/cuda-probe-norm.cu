/* Where a residual norm's time goes in a recorded chain: the residual add,
 * RMSNorm and the Q8_K quantizer of one 4,096-wide row, as the 7B's decode
 * step runs it twice a layer between two products (matmul.cu,
 * norm_quantize).
 *
 * A chain of N kernels, recorded in a CUDA graph with the engine's
 * programmatic launches (griddepcontrol.wait, then launch_dependents) and
 * replayed; kernel k reads as its product output y the row kernel k - 1
 * normalized, and the residual x every kernel adds into, so every kernel
 * depends on the one before. One CTA a kernel unless named. Variants:
 *   copy                  the floor: x and y loaded, x + y stored, a loop;
 *   norm                  the engine's add_rmsnorm_row (cuda/norm.cuh) alone;
 *   quantizer, before     norm_quantize as it was: the norm, out stored, a
 *                         barrier, then per round of 256 units out read back
 *                         and quantized, the block's largest magnitude by a
 *                         butterfly of shuffles (q8k_shuffles);
 *   ..., rounds hoisted   both rounds' units read before either is quantized;
 *   ..., + warp reductions and q8k_warp's redux.sync (cuda/quant8.cuh): the
 *                         engine's norm_quantize now;
 *   x, g before the wait  "before" with x (ld.global.cg) and the gain loaded
 *                         ahead of the wait;
 *   units T ...           a thread owns whole units of 8 (unit t + T f), so
 *                         the quantizer takes its values from registers;
 *                         "norm only" stops before the quantizer; "strided"
 *                         loads float4 t + T f instead (as add_rmsnorm_row),
 *                         "serial" adds the warps' sums in one thread;
 *   cluster C             C CTAs a row (distributed shared memory for the
 *                         sums), x and g before the wait; "g only": x after
 *                         it; "all after": both; "split": the exit barrier
 *                         arrived early (the engine's trial, cuda/NOTES.md).
 * Printed: us a kernel (the chain's time over N), two rounds. Nothing here
 * is engine code: it asks the hardware one question (cuda/NOTES.md, "The
 * residual norm's chain, probed").
 *
 * nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/probe-norm scripts/cuda-probe-norm.cu */
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include <cooperative_groups.h>
namespace cg = cooperative_groups;

#include "../cuda/norm.cuh"
#include "../cuda/quant8.cuh"
#include "cuda-probe.cuh"

#define N 512
#define COLS 4096

static __device__ __forceinline__ void handoff()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;");
}

struct bufs {
    float *x, *g, *out[2];
    int8_t *q;
    float2 *ds;
};

/* q8k_warp as it was before it took warp reductions: a butterfly of
 * shuffles, five dependent rounds of three, for the block's largest
 * magnitude and its lane (the same result) */
static __device__ __forceinline__ float q8k_shuffles(const float v[8], int lane, int iq[8])
{
    float amax = 0.0f, vmax = 0.0f;
#pragma unroll
    for (int j = 0; j < 8; j++)
        if (fabsf(v[j]) > amax) {
            amax = fabsf(v[j]);
            vmax = v[j];
        }
    int from = lane;
    for (int o = 1; o < 32; o *= 2) {
        float a2 = __shfl_xor_sync(0xffffffffu, amax, o), v2 = __shfl_xor_sync(0xffffffffu, vmax, o);
        int f2 = __shfl_xor_sync(0xffffffffu, from, o);
        if (a2 > amax || (a2 == amax && f2 < from)) {
            amax = a2;
            vmax = v2;
            from = f2;
        }
    }
    float iscale = amax == 0.0f ? 0.0f : -127.0f / vmax;
#pragma unroll
    for (int j = 0; j < 8; j++) iq[j] = min(127, __float2int_rn(__fmul_rn(iscale, v[j])));
    return amax == 0.0f ? 0.0f : 1.0f / iscale;
}

static __global__ void __launch_bounds__(NORM_THREADS) k_copy(bufs b, int k)
{
    handoff();
    const float *y = b.out[(k + 1) % 2];
    float *o = b.out[k % 2];
    for (int i = threadIdx.x; i < COLS / 4; i += NORM_THREADS) {
        float4 a = ((float4 *)b.x)[i], c = ((const float4 *)y)[i];
        float4 s = make_float4(a.x + c.x * 1e-3f, a.y + c.y * 1e-3f, a.z + c.z * 1e-3f, a.w + c.w * 1e-3f);
        ((float4 *)b.x)[i] = s;
        ((float4 *)o)[i] = s;
    }
}

static __global__ void __launch_bounds__(NORM_THREADS) k_norm(bufs b, int k)
{
    handoff();
    __shared__ float partial[NORM_THREADS / 32];
    float4 o[4];
    add_rmsnorm_row<4>(b.x, b.out[(k + 1) % 2], NULL, b.g, COLS, 1e-6f, b.out[k % 2], partial, o);
}

/* norm_quantize's quantizer as it was: per round of NORM_THREADS units,
 * the normalized row out read back and quantized (q8k_shuffles) */
static __device__ void quantize_rounds(const float *out, const bufs &b)
{
    const int lane = threadIdx.x % 32;
    for (int u0 = 0; u0 < COLS / 8; u0 += NORM_THREADS) {
        const int u = u0 + threadIdx.x;
        float4 p = ((const float4 *)out)[2 * u], q = ((const float4 *)out)[2 * u + 1];
        float v[8] = { p.x, p.y, p.z, p.w, q.x, q.y, q.z, q.w };
        int iq[8];
        float d = q8k_shuffles(v, lane, iq);
        q8_put(iq, d, u, true, lane, b.q, b.ds);
    }
}

/* A thread owns units t + T f (8 consecutive values each) for the norm
 * and the quantizer alike. */
template <int T, int MODE, int PAT = 0, int RED = 0>
static __global__ void __launch_bounds__(T) k_units(bufs b, int k)
{
    constexpr int U = COLS / 8 / T;
    handoff();
    __shared__ float partial[T / 32];
    const float *y = b.out[(k + 1) % 2];
    float *out = b.out[k % 2];
    float4 a[2 * U], c[2 * U], w[2 * U];
#pragma unroll
    for (int f = 0; f < U; f++) {
        const int u = threadIdx.x + T * f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const int e = PAT ? threadIdx.x + T * (2 * f + h) : 2 * u + h;
            a[2 * f + h] = ((const float4 *)b.x)[e];
            c[2 * f + h] = ((const float4 *)y)[e];
            w[2 * f + h] = ((const float4 *)b.g)[e];
        }
    }
    float ss = 0.0f;
#pragma unroll
    for (int i = 0; i < 2 * U; i++) {
        a[i] = make_float4(a[i].x + c[i].x, a[i].y + c[i].y, a[i].z + c[i].z, a[i].w + c[i].w);
        ss += sq4(a[i]);
    }
#pragma unroll
    for (int f = 0; f < U; f++) {
        const int u = threadIdx.x + T * f;
        ((float4 *)b.x)[PAT ? threadIdx.x + T * 2 * f : 2 * u] = a[2 * f];
        ((float4 *)b.x)[PAT ? threadIdx.x + T * (2 * f + 1) : 2 * u + 1] = a[2 * f + 1];
    }
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
    __syncthreads();
    if (RED) {
        ss = 0.0f;
        for (int i = 0; i < T / 32; i++) ss += partial[i];
    } else {
        ss = threadIdx.x % 32 < T / 32 ? partial[threadIdx.x % 32] : 0.0f;
        for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    }
    const float s = 1.0f / sqrtf(ss / (float)COLS + 1e-6f);
    const int lane = threadIdx.x % 32;
#pragma unroll
    for (int f = 0; f < U; f++) {
        const int u = threadIdx.x + T * f;
        float v[8];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const float4 n = make_float4(a[2 * f + h].x * s * w[2 * f + h].x, a[2 * f + h].y * s * w[2 * f + h].y,
                                         a[2 * f + h].z * s * w[2 * f + h].z, a[2 * f + h].w * s * w[2 * f + h].w);
            ((float4 *)out)[PAT ? threadIdx.x + T * (2 * f + h) : 2 * u + h] = n;
            v[4 * h] = n.x;
            v[4 * h + 1] = n.y;
            v[4 * h + 2] = n.z;
            v[4 * h + 3] = n.w;
        }
        if (MODE == 1) continue;   /* the norm alone */
        int iq[8];
        float d = MODE == 2 ? q8_scale<ACT_Q8_K>(v, lane, iq) : q8k_shuffles(v, lane, iq);
        q8_put(iq, d, u, MODE != 3 || d == 12345.0f, lane, b.q, b.ds);
    }
}

/* norm_quantize: !HOIST as it was (quantize_rounds); HOIST with both
 * rounds' units loaded before either is quantized (the stores of the first
 * round's values may not alias the second round's loads); REDUX:
 * q8k_warp's warp reductions (cuda/quant8.cuh), else the shuffles it had
 * before */
template <bool HOIST, bool REDUX>
static __global__ void __launch_bounds__(NORM_THREADS) k_engine(bufs b, int k)
{
    handoff();
    __shared__ float partial[NORM_THREADS / 32];
    float *out = b.out[k % 2];
    float4 o[4];
    add_rmsnorm_row<4>(b.x, b.out[(k + 1) % 2], NULL, b.g, COLS, 1e-6f, out, partial, o);
    __syncthreads();
    if (!HOIST) {
        quantize_rounds(out, b);
        return;
    }
    const int lane = threadIdx.x % 32;
    constexpr int R = COLS / 8 / NORM_THREADS;
    float4 p[R][2];
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int u = r * NORM_THREADS + threadIdx.x;
        p[r][0] = ((const float4 *)out)[2 * u];
        p[r][1] = ((const float4 *)out)[2 * u + 1];
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        const int u = r * NORM_THREADS + threadIdx.x;
        float v[8] = { p[r][0].x, p[r][0].y, p[r][0].z, p[r][0].w, p[r][1].x, p[r][1].y, p[r][1].z, p[r][1].w };
        int iq[8];
        float d = REDUX ? q8_scale<ACT_Q8_K>(v, lane, iq) : q8k_shuffles(v, lane, iq);
        q8_put(iq, d, u, true, lane, b.q, b.ds);
    }
}

/* engine, with x (from L2: ld.global.cg) and g loaded before the wait:
 * only y is fetched after it */
static __global__ void __launch_bounds__(NORM_THREADS) k_prewait(bufs b, int k)
{
    __shared__ float partial[NORM_THREADS / 32];
    float *out = b.out[k % 2];
    float4 a[4], w[4], c[4];
#pragma unroll
    for (int f = 0; f < 4; f++) {
        a[f] = __ldcg((const float4 *)b.x + threadIdx.x + NORM_THREADS * f);
        w[f] = ((const float4 *)b.g)[threadIdx.x + NORM_THREADS * f];
    }
    handoff();
    const float *y = b.out[(k + 1) % 2];
#pragma unroll
    for (int f = 0; f < 4; f++) c[f] = ((const float4 *)y)[threadIdx.x + NORM_THREADS * f];
    float ss = 0.0f;
#pragma unroll
    for (int f = 0; f < 4; f++) {
        a[f] = make_float4(a[f].x + c[f].x, a[f].y + c[f].y, a[f].z + c[f].z, a[f].w + c[f].w);
        ((float4 *)b.x)[threadIdx.x + NORM_THREADS * f] = a[f];
        ss += sq4(a[f]);
    }
    const float s = block_inv_rms(ss, COLS, 1e-6f, partial);
#pragma unroll
    for (int f = 0; f < 4; f++)
        ((float4 *)out)[threadIdx.x + NORM_THREADS * f] =
            make_float4(a[f].x * s * w[f].x, a[f].y * s * w[f].y, a[f].z * s * w[f].z, a[f].w * s * w[f].w);
    __syncthreads();
    quantize_rounds(out, b);
}

/* A cluster of CL CTAs, each owning COLS / CL columns as whole units of 8
 * (a thread a unit), x and g loaded before the wait; the sum of squares
 * of each CTA reduced in its shared memory, then every CTA adds the CL
 * sums in rank order from distributed shared memory; the quantizer from
 * registers. PRE 0: x and g after the wait too. */
template <int CL, int PRE>
static __global__ void __launch_bounds__(COLS / 8 / CL) k_cluster(bufs b, int k)
{
    constexpr int T = COLS / 8 / CL;
    __shared__ float partial[T / 32 > 0 ? T / 32 : 1];
    __shared__ float cta_ss;
    cg::cluster_group cl = cg::this_cluster();
    const int rank = (int)cl.block_rank();
    const int u = rank * T + threadIdx.x;
    float *out = b.out[k % 2];
    float4 a[2], w[2], c[2];
    if (PRE == 1 || PRE == 3) {
        a[0] = __ldcg((const float4 *)b.x + 2 * u);
        a[1] = __ldcg((const float4 *)b.x + 2 * u + 1);
    }
    if (PRE) {
        w[0] = ((const float4 *)b.g)[2 * u];
        w[1] = ((const float4 *)b.g)[2 * u + 1];
    }
    handoff();
    if (PRE == 0 || PRE == 2) {
        a[0] = ((const float4 *)b.x)[2 * u];
        a[1] = ((const float4 *)b.x)[2 * u + 1];
    }
    if (!PRE) {
        w[0] = ((const float4 *)b.g)[2 * u];
        w[1] = ((const float4 *)b.g)[2 * u + 1];
    }
    const float *y = b.out[(k + 1) % 2];
    c[0] = ((const float4 *)y)[2 * u];
    c[1] = ((const float4 *)y)[2 * u + 1];
    float ss = 0.0f;
#pragma unroll
    for (int h = 0; h < 2; h++) {
        a[h] = make_float4(a[h].x + c[h].x, a[h].y + c[h].y, a[h].z + c[h].z, a[h].w + c[h].w);
        ((float4 *)b.x)[2 * u + h] = a[h];
        ss += sq4(a[h]);
    }
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (T > 32) {
        if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = ss;
        __syncthreads();
        if (threadIdx.x == 0) {
            ss = 0.0f;
            for (int i = 0; i < T / 32; i++) ss += partial[i];
        }
    }
    if (threadIdx.x == 0) cta_ss = ss;
    cl.sync();
    ss = 0.0f;
    for (int r = 0; r < CL; r++) ss += *cl.map_shared_rank(&cta_ss, r);
    if (PRE == 3) asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
    const float s = 1.0f / sqrtf(ss / (float)COLS + 1e-6f);
    const int lane = threadIdx.x % 32;
    float v[8];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const float4 n = make_float4(a[h].x * s * w[h].x, a[h].y * s * w[h].y, a[h].z * s * w[h].z, a[h].w * s * w[h].w);
        ((float4 *)out)[2 * u + h] = n;
        v[4 * h] = n.x;
        v[4 * h + 1] = n.y;
        v[4 * h + 2] = n.z;
        v[4 * h + 3] = n.w;
    }
    int iq[8];
    float d = q8k_shuffles(v, lane, iq);
    q8_put(iq, d, u, true, lane, b.q, b.ds);
    if (PRE == 3) asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
    else cl.sync();   /* no CTA leaves while another may read its sum */
}

enum { COPY, NORM, ENGINE, UNITS256, UNITS512, U512_NORM, U512_REDUX, U512_NOSTORE, U256_REDUX, U256_NORM,
       U256_NORM_STRIDED, U256_NORM_SERIAL, U256_NORM_BOTH, PREWAIT, CL4, CL8, CL16, CL8_POST, CL4_G, CL4_SPLIT, CL2, ENGINE2, ENGINE2_REDUX, VARIANTS };
static const char *names[VARIANTS] = { "copy", "norm", "quantizer, before", "units 256", "units 512",
                                       "units 512, norm only", "units 512, warp reductions",
                                       "units 512, no int8 stores", "units 256, warp reductions",
                                       "units 256, norm only", "units 256, norm only, strided",
                                       "units 256, norm only, serial", "units 256, norm only, strided, serial",
                                       "x, g before the wait", "cluster 4", "cluster 8", "cluster 16",
                                       "cluster 8, all after", "cluster 4, g only", "cluster 4, split",
                                       "cluster 2", "quantizer, rounds hoisted",
                                       "quantizer, rounds hoisted + warp reductions" };

static float run(int v, const bufs &b)
{
    cudaStream_t s;
    CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaGraph_t g;
    CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
    for (int k = 0; k < N; k++) {
        cudaLaunchConfig_t cfg = {};
        cfg.gridDim = 1;
        cfg.blockDim = v == UNITS512 || v == U512_NORM || v == U512_REDUX || v == U512_NOSTORE ? 512 : 256;
        cfg.stream = s;
        cudaLaunchAttribute attrs[2];
        attrs[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attrs[0].val.programmaticStreamSerializationAllowed = 1;
        cfg.attrs = attrs;
        cfg.numAttrs = 1;
        const int cl = v == CL4 || v == CL4_G || v == CL4_SPLIT ? 4 : v == CL2 ? 2 : v == CL8 || v == CL8_POST ? 8 : v == CL16 ? 16 : 0;
        if (cl) {
            cfg.gridDim = cl;
            cfg.blockDim = COLS / 8 / cl;
            attrs[1].id = cudaLaunchAttributeClusterDimension;
            attrs[1].val.clusterDim.x = cl;
            attrs[1].val.clusterDim.y = 1;
            attrs[1].val.clusterDim.z = 1;
            cfg.numAttrs = 2;
        }
        switch (v) {
        case COPY: CHECK(cudaLaunchKernelEx(&cfg, k_copy, b, k)); break;
        case NORM: CHECK(cudaLaunchKernelEx(&cfg, k_norm, b, k)); break;
        case ENGINE: CHECK(cudaLaunchKernelEx(&cfg, k_engine<false, false>, b, k)); break;
        case UNITS256: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 0>, b, k)); break;
        case UNITS512: CHECK(cudaLaunchKernelEx(&cfg, k_units<512, 0>, b, k)); break;
        case U512_NORM: CHECK(cudaLaunchKernelEx(&cfg, k_units<512, 1>, b, k)); break;
        case U512_REDUX: CHECK(cudaLaunchKernelEx(&cfg, k_units<512, 2>, b, k)); break;
        case U512_NOSTORE: CHECK(cudaLaunchKernelEx(&cfg, k_units<512, 3>, b, k)); break;
        case U256_REDUX: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 2>, b, k)); break;
        case U256_NORM: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 1>, b, k)); break;
        case U256_NORM_STRIDED: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 1, 1>, b, k)); break;
        case U256_NORM_SERIAL: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 1, 0, 1>, b, k)); break;
        case U256_NORM_BOTH: CHECK(cudaLaunchKernelEx(&cfg, k_units<256, 1, 1, 1>, b, k)); break;
        case PREWAIT: CHECK(cudaLaunchKernelEx(&cfg, k_prewait, b, k)); break;
        case CL4: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<4, 1>, b, k)); break;
        case CL8: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<8, 1>, b, k)); break;
        case CL16: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<16, 1>, b, k)); break;
        case CL8_POST: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<8, 0>, b, k)); break;
        case CL4_G: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<4, 2>, b, k)); break;
        case CL4_SPLIT: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<4, 3>, b, k)); break;
        case CL2: CHECK(cudaLaunchKernelEx(&cfg, k_cluster<2, 1>, b, k)); break;
        case ENGINE2: CHECK(cudaLaunchKernelEx(&cfg, k_engine<true, false>, b, k)); break;
        default: CHECK(cudaLaunchKernelEx(&cfg, k_engine<true, true>, b, k)); break;
        }
    }
    CHECK(cudaStreamEndCapture(s, &g));
    const float us = graph_us(s, g, 20, N);
    cudaStreamDestroy(s);
    return us;
}

int main(void)
{
    bufs b;
    float *host = (float *)malloc(COLS * sizeof(float));
    srand(1);
    for (int i = 0; i < COLS; i++) host[i] = (float)rand() / RAND_MAX - 0.5f;
    CHECK(cudaMalloc(&b.x, COLS * sizeof(float)));
    CHECK(cudaMalloc(&b.g, COLS * sizeof(float)));
    CHECK(cudaMalloc(&b.out[0], COLS * sizeof(float)));
    CHECK(cudaMalloc(&b.out[1], COLS * sizeof(float)));
    CHECK(cudaMalloc(&b.q, COLS));
    CHECK(cudaMalloc(&b.ds, COLS / 32 * sizeof(float2)));
    CHECK(cudaFuncSetAttribute(k_cluster<16, 1>, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
    printf("%-44s %8s   (us a kernel, %d kernels a graph, a row of %d)\n", "variant", "us", N, COLS);
    for (int round = 0; round < 2; round++)
        for (int v = 0; v < VARIANTS; v++) {
            CHECK(cudaMemcpy(b.x, host, COLS * sizeof(float), cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(b.g, host, COLS * sizeof(float), cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(b.out[0], host, COLS * sizeof(float), cudaMemcpyHostToDevice));
            CHECK(cudaMemcpy(b.out[1], host, COLS * sizeof(float), cudaMemcpyHostToDevice));
            printf("%-44s %8.2f\n", names[v], run(v, b));
        }
    free(host);
    return 0;
}
