/* The cost of cuBLAS's first GEMM of each shape, as the engine calls it
 * (matmul.cu, tensor_gemm: f16 weights and activations, f32 out, the "TN"
 * product, a 32 MiB workspace), for Gemma 3 270M's products (640 wide)
 * and the 7B's, at the activation row counts of short chunks. For each
 * row count m, in a new order of shapes, the first call of each shape and
 * then the same call again, each timed on the host to its completion.
 * Prints ms a shape: first, second. `cuda-probe.sh cublas` builds and
 * runs it. */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>

#define CHECK(x)                                                                      \
    do {                                                                              \
        if ((x) != 0) {                                                               \
            fprintf(stderr, "%s:%d: %s failed\n", __FILE__, __LINE__, #x);            \
            exit(1);                                                                  \
        }                                                                             \
    } while (0)

static double now_ms()
{
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct shape {
    const char *name;
    int rows, cols;
};

int main()
{
    static const shape gemma[] = { { "q 1024x640", 1024, 640 },  { "kv 256x640", 256, 640 },
                                   { "o 640x1024", 640, 1024 },  { "gate 2048x640", 2048, 640 },
                                   { "down 640x2048", 640, 2048 } };
    static const shape llama[] = { { "qo 4096x4096", 4096, 4096 }, { "kv 1024x4096", 1024, 4096 },
                                   { "gate 14336x4096", 14336, 4096 }, { "down 4096x14336", 4096, 14336 } };
    static const int ms[] = { 9, 12, 13, 16, 17, 20, 24, 31, 32, 40, 64 };
    cublasHandle_t h;
    CHECK(cublasCreate(&h));
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st));
    void *ws;
    CHECK(cudaMalloc(&ws, 32 << 20));
    CHECK(cublasSetStream(h, st));
    CHECK(cublasSetWorkspace(h, ws, 32 << 20));
    __half *w, *x;
    float *y;
    CHECK(cudaMalloc(&w, (size_t)14336 * 4096 * 2));
    CHECK(cudaMalloc(&x, (size_t)1024 * 14336 * 2));
    CHECK(cudaMalloc(&y, (size_t)1024 * 14336 * 4));
    CHECK(cudaMemset(w, 0, (size_t)14336 * 4096 * 2));
    CHECK(cudaMemset(x, 0, (size_t)1024 * 14336 * 2));
    const float one = 1.0f, zero = 0.0f;
    auto gemm = [&](const shape &s, int m) {
        double t0 = now_ms();
        CHECK(cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, s.rows, m, s.cols, &one, w, CUDA_R_16F, s.cols, x, CUDA_R_16F,
                           s.cols, &zero, y, CUDA_R_32F, s.rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        CHECK(cudaStreamSynchronize(st));
        return now_ms() - t0;
    };
    /* cuBLAS's own first use, on a shape not measured */
    gemm(shape{ "init", 128, 128 }, 128);
    gemm(shape{ "init", 128, 128 }, 128);
    for (int set = 0; set < 2; set++) {
        const shape *ss = set ? llama : gemma;
        const int n = set ? 4 : 5;
        printf("%s shapes: ms of the first call / the second, per m\n", set ? "the 7B's" : "Gemma 3 270M's");
        for (int mi = 0; mi < (int)(sizeof ms / sizeof ms[0]); mi++) {
            double first = 0, second = 0;
            printf("m %2d:", ms[mi]);
            for (int i = 0; i < n; i++) {
                double a = gemm(ss[i], ms[mi]), b = gemm(ss[i], ms[mi]);
                first += a;
                second += b;
                printf("  %s %.3f/%.3f", ss[i].name, a, b);
            }
            printf("  | all %.3f/%.3f\n", first, second);
        }
    }
    /* cublasLt: the heuristic's own cost, then the algorithm it chose for
     * a bucket's largest m reused at other m of the bucket (checked by
     * cublasLtMatmulAlgoCheck): first call and second, ms */
    cublasLtHandle_t lt;
    CHECK(cublasLtCreate(&lt));
    cublasLtMatmulDesc_t op;
    CHECK(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublasOperation_t tA = CUBLAS_OP_T;
    CHECK(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tA, sizeof tA));
    cublasLtMatmulPreference_t pref;
    CHECK(cublasLtMatmulPreferenceCreate(&pref));
    size_t wsb = 32 << 20;
    CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &wsb, sizeof wsb));
    struct lt_layouts {
        cublasLtMatrixLayout_t a, b, c;
    };
    auto layouts = [&](const shape &s, int m) {
        lt_layouts l;
        CHECK(cublasLtMatrixLayoutCreate(&l.a, CUDA_R_16F, s.cols, s.rows, s.cols));
        CHECK(cublasLtMatrixLayoutCreate(&l.b, CUDA_R_16F, s.cols, m, s.cols));
        CHECK(cublasLtMatrixLayoutCreate(&l.c, CUDA_R_32F, s.rows, m, s.rows));
        return l;
    };
    auto drop = [](lt_layouts &l) {
        cublasLtMatrixLayoutDestroy(l.a);
        cublasLtMatrixLayoutDestroy(l.b);
        cublasLtMatrixLayoutDestroy(l.c);
    };
    static const int buckets[][2] = { { 128, 100 }, { 128, 77 }, { 320, 300 }, { 320, 301 }, { 512, 450 },
                                      { 1024, 1000 }, { 64, 40 }, { 24, 17 }, { 16, 13 } };
    for (int set = 0; set < 2; set++) {
        const shape *ss = set ? llama : gemma;
        const int n = set ? 4 : 5;
        printf("cublasLt, %s shapes: heuristic at the bucket's m, ms; then at m: check, first, second; cublasGemmEx at m: first, second\n",
               set ? "the 7B's" : "Gemma 3 270M's");
        for (int bi = 0; bi < (int)(sizeof buckets / sizeof buckets[0]); bi++) {
            const int mb = buckets[bi][0], m = buckets[bi][1];
            double th = 0, tc = 0, t1 = 0, t2 = 0, g1 = 0, g2 = 0;
            for (int i = 0; i < n; i++) {
                lt_layouts lb = layouts(ss[i], mb);
                cublasLtMatmulHeuristicResult_t r;
                int got = 0;
                double t0 = now_ms();
                CHECK(cublasLtMatmulAlgoGetHeuristic(lt, op, lb.a, lb.b, lb.c, lb.c, pref, 1, &r, &got) != 0 || got < 1);
                th += now_ms() - t0;
                drop(lb);
                lt_layouts l = layouts(ss[i], m);
                cublasLtMatmulHeuristicResult_t chk;
                t0 = now_ms();
                CHECK(cublasLtMatmulAlgoCheck(lt, op, l.a, l.b, l.c, l.c, &r.algo, &chk));
                tc += now_ms() - t0;
                for (int k = 0; k < 2; k++) {
                    t0 = now_ms();
                    CHECK(cublasLtMatmul(lt, op, &one, w, l.a, x, l.b, &zero, y, l.c, y, l.c, &r.algo, ws, wsb, st));
                    CHECK(cudaStreamSynchronize(st));
                    (k ? t2 : t1) += now_ms() - t0;
                }
                drop(l);
                g1 += gemm(ss[i], m);
                g2 += gemm(ss[i], m);
            }
            printf("m %4d (bucket %4d): heuristic %.3f; check %.3f, first %.3f, second %.3f | cublasGemmEx %.3f, %.3f\n", m,
                   mb, th, tc, t1, t2, g1, g2);
        }
    }
    return 0;
}
