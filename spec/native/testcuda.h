/* What the GPU tests share beyond testutil.h: the CUDA runtime's headers
 * and a check of a CUDA call. Included only by tests built with the CUDA
 * backend (spec/native/test_cuda*.c). */
#ifndef LUMA_TESTCUDA_H
#define LUMA_TESTCUDA_H

#include <cuda_runtime.h>

#include "testutil.h"

/* CHECKF on a CUDA call's result; true when it succeeded. */
static inline bool cuda_ok(cudaError_t e, const char *what)
{
    if (e == cudaSuccess) return true;
    CHECKF(0, "%s: %s", what, cudaGetErrorString(e));
    return false;
}

#endif
