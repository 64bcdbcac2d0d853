/* The f16 route for Q4_K products at 16 and 32 activation rows, timed
 * alone (scripts/cuda-probe.sh f16). mmv_tc multiplies the tile copy's
 * 4-bit values as int8 on mma.sync.m16n8k32 and scales each sub-block's
 * integer sums per activation row: about 800 instructions a superblock and
 * warp at 32 rows, which bounds it there (cuda/NOTES.md, "Tried and not
 * kept: mmv_tc's products streamed by a persistent grid"). Here a warp
 * makes the f16 weights d sc q - dmin m of its 16 rows once (a byte
 * permute, a subtract and a fused multiply-add a pair) and feeds them to
 * mma.sync.m16n8k16 (f16 in, f32 out) against every n8 tile of f16
 * activations, so the scaling is paid once a weight instead of once a
 * sub-block and activation row.
 *
 * The kernel: a persistent grid, a CTA of 8 warps an SM; the activations
 * of a k range (KR superblocks) staged once a CTA in shared memory (rows
 * padded by 32 bytes: a quarter warp's 8-byte loads of 8 rows fall in
 * distinct banks); CTA c takes k range c % nkr and its tiles of 16 rows
 * in turn; warp w the range's superblocks w, w + 8, ...; each warp's lane
 * 0 brings its next tile-copy units (2,304 bytes: 16 rows' headers, then
 * four 512-byte chunks of quants, lane 4 g + t's 16 bytes at 16 lane) into
 * two buffers by bulk copies; a tile's warps add their sums in shared
 * memory and write one partial product per k range (what a real kernel
 * would add up in a fixed order); tcf_w instead gives each warp tiles of
 * its own. The weights' bytes are random: only the time counts. Prints us
 * a launch and the weights' GB/s, the weights cold in L2 (copies
 * rotated). */
#include <cuda_fp16.h>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define W 8
#define DEPTH 2
#define UNIT 2304
#define BARS 1024

static __device__ __forceinline__ void mbar_init(uint64_t *b)
{
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"((uint32_t)__cvta_generic_to_shared(b)) : "memory");
}
static __device__ __forceinline__ void mbar_expect(uint64_t *b, uint32_t bytes)
{
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"((uint32_t)__cvta_generic_to_shared(b)),
                 "r"(bytes)
                 : "memory");
}
static __device__ __forceinline__ void mbar_wait(uint64_t *b, uint32_t parity)
{
    asm volatile("{\n.reg .pred p;\nWAIT_%=:\n"
                 "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
                 "@!p bra WAIT_%=;\n}" ::"r"((uint32_t)__cvta_generic_to_shared(b)),
                 "r"(parity)
                 : "memory");
}
static __device__ __forceinline__ void bulk_copy(void *dst, const void *src, uint32_t bytes, uint64_t *bar)
{
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     (uint32_t)__cvta_generic_to_shared(dst)),
                 "l"(src), "r"(bytes), "r"((uint32_t)__cvta_generic_to_shared(bar))
                 : "memory");
}
static __device__ __forceinline__ int4 lds16(const void *p)
{
    int4 v;
    asm volatile("ld.shared.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"((uint32_t)__cvta_generic_to_shared(p)));
    return v;
}
static __device__ __forceinline__ uint2 lds8(const void *p)
{
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"((uint32_t)__cvta_generic_to_shared(p)));
    return v;
}
static __device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* the f16 pair s n + o of the two nibble bytes of n that sel picks: the
 * byte under 0x64 is the f16 of 1024 + n, less 1024 exactly; then one
 * rounding */
static __device__ __forceinline__ uint32_t deq(uint32_t n, uint32_t sel, __half2 s, __half2 o)
{
    uint32_t h = __byte_perm(n, 0x64646464u, sel);
    __half2 q = __hsub2(*(const __half2 *)&h, __half2(__ushort_as_half(0x6400), __ushort_as_half(0x6400)));
    __half2 r = __hfma2(q, s, o);
    return *(const uint32_t *)&r;
}

/* Superblock i of the staged k range (activations xs, rows ld halves
 * apart) times the unit's 16 rows (headers h0 and h1 of rows g and g + 8,
 * the thread's quant words q), added to acc. */
