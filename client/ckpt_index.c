/* Reading a checkpoint directory: the rank files' headers, and their arrays with checksums. */
#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_index.h"
#include "crc32c.h"
#include "fileio.h"

const char *const zck_state_names[ZCK_ARRAYS] = { "master", "exp_avg", "exp_avg_sq",
	"exp_avg_scale", "exp_avg_sq_scale" };
const char *const zck_optim_names[4] = { "adamw", "adam", "adagrad", "lion" };

#define BLOCK_ELEMENTS (4u << 20)

static int
fail(char *err, size_t errlen, int code, const char *fmt, ...) __attribute__((format(printf, 4, 5)));

static int
fail(char *err, size_t errlen, int code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return code;
}

/* A metadata string as an unsigned number; false when absent or not one. */
static bool
meta_u64(const cJSON *meta, const char *key, uint64_t *ret)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(meta, key);
	char *end;

	if (!cJSON_IsString(v) || v->valuestring[0] < '0' || v->valuestring[0] > '9')
		return false;
	errno = 0;
	*ret = strtoull(v->valuestring, &end, 10);
	return errno == 0 && *end == '\0';
}

static const char *
meta_str(const cJSON *meta, const char *key)
{
	const cJSON *v = cJSON_GetObjectItemCaseSensitive(meta, key);

	return cJSON_IsString(v) ? v->valuestring : NULL;
}

static void
free_file(struct zck_file *f)
{
	for (size_t i = 0; i < f->nentries; i++) {
		free(f->entries[i].name);
		free(f->entries[i].global_name);
	}
	free(f->entries);
	free(f->hparams);
	free(f->path);
	if (f->fd >= 0)
		close(f->fd);
}

_Static_assert((int)ZCK_ARRAYS_F32 == (int)ZK_STATE_FP32 &&
    (int)ZCK_ARRAYS_BF16 == (int)ZK_STATE_BF16 && (int)ZCK_ARRAYS_Q8 == (int)ZK_STATE_Q8,
    "a file's arrays are the state formats' (the daemon's ze_raw_array_bytes)");

/* As the daemon's ze_raw_array_bytes: the same sizes, from quant.h. */
uint64_t
zck_array_bytes(enum zck_arrays a, unsigned k, uint64_t count)
{
	enum zk_state_format f = (enum zk_state_format)a;

	if (k == 0)
		return zk_state_master_bytes(f, count);
	if (k < 3)
		return zk_state_moment_bytes(f, count);
	return k < ZCK_ARRAYS ? zk_state_blocks(f, count) * sizeof(float) : 0;
}

const char *
zck_arrays_name(enum zck_arrays a)
{
	static const char *const names[3] = { "fp32", "bf16-moments", "q8-moments" };

	return names[a];
}

/* The dtype of array k of a tensor whose exp_avg is `moments`. */
static bool
dtype_of(const char *dtype, enum zck_arrays *ret)
{
	static const char *const names[3] = { "F32", "BF16", "U8" };

	for (unsigned a = 0; a < 3; a++)
		if (strcmp(dtype, names[a]) == 0) {
			*ret = (enum zck_arrays)a;
			return true;
		}
	return false;
}

/* One tensor's arrays and metadata; the text of a problem goes to e->bad. */
static int
parse_entry(struct zck_file *f, const cJSON *hdr, const cJSON *meta, const char *name,
    struct zck_entry *e, char *err, size_t errlen)
{
	char key[1024];
	const char *s;

