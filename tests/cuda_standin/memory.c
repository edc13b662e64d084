/* CUDA stand-in: device memory, cudaMallocHost, host registration and its munmap check, copies. */
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "standin_impl.h"

struct devmem {
	struct devmem *next;
	char *base;
	size_t len;
	int device;
};

struct hostreg {
	struct hostreg *next;
	char *base;
	size_t len;
	unsigned flags;
	bool owned;			/* cudaMallocHost: freed by cudaFreeHost */
	struct zs_pin *pin;
};

static struct devmem *devmems;
static struct hostreg *hostregs;

/* ---- Device memory ---- */

/* The allocation that holds p, or NULL. */
static struct devmem *
find_dev(const void *p)
{
	for (struct devmem *m = devmems; m != NULL; m = m->next)
		if ((const char *)p >= m->base && (const char *)p < m->base + m->len)
			return m;
	return NULL;
}

bool
zs__is_device_range(const void *p, size_t len)
{
	struct devmem *m;
	bool ok;

	pthread_mutex_lock(&zs__lock);
	m = find_dev(p);
	ok = m != NULL && len <= (size_t)(m->base + m->len - (const char *)p);
	pthread_mutex_unlock(&zs__lock);
	return ok;
}

cudaError_t
cudaMalloc(void **ptr, size_t size)
{
	struct devmem *m;

	if (ptr == NULL)
		return zs__fail(cudaErrorInvalidValue, "cudaMalloc: NULL");
	if (size == 0) {
		*ptr = NULL;
		return cudaSuccess;
	}
	m = calloc(1, sizeof(*m));
	/* 256-byte aligned as cudaMalloc's; never zeroed: all-ones bytes read as NaN. */
	if (m == NULL || size > SIZE_MAX - 255 ||
	    (m->base = aligned_alloc(256, (size + 255) / 256 * 256)) == NULL) {
		free(m);
		return zs__fail(cudaErrorMemoryAllocation, "cudaMalloc(%zu): out of memory", size);
	}
	memset(m->base, 0xff, size);
	m->len = size;
	m->device = zs__current_device();
	pthread_mutex_lock(&zs__lock);
	m->next = devmems;
	devmems = m;
	pthread_mutex_unlock(&zs__lock);
	*ptr = m->base;
	return cudaSuccess;
}

cudaError_t
cudaFree(void *ptr)
{
	struct devmem **pp, *m;

	if (ptr == NULL)
		return cudaSuccess;
	/* An implicit device synchronisation, as CUDA's. */
	zs__run_all();
	pthread_mutex_lock(&zs__lock);
	for (pp = &devmems; *pp != NULL && (*pp)->base != ptr; pp = &(*pp)->next)
		;
	m = *pp;
	if (m == NULL) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorInvalidDevicePointer, "cudaFree(%p): not a cudaMalloc "
		    "pointer (or freed twice)", ptr);
	}
	*pp = m->next;
	pthread_mutex_unlock(&zs__lock);
	free(m->base);
	free(m);
	return cudaSuccess;
}

/* ---- Host memory: cudaMallocHost and registration ---- */

static struct hostreg *
find_reg_overlap(const void *p, size_t len)
{
	for (struct hostreg *h = hostregs; h != NULL; h = h->next)
		if (zs__overlaps(h->base, h->len, p, len))
			return h;
	return NULL;
}

/* The registered or cudaMallocHost range [p, p + len) lies inside, or NULL. */
static struct hostreg *
pinned_range(const void *p, size_t len)
{
	for (struct hostreg *h = hostregs; h != NULL; h = h->next)
		if ((const char *)p >= h->base && (const char *)p < h->base + h->len &&
		    len <= (size_t)(h->base + h->len - (const char *)p))
			return h;
	return NULL;
}