template <int NT>
static __device__ __forceinline__ void sb_mul(const int4 &h0, const int4 &h1, const int4 (&q)[4], const __half *xs,
                                              int ld, int i, int g, int t, float (&acc)[NT][4])
{
    const int4 hd[2] = { h0, h1 };
    uint32_t sc[2][2], mn[2][2];
    float d[2], dm[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        const uint32_t y = hd[r].y, z = hd[r].z, ww = hd[r].w;
        sc[r][0] = y & 0x3F3F3F3Fu;
        mn[r][0] = z & 0x3F3F3F3Fu;
        sc[r][1] = (ww & 0x0F0F0F0Fu) | ((y >> 2) & 0x30303030u);
        mn[r][1] = ((ww >> 4) & 0x0F0F0F0Fu) | ((z >> 2) & 0x30303030u);
        d[r] = __half2float(__ushort_as_half((uint16_t)(hd[r].x & 0xffff)));
        dm[r] = __half2float(__ushort_as_half((uint16_t)((uint32_t)hd[r].x >> 16)));
    }
    const __half *xb = xs + (size_t)g * ld + i * 256 + 4 * t;
#pragma unroll
    for (int s = 0; s < 8; s++) {
        __half2 S[2], O[2];
#pragma unroll
        for (int r = 0; r < 2; r++) {
            const float scv = (float)((sc[r][s / 4] >> (8 * (s % 4))) & 0xFF);
            const float mnv = (float)((mn[r][s / 4] >> (8 * (s % 4))) & 0xFF);
            S[r] = __float2half2_rn(d[r] * scv);
            O[r] = __float2half2_rn(-dm[r] * mnv);
        }
        const int j = s / 2, sh = 4 * (s % 2);
#pragma unroll
        for (int p = 0; p < 2; p++) {
            const uint32_t wg = (uint32_t)(p ? q[j].y : q[j].x), wh = (uint32_t)(p ? q[j].w : q[j].z);
            const uint32_t ng = (wg >> sh) & 0x0F0F0F0Fu, nh = (wh >> sh) & 0x0F0F0F0Fu;
            const uint32_t a[4] = { deq(ng, 0x4140u, S[0], O[0]), deq(nh, 0x4140u, S[1], O[1]),
                                    deq(ng, 0x4342u, S[0], O[0]), deq(nh, 0x4342u, S[1], O[1]) };
#pragma unroll
            for (int n = 0; n < NT; n++) {
                const uint2 bv = lds8(xb + (size_t)(8 * n) * ld + 32 * s + 16 * p);
                mma16816(acc[n], a, bv.x, bv.y);
            }
        }
    }
}

/* The 8 NT activation rows' superblocks sb0 .. sb0 + kr_sb - 1 (x: rows of
 * nb superblocks) into xs (rows ld halves apart) by thread 0's bulk
 * copies on mbarrier bar[0]; every thread waits for them. */
template <int NT>
static __device__ __forceinline__ void stage_acts(uint64_t *bar, __half *xs, int ld, const __half *x, int nb, int sb0,
                                                  int kr_sb)
{
    if (threadIdx.x == 0) {
        mbar_expect(&bar[0], (uint32_t)(8 * NT * kr_sb * 512));
        for (int r = 0; r < 8 * NT; r++)
            bulk_copy(xs + (size_t)r * ld, x + (size_t)r * nb * 256 + sb0 * 256, kr_sb * 512, &bar[0]);
    }
    mbar_wait(&bar[0], 0);
}

/* Takes a warp's unit in buffer b of its two (their parities in phase):
 * waits for its copy, reads the thread's share (the headers of rows g and
 * g + 8, its quant words), and where more units follow hands the buffer to
 * lane 0's next copy (fetch); b moves to the other buffer. */
template <class F>
static __device__ __forceinline__ void take_unit(uint64_t *wb, const uint8_t *buf, int &b, uint32_t &phase, int g,
                                                 int lane, bool more, F &fetch, int4 &h0, int4 &h1, int4 (&q)[4])
{
    mbar_wait(&wb[b], (phase >> b) & 1);
    phase ^= 1u << b;
    const uint8_t *un = buf + b * UNIT;
    h0 = lds16(un + 16 * g);
    h1 = lds16(un + 16 * (g + 8));
#pragma unroll
    for (int j = 0; j < 4; j++) q[j] = lds16(un + 256 + 512 * j + 16 * lane);
    __syncwarp();
    if (lane == 0 && more) {
        asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        fetch(b);
    }
    b ^= 1;
}