	e->name = strdup(name);
	snprintf(key, sizeof(key), "%s/global_name", name);
	s = meta_str(meta, key);
	e->global_name = strdup(s != NULL ? s : name);
	if (e->name == NULL || e->global_name == NULL)
		return fail(err, errlen, -ENOMEM, "out of memory");
#define META_NUM(field, suffix)							\
	snprintf(key, sizeof(key), "%s/" suffix, name);				\
	if (!meta_u64(meta, key, &e->field))					\
		return fail(err, errlen, -EBADMSG, "%s: tensor '%s': metadata '%s' is "	\
		    "missing or not a number", f->path, name, key);
	META_NUM(global_offset, "global_offset")
	META_NUM(global_numel, "global_numel")
	META_NUM(step, "step")
#undef META_NUM
	snprintf(key, sizeof(key), "%s/state_format", name);
	s = meta_str(meta, key);
	if (s != NULL && (s[0] == '\0' || strlen(s) >= sizeof(e->state_format)))
		return fail(err, errlen, -EBADMSG, "%s: tensor '%s': metadata '%s' is not a state "
		    "format", f->path, name, key);
	snprintf(e->state_format, sizeof(e->state_format), "%s", s != NULL ? s : "fp32");
	for (unsigned st = 0; st < ZCK_ARRAYS; st++) {
		const cJSON *t, *dtype, *shape, *offs;
		enum zck_arrays dt = ZCK_ARRAYS_F32;
		uint64_t a, b, crc, want;
		char *end;

		snprintf(key, sizeof(key), "%s/%s", name, zck_state_names[st]);
		t = cJSON_GetObjectItemCaseSensitive(hdr, key);
		/* The scale arrays are there for q8-moments arrays only. */
		if (st >= ZCK_STATES && e->arrays != ZCK_ARRAYS_Q8) {
			if (t != NULL)
				return fail(err, errlen, -EBADMSG, "%s: tensor '%s' has an array '%s' "
				    "but its moments are %s", f->path, name, key,
				    e->arrays == ZCK_ARRAYS_F32 ? "F32" : "BF16");
			continue;
		}
		if (!cJSON_IsObject(t))
			return fail(err, errlen, -EBADMSG, "%s: tensor '%s' has no array '%s'",
			    f->path, name, key);
		dtype = cJSON_GetObjectItemCaseSensitive(t, "dtype");
		shape = cJSON_GetObjectItemCaseSensitive(t, "shape");
		offs = cJSON_GetObjectItemCaseSensitive(t, "data_offsets");
		if (!cJSON_IsString(dtype) || !cJSON_IsArray(shape) || !cJSON_IsArray(offs) ||
		    cJSON_GetArraySize(offs) != 2 || !cJSON_IsNumber(cJSON_GetArrayItem(offs, 0)) ||
		    !cJSON_IsNumber(cJSON_GetArrayItem(offs, 1)))
			return fail(err, errlen, -EBADMSG, "%s: array '%s' lacks dtype, shape or "
			    "data_offsets", f->path, key);
		if (e->bad != NULL) {
			/* The first problem is the one told. */
		} else if (!dtype_of(dtype->valuestring, &dt) || (st != 1 && st != 2 &&
		    dt != ZCK_ARRAYS_F32) || (st == 2 && dt != e->arrays)) {
			e->bad = st == 2 ? "exp_avg_sq's dtype is not exp_avg's" :
			    st == 1 ? "exp_avg is not F32, BF16 or U8" : "is not F32";
		} else if (cJSON_GetArraySize(shape) != 1 ||
		    !cJSON_IsNumber(cJSON_GetArrayItem(shape, 0))) {
			e->bad = "is not one-dimensional";
		}
		if (st == 1 && e->bad == NULL)
			e->arrays = dt;
		a = (uint64_t)cJSON_GetArrayItem(offs, 0)->valuedouble;
		b = (uint64_t)cJSON_GetArrayItem(offs, 1)->valuedouble;
		if (b < a || (st == 0 && (b - a) % 4 != 0))
			return fail(err, errlen, -EBADMSG, "%s: array '%s' has data offsets %" PRIu64
			    "..%" PRIu64, f->path, key, a, b);
		if (st == 0)
			e->numel = (b - a) / 4;
		want = zck_array_bytes(e->arrays, st, e->numel);
		if (e->bad == NULL && b - a != want)
			return fail(err, errlen, -EBADMSG, "%s: tensor '%s': '%s' holds %" PRIu64
			    " bytes, %" PRIu64 " for master's %" PRIu64 " elements", f->path, name, key,
			    b - a, want, e->numel);
		e->begin[st] = a;
		if (b > f->data_end)
			f->data_end = b;
		snprintf(key, sizeof(key), "%s/%s/crc32c", name, zck_state_names[st]);
		s = meta_str(meta, key);
		crc = s != NULL ? strtoull(s, &end, 16) : 0;
		if (s == NULL || strlen(s) != 8 || *end != '\0')
			return fail(err, errlen, -EBADMSG, "%s: tensor '%s': no CRC-32C '%s'",
			    f->path, name, key);
		e->crc[st] = (uint32_t)crc;
	}
	/* Raw arrays are of the format the tensor was kept in. */
	if (e->bad == NULL && e->arrays != ZCK_ARRAYS_F32 &&
	    strcmp(e->state_format, zck_arrays_name(e->arrays)) != 0)
		e->bad = "of compressed moments is not of the tensor's state_format";
	if (e->global_offset > e->global_numel || e->numel > e->global_numel - e->global_offset)
		return fail(err, errlen, -EBADMSG, "%s: tensor '%s': elements %" PRIu64 "..%" PRIu64
		    " are outside its parameter's %" PRIu64, f->path, name, e->global_offset,
		    e->global_offset + e->numel, e->global_numel);
	return 0;
}

