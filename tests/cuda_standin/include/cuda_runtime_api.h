/* Test-only stand-in for the CUDA runtime API: the subset zoffload uses, executed on the CPU. */
#ifndef ZS_CUDA_RUNTIME_API_H
#define ZS_CUDA_RUNTIME_API_H

#include <stddef.h>

/* Only the stand-in defines it: a test may hold code to answers that only its queue makes exact. */
#define ZS_CUDA_STANDIN 1

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Never installed, never linked into a shipped library (meson option
 * cuda_standin).  Device memory is host memory the stand-in allocated and
 * tracks; streams queue their work and run it only when a synchronisation
 * requires it (tests/cuda_standin/runtime.c says which); kernels run as host
 * code (zs_kernel.h).  Names and meanings follow CUDA; the numeric values do
 * not, and nothing here is ABI-compatible with libcudart.
 */
typedef enum cudaError {
	cudaSuccess = 0,
	cudaErrorInvalidValue,
	cudaErrorMemoryAllocation,
	cudaErrorInitializationError,
	cudaErrorLaunchFailure,
	cudaErrorLaunchTimeout,
	cudaErrorInvalidConfiguration,
	cudaErrorInvalidPitchValue,
	cudaErrorInvalidDevicePointer,
	cudaErrorInvalidMemcpyDirection,
	cudaErrorInsufficientDriver,
	cudaErrorNoDevice,
	cudaErrorInvalidDevice,
	cudaErrorDevicesUnavailable,
	cudaErrorNoKernelImageForDevice,
	cudaErrorInvalidResourceHandle,
	cudaErrorNotReady,
	cudaErrorHostMemoryAlreadyRegistered,
	cudaErrorHostMemoryNotRegistered,
	cudaErrorNotPermitted,
	cudaErrorNotSupported,
	cudaErrorUnknown,
} cudaError_t;

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

/* The legacy default stream, as 0 (NULL) names it. */
#define cudaStreamLegacy ((cudaStream_t)0)
#define cudaStreamDefault 0x00u
#define cudaStreamNonBlocking 0x01u

#define cudaEventDefault 0x00u
#define cudaEventBlockingSync 0x01u
#define cudaEventDisableTiming 0x02u

#define cudaHostRegisterDefault 0x00u
#define cudaHostRegisterPortable 0x01u
#define cudaHostRegisterMapped 0x02u
#define cudaHostRegisterIoMemory 0x04u
#define cudaHostRegisterReadOnly 0x08u

enum cudaMemcpyKind {
	cudaMemcpyHostToHost = 0,
	cudaMemcpyHostToDevice = 1,
	cudaMemcpyDeviceToHost = 2,
	cudaMemcpyDeviceToDevice = 3,
	cudaMemcpyDefault = 4,
};

enum cudaDeviceAttr {
	cudaDevAttrHostRegisterReadOnlySupported = 113,
};

const char *cudaGetErrorName(cudaError_t err);
const char *cudaGetErrorString(cudaError_t err);
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDeviceGetAttribute(int *value, enum cudaDeviceAttr attr, int device);
cudaError_t cudaDeviceSynchronize(void);

cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaMallocHost(void **ptr, size_t size);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaHostRegister(void *ptr, size_t size, unsigned int flags);
cudaError_t cudaHostUnregister(void *ptr);

cudaError_t cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
    cudaStream_t stream);
cudaError_t cudaMemset(void *dev, int value, size_t count);
cudaError_t cudaMemsetAsync(void *dev, int value, size_t count, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);

cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* ---- Stand-in only: what the kernel shim and the tests use ---- */

/*
 * Queues fn(arg) on stream as one piece of device work; drop(arg) (nullable)
 * runs after it, or instead of it if it never runs.  Fails for a stream of
 * another device than the current one, as a launch does.
 */
cudaError_t zs_enqueue(cudaStream_t stream, void (*fn)(void *arg), void (*drop)(void *arg),
    void *arg);
/* Sets this thread's last error (a failed launch); returns err. */
cudaError_t zs_set_error(cudaError_t err);
/* Work queued on every stream and not yet run: lets a test see that nothing ran early. */
size_t zs_pending(void);

#ifdef __cplusplus
}
#endif

#endif
