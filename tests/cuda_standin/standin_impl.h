/* Internal to the CUDA stand-in: what the NCCL half and the kernel executor share with the runtime. */
#ifndef ZS_STANDIN_IMPL_H
#define ZS_STANDIN_IMPL_H

#include <stdbool.h>
#include <stddef.h>

#include "cuda_runtime_api.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The stand-in's state, all under zs__lock (recursive: queued work runs under it). */
#include <pthread.h>
#include <stdint.h>

extern pthread_mutex_t zs__lock;
struct CUstream_st;

/* Failed call: a line on stderr, this thread's last error set; returns e. */
cudaError_t zs__fail(cudaError_t e, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int zs__device_count(void);
void zs__init_legacy(void);
/* NULL is the legacy stream of the current device. */
struct CUstream_st *zs__resolve(cudaStream_t s);
/* Queues fn on s with CUDA's ordering; host/host_len: host memory it touches when it runs. */
uint64_t zs__enqueue(struct CUstream_st *s, void (*fn)(void *), void (*drop)(void *), void *arg,
    const void *host, size_t host_len);
/* Runs s's work up to sequence number seq, and whatever that depends on. */
void zs__run_to(struct CUstream_st *s, uint64_t seq);
/* Runs what the legacy stream would wait for if work were queued on it now. */
void zs__run_legacy_point(int device);
/* Dies when queued work still uses [p, p + len) of host memory. */
void zs__check_no_pending_use(const void *p, size_t len, const char *what);
bool zs__overlaps(const char *a, size_t alen, const char *b, size_t blen);

/* Reports misuse on stderr and aborts: the test that caused it fails loudly. */
void zs__die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
/* true when [p, p + len) lies inside one live device allocation. */
bool zs__is_device_range(const void *p, size_t len);
/* The current device of this thread, and a stream's (NULL: the legacy stream of the current). */
int zs__current_device(void);
int zs__stream_device(cudaStream_t s);
/* Runs all queued work of every stream: cudaDeviceSynchronize for all devices. */
void zs__run_all(void);

/* pins.c: the pages behind a registered range, watched for being replaced (see there). */
struct zs_pin;
struct zs_pin *zs__pin_add(const void *p, size_t len);
/* Dies when the range's pages were punched out of its file while registered. */
void zs__pin_check(const struct zs_pin *pin, const char *what);
void zs__pin_drop(struct zs_pin *pin);

#ifdef __cplusplus
}
#endif

#endif