static int
parse_file(struct zck_file *f, char *err, size_t errlen)
{
	cJSON *hdr = NULL, *meta, *item;
	uint8_t lenbuf[8];
	uint64_t hlen = 0, v;
	struct stat st;
	char *text = NULL;
	const char *s;
	size_t n = 0;
	int r;

	if (fstat(f->fd, &st) < 0)
		return fail(err, errlen, -errno, "%s: %s", f->path, strerror(errno));
	f->size = (uint64_t)st.st_size;
	r = zp_pread_full(f->fd, lenbuf, 8, 0);
	for (int i = 0; i < 8; i++)
		hlen |= (uint64_t)lenbuf[i] << (8 * i);
	if (r < 0 || hlen == 0 || hlen > ZCK_HEADER_MAX || 8 + hlen > f->size)
		return fail(err, errlen, -EBADMSG, "%s: truncated or not a safetensors file "
		    "(header of %" PRIu64 " bytes in a %" PRIu64 "-byte file)", f->path, hlen,
		    f->size);
	text = malloc(hlen);
	if (text == NULL)
		return fail(err, errlen, -ENOMEM, "out of memory");
	r = zp_pread_full(f->fd, text, hlen, 8);
	if (r == 0)
		hdr = cJSON_ParseWithLength(text, hlen);
	free(text);
	if (r < 0)
		return fail(err, errlen, r, "%s: %s", f->path, strerror(-r));
	meta = cJSON_GetObjectItemCaseSensitive(hdr, "__metadata__");
	if (!cJSON_IsObject(meta)) {
		r = fail(err, errlen, -EBADMSG, "%s: the header is not JSON with __metadata__",
		    f->path);
		goto out;
	}
	s = meta_str(meta, "format");
	if (s == NULL || strcmp(s, ZCK_FORMAT) != 0) {
		r = fail(err, errlen, -EBADMSG, "%s: not a zoffload checkpoint (format '%s', "
		    "expected '%s')", f->path, s != NULL ? s : "", ZCK_FORMAT);
		goto out;
	}
	s = meta_str(meta, "optimizer");
	if (s == NULL || strlen(s) >= sizeof(f->optimizer)) {
		r = fail(err, errlen, -EBADMSG, "%s: no optimizer in the metadata", f->path);
		goto out;
	}
	strcpy(f->optimizer, s);
	s = meta_str(meta, "hyperparameters");
	f->hparams = strdup(s != NULL ? s : "{}");
	if (!meta_u64(meta, "rank", &v) || v > UINT32_MAX ||
	    (f->rank = (uint32_t)v, !meta_u64(meta, "world_size", &v)) || v > UINT32_MAX ||
	    v == 0 || f->rank >= v) {
		r = fail(err, errlen, -EBADMSG, "%s: rank and world_size are missing or wrong",
		    f->path);
		goto out;
	}
	f->world_size = (uint32_t)v;
	cJSON_ArrayForEach(item, hdr) {
		const char *slash = strrchr(item->string, '/');

		if (slash != NULL && strcmp(slash + 1, "master") == 0)
			n++;
	}
	f->entries = calloc(n > 0 ? n : 1, sizeof(*f->entries));
	if (f->entries == NULL || f->hparams == NULL) {
		r = fail(err, errlen, -ENOMEM, "out of memory");
		goto out;
	}
	r = 0;
	cJSON_ArrayForEach(item, hdr) {
		const char *slash = strrchr(item->string, '/');
		char name[512];

		if (slash == NULL || strcmp(slash + 1, "master") != 0)
			continue;
		snprintf(name, sizeof(name), "%.*s", (int)(slash - item->string), item->string);
		r = parse_entry(f, hdr, meta, name, &f->entries[f->nentries++], err, errlen);
		if (r < 0)
			goto out;
	}
	/* safetensors offsets count from the end of the header. */
	for (size_t i = 0; i < f->nentries; i++)
		for (unsigned k = 0; k < ZCK_ARRAYS; k++)
			f->entries[i].begin[k] += 8 + hlen;
	f->data_end += 8 + hlen;
out:
	cJSON_Delete(hdr);
	return r;
}