template <int NT>
__global__ void __launch_bounds__(W * 32, 1)
    tcf(const uint8_t *__restrict__ w, int tiles, int nb, const __half *__restrict__ x, int m, int kr_sb, int nkr,
        float *__restrict__ out, int rows)
{
    extern __shared__ __align__(128) uint8_t sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int ld = kr_sb * 256 + 16;   /* halves */
    uint64_t *bar = (uint64_t *)sm, *wb = bar + 1 + DEPTH * warp;
    float(*red)[W][NT * 4][32] = (float(*)[W][NT * 4][32])(sm + BARS);
    __half *xs = (__half *)(sm + BARS + 2 * sizeof(float) * W * NT * 4 * 32);
    uint8_t *buf = (uint8_t *)(xs + 8 * NT * ld) + warp * DEPTH * UNIT;
    const int kr = blockIdx.x % nkr, c0 = blockIdx.x / nkr, cstep = gridDim.x / nkr, sb0 = kr * kr_sb;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 1 + DEPTH * W; i++) mbar_init(&bar[i]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int iu = c0, ii = warp;   /* the next unit to fetch: tile iu, the range's superblock ii */
    auto fetch = [&](int b) {
        mbar_expect(&wb[b], UNIT);
        bulk_copy(buf + b * UNIT, w + ((size_t)iu * nb + sb0 + ii) * UNIT, UNIT, &wb[b]);
        ii += W;
        if (ii >= kr_sb) {
            ii = warp;
            iu += cstep;
        }
    };
    if (lane == 0 && warp < kr_sb)
        for (int b = 0; b < DEPTH && iu < tiles; b++) fetch(b);
    stage_acts<NT>(bar, xs, ld, x, nb, sb0, kr_sb);
    uint32_t phase = 0;
    int b = 0, pb = 0;
    for (int u = c0; u < tiles; u += cstep, pb ^= 1) {
        float acc[NT][4] = {};
        for (int i = warp; i < kr_sb; i += W) {
            int4 h0, h1, q[4];
            take_unit(wb, buf, b, phase, g, lane, iu < tiles, fetch, h0, h1, q);
            sb_mul<NT>(h0, h1, q, xs, ld, i, g, t, acc);
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int k = 0; k < 4; k++) red[pb][warp][4 * n + k][lane] = acc[n][k];
        __syncthreads();
        const int rr = threadIdx.x % 16;
        for (int jj = threadIdx.x / 16; jj < 8 * NT; jj += W * 2) {
            const int k = 4 * (jj / 8) + 2 * (rr / 8) + jj % 2, l = 4 * (rr % 8) + (jj % 8) / 2;
            float v = 0.0f;
#pragma unroll
            for (int ww = 0; ww < W; ww++) v += red[pb][ww][k][l];
            if (jj < m) out[((size_t)kr * m + jj) * rows + (size_t)u * 16 + rr] = v;
        }
    }
}

/* The same multiply with a warp a tile instead of a CTA a tile: CTA c on
 * k range c % nkr, its warp w on tiles (c / nkr) 8 + w, + 8 (gridDim.x /
 * nkr), ..., all of the range's superblocks of a tile in turn, its partial
 * product written from its registers (no shared sums, no barrier); a
 * range's activations staged once a CTA as above. Smaller ranges stage
 * fewer activation bytes a CTA (and more CTAs fit an SM) for more partial
 * products. */
template <int NT>
__global__ void __launch_bounds__(W * 32)
    tcf_w(const uint8_t *__restrict__ w, int tiles, int nb, const __half *__restrict__ x, int m, int kr_sb, int nkr,
          float *__restrict__ out, int rows)
{
    extern __shared__ __align__(128) uint8_t sm[];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const int ld = kr_sb * 256 + 16;
    uint64_t *bar = (uint64_t *)sm, *wb = bar + 1 + DEPTH * warp;
    __half *xs = (__half *)(sm + BARS);
    uint8_t *buf = (uint8_t *)(xs + 8 * NT * ld) + warp * DEPTH * UNIT;
    const int kr = blockIdx.x % nkr, c0 = blockIdx.x / nkr, wstep = (gridDim.x / nkr) * W, sb0 = kr * kr_sb;
    if (threadIdx.x == 0) {
        for (int i = 0; i < 1 + DEPTH * W; i++) mbar_init(&bar[i]);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    int iu = c0 * W + warp, ii = 0;
    auto fetch = [&](int b) {
        mbar_expect(&wb[b], UNIT);
        bulk_copy(buf + b * UNIT, w + ((size_t)iu * nb + sb0 + ii) * UNIT, UNIT, &wb[b]);
        if (++ii == kr_sb) {
            ii = 0;
            iu += wstep;
        }
    };
    if (lane == 0)
        for (int b = 0; b < DEPTH && iu < tiles; b++) fetch(b);
    stage_acts<NT>(bar, xs, ld, x, nb, sb0, kr_sb);
    uint32_t phase = 0;
    int b = 0;
    for (int u = c0 * W + warp; u < tiles; u += wstep) {
        float acc[NT][4] = {};
        for (int i = 0; i < kr_sb; i++) {
            int4 h0, h1, q[4];
            take_unit(wb, buf, b, phase, g, lane, iu < tiles, fetch, h0, h1, q);
            sb_mul<NT>(h0, h1, q, xs, ld, i, g, t, acc);
        }
#pragma unroll
        for (int n = 0; n < NT; n++)
#pragma unroll
            for (int k = 0; k < 4; k++) {
                const int col = 8 * n + 2 * t + (k & 1), row = 16 * u + g + 8 * (k >> 1);
                if (col < m) out[((size_t)kr * m + col) * rows + row] = acc[n][k];
            }
    }
}

static bool ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return true;
    fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    exit(1);
}

