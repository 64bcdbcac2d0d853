/* Kernel launches of a step (every .cu file that queues step work), and the
 * asynchronous copies to shared memory (cp.async, the bulk copies and their
 * mbarriers) the kernels share.
 *
 * Programmatic dependent launch (sm_90): every kernel a step queues is
 * launched with cudaLaunchAttributeProgrammaticStreamSerialization, so that
 * its CTAs may be placed on the SMs while the kernel before it on the
 * stream still runs. Such a kernel must call wait_for_previous_kernel
 * before it reads anything an earlier kernel wrote or writes anything an
 * earlier kernel reads: the wait returns once the previous kernel has
 * completed and its writes are visible. Since every kernel of the chain
 * waits so, the previous kernel itself only completed after the one before
 * it, and so on: the order the stream promises holds transitively. Before
 * the wait a kernel may only read what no kernel of the step writes
 * (weights) and compute from it (the matrix-vector kernels issue their
 * first weight loads there). let_next_kernel_start, after the wait, lets
 * the next kernel's CTAs be placed once every CTA of this one has called
 * it (or exited); without it they are placed as this one's CTAs exit.
 *
 * A kernel may also call it before its wait (follow_previous_kernel(true):
 * the quantizers and norms that c->early names). The next kernel's CTAs
 * are then placed, and run up to their own wait, while the kernel before
 * this one may still run: sound by the rule that keeps every kernel's work
 * before its wait off anything a kernel of the step writes. The next
 * kernel's wait still returns only once this one has completed, which is
 * after this one's own wait.
 *
 * Rules that keep this sound:
 * - a kernel launched with luma_launch calls wait_for_previous_kernel on
 *   every path that touches memory, before the first such access (a CTA
 *   with nothing to do may return before it);
 * - kernels outside this file's rules (cuBLAS) are launched the ordinary
 *   way; a kernel after them waits as it would for ours;
 * - LUMA_CUDA_PDL=0 in the environment launches everything the ordinary
 *   way (both calls are then no-ops), for measuring. */
#ifndef LUMA_CUDA_LAUNCH_CUH
#define LUMA_CUDA_LAUNCH_CUH

#include <utility>

#include "cuda_internal.h"

/* LUMA_CUDA_TRACE (a measuring build: -DLUMA_CUDA_TRACE=1 in the CUDA
 * flags): the first and last CTA of every kernel record, at their wait, the
 * global timer when they reached it and when it returned, with the
 * launch's shape (all its CTAs, its threads) and the SM, in a device buffer that the backend made
 * (trace_buf: a record count, then 4 words a record) and writes out when
 * freed, as "@T t0 t1 grid block cta sm" lines to $LUMA_CUDA_TRACE_FILE
 * (scripts/cuda-trace.py reads them). Each file of kernels binds its own
 * copy of the pointer (LUMA_TRACE_TU). */
#define LUMA_TRACE_MAX (1u << 22)
#ifdef LUMA_CUDA_TRACE
static __device__ unsigned long long *trace_buf;
#define LUMA_TRACE_TU(name)                                                                                        \
    extern "C" void luma_cuda_trace_bind_##name(unsigned long long *p)                                            \
    {                                                                                                              \
        cudaMemcpyToSymbol(trace_buf, &p, sizeof p);                                                               \
    }
#else
#define LUMA_TRACE_TU(name)
#endif

static __device__ __forceinline__ void wait_for_previous_kernel()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#ifdef LUMA_CUDA_TRACE
    unsigned long long t0, t1;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
#endif
    asm volatile("griddepcontrol.wait;" ::: "memory");
#ifdef LUMA_CUDA_TRACE
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t1));
    const unsigned ctas = gridDim.x * gridDim.y * gridDim.z,
                   cta = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
    if (trace_buf && threadIdx.x == 0 && threadIdx.y == 0 && (cta == 0 || cta == ctas - 1)) {
        unsigned sm;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
        const unsigned long long i = atomicAdd(trace_buf, 1ull);
        if (i < LUMA_TRACE_MAX) {
            unsigned long long *r = trace_buf + 1 + 4 * i;
            r[0] = t0;
            r[1] = t1;
            r[2] = (unsigned long long)ctas << 32 | blockDim.x * blockDim.y;
            r[3] = (unsigned long long)cta << 32 | sm;
        }
    }
#endif
#endif
}