cudaError_t
cudaMallocHost(void **ptr, size_t size)
{
	struct hostreg *h;

	if (ptr == NULL || size == 0)
		return zs__fail(cudaErrorInvalidValue, "cudaMallocHost: bad argument");
	h = calloc(1, sizeof(*h));
	if (h == NULL || size > SIZE_MAX - 4095 ||
	    (h->base = aligned_alloc(4096, (size + 4095) / 4096 * 4096)) == NULL) {
		free(h);
		return zs__fail(cudaErrorMemoryAllocation, "cudaMallocHost(%zu): out of memory", size);
	}
	h->len = size;
	h->owned = true;
	h->flags = cudaHostRegisterPortable;
	h->pin = zs__pin_add(h->base, size);
	pthread_mutex_lock(&zs__lock);
	h->next = hostregs;
	hostregs = h;
	pthread_mutex_unlock(&zs__lock);
	*ptr = h->base;
	return cudaSuccess;
}

/* Removes the registration that starts at ptr and is (not) owned; NULL when there is none. */
static struct hostreg *
take_reg(void *ptr, bool owned)
{
	for (struct hostreg **pp = &hostregs; *pp != NULL; pp = &(*pp)->next) {
		struct hostreg *h = *pp;

		if (h->base == ptr && h->owned == owned) {
			*pp = h->next;
			return h;
		}
	}
	return NULL;
}

cudaError_t
cudaFreeHost(void *ptr)
{
	struct hostreg *h;

	if (ptr == NULL)
		return cudaSuccess;
	zs__run_all();
	pthread_mutex_lock(&zs__lock);
	h = take_reg(ptr, true);
	pthread_mutex_unlock(&zs__lock);
	if (h == NULL)
		return zs__fail(cudaErrorInvalidValue, "cudaFreeHost(%p): not a cudaMallocHost pointer",
		    ptr);
	zs__pin_drop(h->pin);
	free(h->base);
	free(h);
	return cudaSuccess;
}

/*
 * Whether every page of [p, p + len) is mapped, and whether all of it is
 * writable, from /proc/self/maps: registration pins pages that exist, and
 * pages mapped read-only can only be registered with cudaHostRegisterReadOnly.
 */
static cudaError_t
check_mapping(const void *p, size_t len, bool *writable)
{
	uintptr_t want = (uintptr_t)p, end = (uintptr_t)p + len;
	char line[512];
	FILE *f = fopen("/proc/self/maps", "re");

	*writable = true;
	if (f == NULL)
		return cudaErrorUnknown;
	while (want < end && fgets(line, sizeof(line), f) != NULL) {
		uintptr_t lo, hi;
		char perms[8];

		if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %7s", &lo, &hi, perms) != 3)
			continue;
		if (hi <= want)
			continue;
		if (lo > want)
			break;
		if (perms[0] != 'r')
			break;
		if (perms[1] != 'w')
			*writable = false;
		want = hi;
	}
	fclose(f);
	return want >= end ? cudaSuccess : cudaErrorInvalidValue;
}

