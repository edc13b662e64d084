/* CUDA stand-in: what registered (pinned) pages are backed by, and the calls that would leave a GPU on stale ones. */
#undef _FILE_OFFSET_BITS	/* both names are defined below: mmap and mmap64, fallocate and fallocate64 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "standin_impl.h"

/*
 * A real cudaHostRegister pins the pages that back the range at that moment.
 * Whatever replaces them afterwards goes unseen by the GPU, which keeps
 * copying to and from the old ones:
 *   - mmap(MAP_FIXED) over the range (a new file mapped in place);
 *   - fallocate(FALLOC_FL_PUNCH_HOLE) of the backing file, in this process or
 *     any other (zoffloadd drops a released param slot's pages that way): the
 *     next touch gets new pages, the GPU keeps the orphaned ones.
 * The first is seen here (mmap is interposed).  The second is seen here for a
 * punch by this process; for another process's, every registration is also
 * published as a file in $ZS_CUDA_PINS (a directory) naming the file pieces
 * it pins, and a process running the stand-in's fallocate (linked, or
 * LD_PRELOADed into zoffloadd) that punches one leaves a mark beside it.  The
 * registering process dies at its next copy through the range, or when it
 * unregisters it.  Without $ZS_CUDA_PINS only this process's punches count.
 */

/* One piece of a registered range: its pages are those of [off, off + hi - lo) of file (dev, ino). */
struct piece {
	uintptr_t lo, hi;
	uint64_t dev, ino, off;
};

struct zs_pin {
	struct zs_pin *next;
	const char *base;
	size_t len;
	int npieces;
	struct piece *pieces;
	char path[PATH_MAX];		/* the published record, "" when not published */
};

static struct zs_pin *pins;		/* under zs__lock */
static uint64_t pin_seq;

/* The file-backed pieces of [p, p + len), from /proc/self/maps. */
static int
read_pieces(const void *p, size_t len, struct piece **ret)
{
	uintptr_t want = (uintptr_t)p, end = (uintptr_t)p + len;
	struct piece *v = NULL;
	char line[512];
	int n = 0;
	FILE *f = fopen("/proc/self/maps", "re");

	if (f == NULL)
		zs__die("cannot read /proc/self/maps: %s", strerror(errno));
	while (fgets(line, sizeof(line), f) != NULL) {
		uintptr_t lo, hi;
		unsigned long long off, ino;
		unsigned maj, min;
		struct piece *bigger;

		if (sscanf(line, "%" SCNxPTR "-%" SCNxPTR " %*s %llx %x:%x %llu", &lo, &hi, &off,
		    &maj, &min, &ino) != 6 || hi <= want || lo >= end || ino == 0)
			continue;
		bigger = realloc(v, (size_t)(n + 1) * sizeof(*v));
		if (bigger == NULL)
			zs__die("out of memory");
		v = bigger;
		v[n].lo = lo > want ? lo : want;
		v[n].hi = hi < end ? hi : end;
		v[n].off = off + (v[n].lo - lo);
		v[n].dev = makedev(maj, min);
		v[n].ino = ino;
		n++;
	}
	fclose(f);
	*ret = v;
	return n;
}

/* Writes the record under a temporary name and renames it: a reader sees all of it or none. */
static void
publish(struct zs_pin *pin, const char *dir)
{
	char tmp[PATH_MAX + 8];
	FILE *f;

	snprintf(pin->path, sizeof(pin->path), "%s/%d-%" PRIu64 ".pin", dir, (int)getpid(),
	    ++pin_seq);
	snprintf(tmp, sizeof(tmp), "%s.tmp", pin->path);
	f = fopen(tmp, "we");
	if (f == NULL)
		zs__die("$ZS_CUDA_PINS: cannot create %s: %s", tmp, strerror(errno));
	for (int i = 0; i < pin->npieces; i++)
		fprintf(f, "%d %" PRIu64 " %" PRIu64 " %" PRIu64 " %" PRIu64 "\n", (int)getpid(),
		    pin->pieces[i].dev, pin->pieces[i].ino, pin->pieces[i].off,
		    (uint64_t)(pin->pieces[i].hi - pin->pieces[i].lo));
	if (fclose(f) != 0 || rename(tmp, pin->path) != 0)
		zs__die("$ZS_CUDA_PINS: cannot write %s: %s", pin->path, strerror(errno));
}

struct zs_pin *
zs__pin_add(const void *p, size_t len)
{
	const char *dir = getenv("ZS_CUDA_PINS");
	struct zs_pin *pin = calloc(1, sizeof(*pin));

	if (pin == NULL)
		zs__die("out of memory");
	pin->base = p;
	pin->len = len;
	pin->npieces = read_pieces(p, len, &pin->pieces);
	if (dir != NULL && dir[0] != '\0' && pin->npieces > 0)
		publish(pin, dir);
	pthread_mutex_lock(&zs__lock);
	pin->next = pins;
	pins = pin;
	pthread_mutex_unlock(&zs__lock);
	return pin;
}

void
zs__pin_check(const struct zs_pin *pin, const char *what)
{
	char mark[PATH_MAX + 16], by[128] = "";
	FILE *f;

	if (pin == NULL || pin->path[0] == '\0')
		return;
	snprintf(mark, sizeof(mark), "%s.punched", pin->path);
	f = fopen(mark, "re");
	if (f == NULL)
		return;
	if (fgets(by, sizeof(by), f) == NULL)
		by[0] = '\0';
	fclose(f);
	by[strcspn(by, "\n")] = '\0';
	zs__die("%s: host memory %p (+%zu) registered with cudaHostRegister had a hole punched "
	    "in its file (%s) while registered: a GPU goes on using the old pages; "
	    "cudaHostUnregister before they are dropped", what, (const void *)pin->base, pin->len,
	    by);
}