static int
by_rank(const void *a, const void *b)
{
	const struct zck_file *x = a, *y = b;

	return x->rank < y->rank ? -1 : x->rank > y->rank;
}

int
zck_open(const char *dir, struct zck_index **ret, char *err, size_t errlen)
{
	struct zck_index *ix;
	struct dirent *de;
	DIR *d;
	int r = 0;

	ix = calloc(1, sizeof(*ix));
	if (ix == NULL || (ix->dir = strdup(dir)) == NULL) {
		free(ix);
		return fail(err, errlen, -ENOMEM, "out of memory");
	}
	d = opendir(dir);
	if (d == NULL) {
		r = fail(err, errlen, -errno, "checkpoint directory %s: %s", dir, strerror(errno));
		goto fail;
	}
	while ((de = readdir(d)) != NULL) {
		unsigned rank, world;
		struct zck_file *f, *bigger;
		int used = 0;

		/* Only whole files: a save in progress writes a dot-file and renames it. */
		if (sscanf(de->d_name, "rank-%5u-of-%5u.safetensors%n", &rank, &world, &used) != 2 ||
		    de->d_name[used] != '\0')
			continue;
		bigger = realloc(ix->files, (ix->nfiles + 1) * sizeof(*bigger));
		if (bigger == NULL) {
			r = fail(err, errlen, -ENOMEM, "out of memory");
			break;
		}
		ix->files = bigger;
		f = &ix->files[ix->nfiles++];
		memset(f, 0, sizeof(*f));
		f->fd = -1;
		if (asprintf(&f->path, "%s/%s", dir, de->d_name) < 0) {
			f->path = NULL;
			r = fail(err, errlen, -ENOMEM, "out of memory");
			break;
		}
		f->fd = open(f->path, O_RDONLY | O_CLOEXEC);
		if (f->fd < 0) {
			r = fail(err, errlen, -errno, "%s: %s", f->path, strerror(errno));
			break;
		}
		r = parse_file(f, err, errlen);
		if (r < 0)
			break;
		if (f->rank != rank || f->world_size != world) {
			r = fail(err, errlen, -EBADMSG, "%s: its header says rank %u of %u",
			    f->path, f->rank, f->world_size);
			break;
		}
	}
	closedir(d);
	if (r < 0)
		goto fail;
	if (ix->nfiles == 0) {
		r = fail(err, errlen, -ENOENT, "checkpoint directory %s holds no rank files "
		    "(rank-RRRRR-of-WWWWW.safetensors)", dir);
		goto fail;
	}
	qsort(ix->files, ix->nfiles, sizeof(*ix->files), by_rank);
	for (size_t i = 1; i < ix->nfiles; i++) {
		if (ix->files[i].world_size != ix->files[0].world_size) {
			r = fail(err, errlen, -EBADMSG, "checkpoint directory %s mixes world sizes: "
			    "%s and %s", dir, ix->files[0].path, ix->files[i].path);
			goto fail;
		}
	}
	*ret = ix;
	return 0;
fail:
	zck_close(ix);
	return r;
}