cudaError_t
cudaHostRegister(void *ptr, size_t size, unsigned int flags)
{
	const unsigned known = cudaHostRegisterPortable | cudaHostRegisterMapped |
	    cudaHostRegisterIoMemory | cudaHostRegisterReadOnly;
	struct hostreg *h;
	bool writable;
	int ro = 0;

	if (ptr == NULL || size == 0 || (flags & ~known) != 0)
		return zs__fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu, 0x%x): bad argument",
		    ptr, size, flags);
	if (find_dev(ptr) != NULL)
		return zs__fail(cudaErrorInvalidValue, "cudaHostRegister(%p): device memory", ptr);
	if (flags & cudaHostRegisterReadOnly) {
		(void)cudaDeviceGetAttribute(&ro, cudaDevAttrHostRegisterReadOnlySupported,
		    zs__current_device());
		if (!ro)
			return zs__fail(cudaErrorNotSupported, "cudaHostRegisterReadOnly: the device "
			    "cannot (ZS_CUDA_NO_READONLY_REGISTER)");
	}
	if (check_mapping(ptr, size, &writable) != cudaSuccess)
		return zs__fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu): not all mapped "
		    "and readable", ptr, size);
	if (!writable && !(flags & cudaHostRegisterReadOnly))
		return zs__fail(cudaErrorInvalidValue, "cudaHostRegister(%p, %zu): read-only pages "
		    "need cudaHostRegisterReadOnly", ptr, size);
	pthread_mutex_lock(&zs__lock);
	if (find_reg_overlap(ptr, size) != NULL) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorHostMemoryAlreadyRegistered, "cudaHostRegister(%p, %zu): "
		    "overlaps a registered range", ptr, size);
	}
	h = calloc(1, sizeof(*h));
	if (h == NULL) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorMemoryAllocation, "out of memory");
	}
	h->base = ptr;
	h->len = size;
	h->flags = flags;
	h->pin = zs__pin_add(ptr, size);
	h->next = hostregs;
	hostregs = h;
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaHostUnregister(void *ptr)
{
	struct hostreg *h;

	pthread_mutex_lock(&zs__lock);
	h = take_reg(ptr, false);
	if (h != NULL) {
		zs__check_no_pending_use(h->base, h->len, "cudaHostUnregister");
		zs__pin_check(h->pin, "cudaHostUnregister");
	}
	pthread_mutex_unlock(&zs__lock);
	if (h == NULL)
		return zs__fail(cudaErrorHostMemoryNotRegistered, "cudaHostUnregister(%p): not the "
		    "start of a registered range", ptr);
	zs__pin_drop(h->pin);
	free(h);
	return cudaSuccess;
}

/*
 * Interposes libc's munmap for the whole process (the stand-in is a shared
 * library loaded before libc): a registered range must be unregistered, and
 * no queued copy may use it, before its pages go.
 */
__attribute__((visibility("default"))) int munmap(void *addr, size_t len);

int
munmap(void *addr, size_t len)
{
	struct hostreg *h;

	pthread_mutex_lock(&zs__lock);
	h = find_reg_overlap(addr, len);
	if (h != NULL)
		zs__die("munmap(%p, %zu) of memory still registered with cudaHostRegister "
		    "(%p, %zu): cudaHostUnregister first", addr, len, (void *)h->base, h->len);
	zs__init_legacy();
	zs__check_no_pending_use(addr, len, "munmap");
	pthread_mutex_unlock(&zs__lock);
	return (int)syscall(SYS_munmap, addr, len);
}

/* ---- Copies and memsets ---- */

struct copy {
	void *dst;
	const void *src;
	size_t n;
	void *staging;		/* pageable source copied at the call */
	int value;		/* memset */
};

static void
copy_run(void *arg)
{
	struct copy *c = arg;

	memcpy(c->dst, c->staging != NULL ? c->staging : c->src, c->n);
}

static void
memset_run(void *arg)
{
	struct copy *c = arg;

	memset(c->dst, c->value, c->n);
}

static void
copy_drop(void *arg)
{
	struct copy *c = arg;

	free(c->staging);
	free(c);
}

static const char *const kind_names[] = {
	"HostToHost", "HostToDevice", "DeviceToHost", "DeviceToDevice", "Default",
};

/* -1 outside any allocation, 0 inside one but running past its end, 1 inside. */
static int
dev_range(const void *p, size_t n)
{
	struct devmem *m = find_dev(p);

	if (m == NULL)
		return -1;
	return n <= (size_t)(m->base + m->len - (const char *)p) ? 1 : 0;
}

