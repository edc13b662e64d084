/* Copies of buffers that the cache should not keep: a gradient handed to the daemon, a param copied out. */
#ifndef ZU_COPY_H
#define ZU_COPY_H

#include <stddef.h>

/*
 * Below this a copy is a plain memcpy: what fits the caches is read back
 * from them by whoever reads it next (the daemon's step, the forward pass).
 */
#define ZU_COPY_STREAM_MIN ((size_t)1 << 20)

/*
 * memcpy(dst, src, bytes) for buffers that do not overlap, with streaming
 * (non-temporal) stores from ZU_COPY_STREAM_MIN bytes on.  A cached store
 * first reads the line it writes, so a plain copy of a buffer larger than
 * the caches moves 3 bytes for each one copied, a streaming one 2.  The
 * stores are fenced before it returns: another thread or process that is
 * told afterwards (a message, a lock) sees them.
 */
void zu_copy_stream(void *dst, const void *src, size_t bytes);

#endif