void
zck_close(struct zck_index *ix)
{
	if (ix == NULL)
		return;
	for (size_t i = 0; i < ix->nfiles; i++)
		free_file(&ix->files[i]);
	free(ix->files);
	free(ix->dir);
	free(ix);
}

int
zck_pread_array(const struct zck_file *f, const struct zck_entry *e, unsigned k, void *buf,
    uint64_t len, uint64_t at, char *err, size_t errlen)
{
	int r = len > 0 ? zp_pread_full(f->fd, buf, len, e->begin[k] + at) : 0;

	if (r < 0)
		return fail(err, errlen, r == -ENODATA ? -EBADMSG : r, "%s: tensor '%s/%s': %s",
		    f->path, e->name, zck_state_names[k], r == -ENODATA ?
		    "the file is truncated" : strerror(-r));
	return 0;
}

/* CRC-32C of bytes [from, to) of array k continued from *crc. */
static int
crc_bytes(const struct zck_file *f, const struct zck_entry *e, unsigned k, uint64_t from,
    uint64_t to, uint32_t *crc, char *err, size_t errlen)
{
	uint64_t block = to - from < 4 * BLOCK_ELEMENTS ? to - from : 4 * BLOCK_ELEMENTS;
	char *buf;
	int r = 0;

	if (from >= to)
		return 0;
	buf = malloc(block);
	if (buf == NULL)
		return fail(err, errlen, -ENOMEM, "out of memory");
	while (from < to) {
		uint64_t n = to - from < block ? to - from : block;

		r = zck_pread_array(f, e, k, buf, n, from, err, errlen);
		if (r < 0)
			break;
		*crc = zu_crc32c(*crc, buf, n);
		from += n;
	}
	free(buf);
	return r;
}

int
zck_check_array(const struct zck_file *f, const struct zck_entry *e, unsigned k, char *err,
    size_t errlen)
{
	uint64_t len = zck_array_bytes(e->arrays, k, e->numel);
	uint32_t crc = 0;
	int r;

	if (e->bad != NULL)
		return fail(err, errlen, -EBADMSG, "%s: tensor '%s': an array %s", f->path, e->name,
		    e->bad);
	if (e->begin[k] + len > f->size)
		return fail(err, errlen, -EBADMSG, "%s: tensor '%s/%s': the file is truncated (%"
		    PRIu64 " bytes, its header needs %" PRIu64 ")", f->path, e->name,
		    zck_state_names[k], f->size, f->data_end);
	r = crc_bytes(f, e, k, 0, len, &crc, err, errlen);
	if (r == 0 && len > 0 && crc != e->crc[k])
		r = fail(err, errlen, -EBADMSG, "%s: tensor '%s/%s': CRC-32C %08x, the header says "
		    "%08x: the file is damaged", f->path, e->name, zck_state_names[k], crc,
		    e->crc[k]);
	return r;
}

int
zck_crc_range(const struct zck_file *f, const struct zck_entry *e, unsigned k,
    uint64_t from, uint64_t to, uint32_t *crc, char *err, size_t errlen)
{
	return crc_bytes(f, e, k, zck_array_bytes(e->arrays, k, from),
	    zck_array_bytes(e->arrays, k, to), crc, err, errlen);
}