static cudaError_t
do_copy(void *dst, const void *src, size_t n, enum cudaMemcpyKind kind, cudaStream_t stream,
    bool async, const char *what)
{
	struct CUstream_st *s;
	struct hostreg *reg;
	struct copy *c;
	int dd, sd;
	bool pinned;
	uint64_t seq;

	if ((unsigned)kind > cudaMemcpyDefault)
		return zs__fail(cudaErrorInvalidMemcpyDirection, "%s: kind %d", what, (int)kind);
	if (n == 0)
		return cudaSuccess;
	if (dst == NULL || src == NULL)
		return zs__fail(cudaErrorInvalidValue, "%s: NULL pointer", what);
	pthread_mutex_lock(&zs__lock);
	s = zs__resolve(stream);
	dd = dev_range(dst, n);
	sd = dev_range(src, n);
	if (dd == 0 || sd == 0) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorInvalidValue, "%s of %zu bytes: the %s runs past the end of "
		    "its device allocation", what, n, dd == 0 ? "destination" : "source");
	}
	if (kind == cudaMemcpyDefault)
		kind = sd > 0 && dd > 0 ? cudaMemcpyDeviceToDevice : sd > 0 ?
		    cudaMemcpyDeviceToHost : dd > 0 ? cudaMemcpyHostToDevice : cudaMemcpyHostToHost;
	if ((dd > 0) != (kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice) ||
	    (sd > 0) != (kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice)) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorInvalidValue, "%s(%p <- %p, %zu, cudaMemcpy%s): the pointers "
		    "are %s to %s memory", what, dst, src, n, kind_names[kind],
		    sd > 0 ? "device" : "host", dd > 0 ? "device" : "host");
	}
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		zs__die("out of memory");
	c->dst = dst;
	c->src = src;
	c->n = n;
	const void *host = kind == cudaMemcpyHostToDevice ? src :
	    kind == cudaMemcpyDeviceToHost ? dst : NULL;
	reg = host != NULL ? pinned_range(host, n) : NULL;
	pinned = reg != NULL;
	/* A DMA through pages the range no longer has: what the real one would do silently. */
	if (pinned)
		zs__pin_check(reg->pin, what);
	if (kind == cudaMemcpyHostToDevice && !pinned) {
		/* Staged at the call: the caller may reuse its buffer at once. */
		if (!async)
			zs__run_legacy_point(zs__stream_device(s));
		c->staging = malloc(n);
		if (c->staging == NULL)
			zs__die("out of memory");
		memcpy(c->staging, src, n);
		host = NULL;
	}
	seq = zs__enqueue(s, copy_run, copy_drop, c, pinned ? host : NULL, pinned ? n : 0);
	/* To the host: done before return, except async into pinned memory. */
	if (kind == cudaMemcpyHostToHost || (kind == cudaMemcpyDeviceToHost && (!async || !pinned)) ||
	    (kind == cudaMemcpyHostToDevice && pinned && !async))
		zs__run_to(s, seq);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaMemcpy(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind)
{
	return do_copy(dst, src, count, kind, NULL, false, "cudaMemcpy");
}

cudaError_t
cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind,
    cudaStream_t stream)
{
	return do_copy(dst, src, count, kind, stream, true, "cudaMemcpyAsync");
}

static cudaError_t
do_memset(void *dev, int value, size_t count, cudaStream_t stream, const char *what)
{
	struct copy *c;
	int r;

	if (count == 0)
		return cudaSuccess;
	pthread_mutex_lock(&zs__lock);
	r = dev_range(dev, count);
	if (r <= 0) {
		pthread_mutex_unlock(&zs__lock);
		return zs__fail(cudaErrorInvalidValue, "%s(%p, %zu): %s", what, dev, count,
		    r < 0 ? "not device memory" : "runs past the end of its allocation");
	}
	c = calloc(1, sizeof(*c));
	if (c == NULL)
		zs__die("out of memory");
	c->dst = dev;
	c->n = count;
	c->value = value;
	zs__enqueue(zs__resolve(stream), memset_run, copy_drop, c, NULL, 0);
	pthread_mutex_unlock(&zs__lock);
	return cudaSuccess;
}

cudaError_t
cudaMemset(void *dev, int value, size_t count)
{
	return do_memset(dev, value, count, NULL, "cudaMemset");
}

cudaError_t
cudaMemsetAsync(void *dev, int value, size_t count, cudaStream_t stream)
{
	return do_memset(dev, value, count, stream, "cudaMemsetAsync");
}