void
zs__pin_drop(struct zs_pin *pin)
{
	char mark[PATH_MAX + 16];

	if (pin == NULL)
		return;
	pthread_mutex_lock(&zs__lock);
	for (struct zs_pin **pp = &pins; *pp != NULL; pp = &(*pp)->next) {
		if (*pp == pin) {
			*pp = pin->next;
			break;
		}
	}
	pthread_mutex_unlock(&zs__lock);
	if (pin->path[0] != '\0') {
		snprintf(mark, sizeof(mark), "%s.punched", pin->path);
		(void)unlink(mark);
		(void)unlink(pin->path);
	}
	free(pin->pieces);
	free(pin);
}

static bool
file_overlap(uint64_t a, uint64_t alen, uint64_t b, uint64_t blen)
{
	return a < b + blen && b < a + alen;
}

/* Marks every other live process's record that pins part of [off, off + len) of (dev, ino). */
static void
mark_punched(const char *dir, uint64_t dev, uint64_t ino, uint64_t off, uint64_t len)
{
	DIR *d = opendir(dir);
	struct dirent *de;

	if (d == NULL)
		return;
	while ((de = readdir(d)) != NULL) {
		char path[PATH_MAX], line[256];
		size_t nl = strlen(de->d_name);
		bool hit = false;
		int owner = 0;
		FILE *f;

		if (nl < 5 || strcmp(de->d_name + nl - 4, ".pin") != 0)
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, de->d_name);
		f = fopen(path, "re");
		if (f == NULL)
			continue;	/* unregistered meanwhile */
		while (!hit && fgets(line, sizeof(line), f) != NULL) {
			uint64_t pdev, pino, poff, plen;

			hit = sscanf(line, "%d %" SCNu64 " %" SCNu64 " %" SCNu64 " %" SCNu64, &owner,
			    &pdev, &pino, &poff, &plen) == 5 && pdev == dev && pino == ino &&
			    file_overlap(poff, plen, off, len);
		}
		fclose(f);
		/* A record left by a process that died holds nothing. */
		if (!hit || owner == (int)getpid() || (kill(owner, 0) != 0 && errno == ESRCH))
			continue;
		strncat(path, ".punched", sizeof(path) - strlen(path) - 1);
		f = fopen(path, "we");
		if (f != NULL) {
			fprintf(f, "fallocate(PUNCH_HOLE) of bytes %" PRIu64 "..%" PRIu64 " by pid %d\n",
			    off, off + len, (int)getpid());
			fclose(f);
		}
	}
	closedir(d);
}

static void
check_punch(int fd, int mode, off_t offset, off_t len)
{
	const char *dir = getenv("ZS_CUDA_PINS");
	struct stat st;

	if (!(mode & FALLOC_FL_PUNCH_HOLE) || fstat(fd, &st) != 0 || offset < 0 || len <= 0)
		return;
	pthread_mutex_lock(&zs__lock);
	for (struct zs_pin *pin = pins; pin != NULL; pin = pin->next)
		for (int i = 0; i < pin->npieces; i++) {
			const struct piece *pc = &pin->pieces[i];

			if (pc->dev == (uint64_t)st.st_dev && pc->ino == (uint64_t)st.st_ino &&
			    file_overlap(pc->off, pc->hi - pc->lo, (uint64_t)offset, (uint64_t)len))
				zs__die("fallocate(PUNCH_HOLE, %lld, %lld) of pages still registered "
				    "with cudaHostRegister (%p, %zu): a GPU would go on using the old "
				    "ones; cudaHostUnregister first", (long long)offset,
				    (long long)len, (const void *)pin->base, pin->len);
		}
	pthread_mutex_unlock(&zs__lock);
	if (dir != NULL && dir[0] != '\0')
		mark_punched(dir, (uint64_t)st.st_dev, (uint64_t)st.st_ino, (uint64_t)offset,
		    (uint64_t)len);
}

/* Interposed for the whole process, as munmap is (memory.c). */
__attribute__((visibility("default"))) int fallocate(int fd, int mode, off_t offset, off_t len);
__attribute__((visibility("default"))) int fallocate64(int fd, int mode, off64_t offset,
    off64_t len);
__attribute__((visibility("default"))) void *mmap(void *addr, size_t len, int prot, int flags,
    int fd, off_t offset);
__attribute__((visibility("default"))) void *mmap64(void *addr, size_t len, int prot, int flags,
    int fd, off64_t offset);

int
fallocate(int fd, int mode, off_t offset, off_t len)
{
	check_punch(fd, mode, offset, len);
	return (int)syscall(SYS_fallocate, fd, mode, offset, len);
}

int
fallocate64(int fd, int mode, off64_t offset, off64_t len)
{
	return fallocate(fd, mode, offset, len);
}

void *
mmap(void *addr, size_t len, int prot, int flags, int fd, off_t offset)
{
	if (flags & MAP_FIXED) {
		pthread_mutex_lock(&zs__lock);
		for (struct zs_pin *pin = pins; pin != NULL; pin = pin->next)
			if (zs__overlaps(pin->base, pin->len, addr, len))
				zs__die("mmap(%p, %zu, MAP_FIXED) over memory still registered with "
				    "cudaHostRegister (%p, %zu): a GPU would go on using the old pages; "
				    "cudaHostUnregister first", addr, len, (const void *)pin->base,
				    pin->len);
		pthread_mutex_unlock(&zs__lock);
	}
	return (void *)syscall(SYS_mmap, addr, len, prot, flags, fd, offset);
}

void *
mmap64(void *addr, size_t len, int prot, int flags, int fd, off64_t offset)
{
	return mmap(addr, len, prot, flags, fd, offset);
}