template <int NT>
static void run(int rows, int cols, int m, int kr_sb, int n_sm, bool warp_tiles)
{
    const int nb = cols / 256, tiles = rows / 16, nkr = nb / kr_sb;
    const size_t wbytes = (size_t)tiles * nb * UNIT;
    int copies = (int)((256u << 20) / wbytes) + 2;
    if (copies > 16) copies = 16;
    std::vector<uint8_t *> ws(copies);
    std::vector<uint8_t> host(wbytes);
    for (size_t i = 0; i < wbytes; i++) host[i] = (uint8_t)rand();
    /* headers: d and dmin small normal halves */
    for (size_t u = 0; u < wbytes / UNIT; u++)
        for (int r = 0; r < 16; r++) {
            uint16_t *h = (uint16_t *)&host[u * UNIT + 16 * r];
            h[0] = 0x1800 + (rand() & 0x3ff);
            h[1] = 0x1400 + (rand() & 0x3ff);
        }
    for (int i = 0; i < copies; i++) {
        ok(cudaMalloc(&ws[i], wbytes), "cudaMalloc");
        ok(cudaMemcpy(ws[i], host.data(), wbytes, cudaMemcpyHostToDevice), "copy");
    }
    __half *x;
    float *out;
    std::vector<__half> xh((size_t)8 * NT * cols);
    for (auto &v : xh) v = __float2half((float)(rand() % 2001 - 1000) / 1000.0f);
    ok(cudaMalloc(&x, xh.size() * 2), "cudaMalloc x");
    ok(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice), "copy x");
    ok(cudaMalloc(&out, (size_t)nkr * m * rows * sizeof(float)), "cudaMalloc out");
    const size_t smem = BARS + (warp_tiles ? 0 : 2 * sizeof(float) * W * NT * 4 * 32) +
                        (size_t)8 * NT * (kr_sb * 256 + 16) * 2 + (size_t)W * DEPTH * UNIT;
    if (smem > 227 * 1024) {
        printf("%5d x %5d  m=%2d  k range %2d superblocks: does not fit (%zu bytes)\n", rows, cols, m, kr_sb, smem);
        return;
    }
    auto *fn = warp_tiles ? tcf_w<NT> : tcf<NT>;
    ok(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024), "smem attribute");
    int per_sm = 1;
    ok(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, fn, W * 32, smem), "occupancy");
    const int grid = (n_sm * per_sm / nkr) * nkr;
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    float best = 1e30f;
    for (int rep = 0; rep < 4; rep++) {
        cudaEventRecord(e0);
        const int calls = 32;
        for (int c = 0; c < calls; c++)
            fn<<<grid, W * 32, smem>>>(ws[c % copies], tiles, nb, x, m, kr_sb, nkr, out, rows);
        cudaEventRecord(e1);
        ok(cudaEventSynchronize(e1), "run");
        float ms;
        cudaEventElapsedTime(&ms, e0, e1);
        if (ms / calls < best) best = ms / calls;
    }
    ok(cudaGetLastError(), "launch");
    const double q4k = (double)rows * cols / 256 * 144;
    printf("%5d x %5d  m=%2d  %s  k range %2d superblocks (%2d ranges, %d CTAs an SM): %6.1f us  %5.0f GB/s of "
           "Q4_K\n",
           rows, cols, m, warp_tiles ? "a warp a tile" : "a CTA a tile", kr_sb, nkr, per_sm, best * 1e3,
           q4k / (best * 1e6));
    for (auto p : ws) cudaFree(p);
    cudaFree(x);
    cudaFree(out);
}

int main()
{
    int n_sm = 0;
    ok(cudaDeviceGetAttribute(&n_sm, cudaDevAttrMultiProcessorCount, 0), "device");
    static const struct { int rows, cols; } shapes[] = { { 4096, 4096 }, { 6144, 4096 }, { 28672, 4096 }, { 4096, 14336 } };
    for (auto &s : shapes) {
        const int nb = s.cols / 256;
        for (int kr : { 8, 16 })
            if (nb % kr == 0) run<2>(s.rows, s.cols, 16, kr, n_sm, false);
        for (int kr : { 2, 4, 8 })
            if (nb % kr == 0) run<2>(s.rows, s.cols, 16, kr, n_sm, true);
        run<4>(s.rows, s.cols, 32, 8, n_sm, false);
        for (int kr : { 2, 4, 8 })
            if (nb % kr == 0) run<4>(s.rows, s.cols, 32, kr, n_sm, true);
    }
    return 0;
}