static __device__ __forceinline__ void let_next_kernel_start()
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

/* A barrier for `threads` threads (whole warps) on named barrier id (1 to
 * 15; 0 is __syncthreads'): teams of warps that wait for each other, not
 * for the rest of the CTA. */
static __device__ __forceinline__ void team_barrier(int id, int threads)
{
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

/* 16 bytes from global to shared memory without passing through registers:
 * src_bytes (0 to 16) of them read, the rest zeros. */
static __device__ __forceinline__ void cp_async16_n(void *dst, const void *src, int src_bytes)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}

/* cp_async16_n of all 16 bytes, or (!valid) of none: zeros. Without
 * cp_async16_n's compiler barrier, so that other accesses may be scheduled
 * across the copy (attention's kernels, built and measured so; the waits
 * are barriers, and so are the __syncwarp and __syncthreads before any read
 * of what was copied). */
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, bool valid)
{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(valid ? 16 : 0));
}

static __device__ __forceinline__ void cp_async_commit(void) { asm volatile("cp.async.commit_group;" ::: "memory"); }

/* Waits until at most N groups of copies are still in flight. */
template <int N>
static __device__ __forceinline__ void cp_async_wait(void)
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* mbarriers for the tensor memory accelerator's copies (matmul.cu's staged
 * kernel, mmq.cu's rings, tall.cu's slabs): a phase completes after
 * `count` arrivals and the bytes they expect. */
static __device__ __forceinline__ void mbar_init(uint64_t *b, int count = 1)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(b)), "r"(count)
                 : "memory");
}

static __device__ __forceinline__ void mbar_expect(uint64_t *b, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(b)), "r"(bytes)
                 : "memory");
}

static __device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity)
{
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}" ::"r"((uint32_t)__cvta_generic_to_shared(b)), "r"(parity)
                 : "memory");
}

/* Orders this thread's earlier shared-memory accesses before the bulk
 * copies that follow (the copy engine is another proxy). */
static __device__ __forceinline__ void fence_proxy_async()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

/* bytes (a multiple of 16) from global src to shared dst (both 16-byte
 * aligned) by one bulk copy, completing on mbarrier bar. */
static __device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"((uint32_t)__cvta_generic_to_shared(dst)), "l"(src), "r"(bytes),
                 "r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
}

/* The first statement of a kernel that fetches nothing ahead of the wait;
 * early: the next kernel may start before this one waits (above). */
static __device__ __forceinline__ void follow_previous_kernel(bool early = false)
{
    if (early) let_next_kernel_start();
    wait_for_previous_kernel();
    if (!early) let_next_kernel_start();
}

/* Attributes a launch configuration holds at most: luma_launch_config's
 * and one more a caller adds (a cluster shape). */
#define LUMA_LAUNCH_ATTRS 3

/* A launch configuration on stream s, a programmatic dependent of the
 * kernel before it when c->pdl, asking for c->carveout's split of shared
 * memory and L1 when set. attr (LUMA_LAUNCH_ATTRS of them) must outlive
 * the launch call; a caller may add one more at attr[cfg.numAttrs++]
 * (mmq's and the clusters' shapes). */
static inline cudaLaunchConfig_t luma_launch_config(const cuda_backend *c, cudaStream_t s, dim3 grid, dim3 block,
                                                    size_t smem, cudaLaunchAttribute *attr)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = s;
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = c->pdl ? 1 : 0;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    if (c->carveout >= 0) {
        attr[1].id = cudaLaunchAttributePreferredSharedMemoryCarveout;
        attr[1].val.sharedMemCarveout = (unsigned)c->carveout;
        cfg.numAttrs = 2;
    }
    return cfg;
}

/* kernel<<<grid, block, smem, s>>>(args...) as a programmatic dependent;
 * the launch error is also left for cudaGetLastError, as <<< >>> leaves it. */
template <typename... P, typename... A>
static inline cudaError_t luma_launch(const cuda_backend *c, cudaStream_t s, dim3 grid, dim3 block, size_t smem,
                                      void (*kernel)(P...), A &&...args)
{
    cudaLaunchAttribute attr[LUMA_LAUNCH_ATTRS];
    cudaLaunchConfig_t cfg = luma_launch_config(c, s, grid, block, smem, attr);
    return cudaLaunchKernelEx(&cfg, kernel, std::forward<A>(args)...);
}

#endif
