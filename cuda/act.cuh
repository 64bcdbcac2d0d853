/* The gated activations of the feed-forward, as the CPU computes them
 * (src/cpu/vec.c): shared by the elementwise kernels (ops.cu) and the
 * quantizer that folds them into the down product's input (matmul.cu). */
#ifndef LUMA_CUDA_ACT_CUH
#define LUMA_CUDA_ACT_CUH

/* GELU, tanh approximation. */
static __device__ __forceinline__ float act_gelu(float x)
{
    const float k = 0.7978845608028654f; /* sqrt(2 / pi) */
    return 0.5f * x * (1.0f + tanhf(k * (x + 0.044715f * x * x * x)));
}

/* act(gate) * up for LUMA_ACT_GELU (0) or LUMA_ACT_SILU (1). */
template <int ACT>
static __device__ __forceinline__ float act_gated(float gate, float up)
{
    if (ACT == 0) return act_gelu(gate) * up;
    return gate / (1.0f + expf(-gate)) * up;
}

#endif
