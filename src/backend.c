/* Backend selection when the build has no CUDA: asking for it is a clear
 * error. The CUDA build defines these in cuda/. */
#include "backend.h"

#ifndef LUMA_HAVE_CUDA
luma_backend *luma_backend_cuda_new(int device, luma_err *err)
{
    luma_errf(err, "this build of luma has no CUDA backend (rebuild with nvcc available)");
    return NULL;
}

bool luma_backend_cuda_available(void) { return false; }
#endif
