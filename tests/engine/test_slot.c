/* The param slot as the master: one array stepped in place, the same bits as a master kept apart, and the client's descriptor read-only. */
#include <criterion/criterion.h>
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "engine.h"
#include "recover.h"
#include "swap_helpers.h"

/* Not a multiple of 256: a short last q8 block. */
#define N 100003u

static unsigned steps_done, io_done;
static int io_result;

static void
cb_tensor_done(void *arg, uint32_t lane, uint64_t id, void *user,
    const struct ze_tensor_result *r)
{
	cr_assert_eq(r->status, ZE_STEP_APPLIED, "a tensor's step did not apply: %d", r->error);
}

static void
cb_step_done(void *arg, uint32_t lane, uint64_t id, const struct ze_step_result *r)
{
	steps_done++;
}

static void
cb_io_done(void *arg, uint32_t lane, uint64_t id, enum ze_io kind, void *user, int result)
{
	io_done++;
	io_result = result;
}

static void cb_param_ready(void *arg, uint32_t lane, uint64_t id, void *user, int result) { }
static void cb_grad_done(void *arg, uint32_t lane, uint64_t id, int result,
    const struct ze_grad_partial *p) { }

static const struct ze_callbacks callbacks = {
	.grad_done = cb_grad_done,
	.tensor_done = cb_tensor_done,
	.step_done = cb_step_done,
	.io_done = cb_io_done,
	.param_ready = cb_param_ready,
};

static struct ze_engine *
engine(void)
{
	struct ze_engine *e;
	char err[256];

	/* Two workers: each slice is split, as the daemon's are; through the journal, its default. */
	cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 256u << 20,
		.numa_node = -1, .shm_budget = 256u << 20, .worker_threads = 2, .journal = true,
		.isa = zk_isa_best() }, NULL, &callbacks, NULL, &e, err, sizeof(err)), 0, "%s", err);
	return e;
}

static struct ze_tensor *
tensor(struct ze_engine *e, struct ze_account *job, enum zk_state_format f, enum zk_dtype pd,
    bool offload)
{
	struct ze_tensor *t;
	char err[256];

	cr_assert_eq(ze_tensor_new(e, &(struct ze_tensor_desc){ .name = "w", .numel = N,
		.grad_dtype = ZK_DTYPE_F32, .param_dtype = pd, .param_offload = offload,
		.policy = ZE_POLICY_CPU, .state_format = f }, job, NULL, NULL, &t, err,
	    sizeof(err)), 0, "%s", err);
	return t;
}

static void
fill(float *x, uint64_t n, uint64_t seed)
{
	uint64_t s = seed * 0x9e3779b97f4a7c15ull + 1;

	for (uint64_t i = 0; i < n; i++) {
		s ^= s >> 12;
		s ^= s << 25;
		s ^= s >> 27;
		x[i] = (float)((double)((s * 2685821657736338717ull) >> 11) / 9007199254740992.0 -
		    0.5);
	}
}

static void
wait_for(struct ze_engine *e, const unsigned *counter, unsigned want)
{
	for (int i = 0; i < 3000 && *counter < want; i++)
		cr_assert_geq(ze_engine_wait(e, 10), 0);
	cr_assert_geq(*counter, want, "the engine did not report");
}

/* What a restore writes: master, m, then v = m * m (a second moment is not negative). */
static void
restore_values(float *init)
{
	fill(init, N, 1);
	fill(init + N, N, 2);
	for (size_t i = 0; i < N; i++)
		init[2 * N + i] = init[N + i] * init[N + i];
}

/*
 * Elements [off, off + n) of master, m and v as fp32 (decoded), n apart in buf, written
 * (a restore) or read (a checkpoint): on NVMe straight or through staging.
 */
static void
part(struct ze_engine *e, struct ze_tensor *t, bool write, uint64_t off, uint64_t n, float *buf)
{
	unsigned before = io_done;
	int r = write ? ze_tensor_write_all(t, off, n, n, buf, 1, 1) :
	    ze_tensor_read_all(t, off, n, n, buf, 1, 1);

	cr_assert_geq(r, 0, "%s: %d", write ? "write_all" : "read_all", r);
	if (r == 0) {
		wait_for(e, &io_done, before + 1);
		cr_assert_eq(io_result, 0);
	}
}

/* The whole tensor's. */
static void
all(struct ze_engine *e, struct ze_tensor *t, bool write, float *buf)
{
	part(e, t, write, 0, N, buf);
}

/* The same gradients and step into every tensor of ts, one step each. */
static void
step(struct ze_engine *e, struct ze_tensor **ts, size_t n, enum zk_optim optim, uint64_t s)
{
	unsigned before = steps_done;
	char err[256];

	for (size_t i = 0; i < n; i++)
		fill(ze_tensor_grad_slot(ts[i]), N, 50 + s);
	cr_assert_eq(ze_step_submit(e, &(struct ze_step){ .lane = 1, .id = s,
		.hp = { .optim = optim, .lr = optim == ZK_OPTIM_LION ? 1e-4 : 1e-2, .beta1 = 0.9,
			.beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.01, .step = s,
			.bias_correction = true, .grad_scale = 1.0 },
		.count = n, .tensors = ts }, err, sizeof(err)), 0, "%s", err);
	wait_for(e, &steps_done, before + 1);
}

/*
 * Where the slot's dtype is the master's and the client only reads it, the
 * slot is the master: its memory is master's (ze_tensor_memory_raw), the
 * pinned charge lacks the master's bytes, and after a restore and steps its
 * state is, bit for bit, that of the same tensor with its master kept
 * apart (param offload: the client writes the slot, so the master cannot
 * be it) whose slot the step writes as a copy.
 */
static void
same_as_master_apart(enum zk_state_format f, enum zk_dtype pd, enum zk_optim optim)
{
	size_t pbytes = N * (pd == ZK_DTYPE_F32 ? 4 : 2);
	float *init = malloc(3 * N * sizeof(float)), *a = malloc(3 * N * sizeof(float));
	float *b = malloc(3 * N * sizeof(float));
	struct ze_account *ja, *jb;
	struct ze_tensor *one, *two, *ts[2];
	uint64_t pa, pb, swap;
	struct ze_engine *e = engine();

	cr_assert(init != NULL && a != NULL && b != NULL);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &ja), 0);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &jb), 0);
	one = tensor(e, ja, f, pd, false);
	two = tensor(e, jb, f, pd, true);
	cr_assert_eq(ze_tensor_memory_raw(one, 0), ze_tensor_param_slot(one),
	    "the slot is not the master");
	cr_assert_neq(ze_tensor_memory_raw(two, 0), ze_tensor_param_slot(two));
	ze_account_usage(ja, &pa, &swap);
	ze_account_usage(jb, &pb, &swap);
	/* two also keeps a pinned param store as long as its slot. */
	cr_assert_leq(pa + 2 * pbytes, pb, "pinned %llu with the slot as master, %llu apart",
	    (unsigned long long)pa, (unsigned long long)pb);
	restore_values(init);
	all(e, one, true, init);
	all(e, two, true, init);
	cr_assert(memcmp(ze_tensor_param_slot(one), ze_tensor_param_slot(two), pbytes) == 0,
	    "a restore's params differ");
	ts[0] = one;
	ts[1] = two;
	for (uint64_t s = 1; s <= 3; s++)
		step(e, ts, 2, optim, s);
	all(e, one, false, a);
	all(e, two, false, b);
	cr_assert(memcmp(a, b, 3 * N * sizeof(float)) == 0, "the state differs");
	cr_assert(memcmp(ze_tensor_param_slot(one), ze_tensor_param_slot(two), pbytes) == 0,
	    "the params differ");
	ze_tensor_free(one);
	ze_tensor_free(two);
	ze_account_unref(ja);
	ze_account_unref(jb);
	ze_engine_free(e);
	free(init);
	free(a);
	free(b);
}

Test(slot, fp32_adamw) { same_as_master_apart(ZK_STATE_FP32, ZK_DTYPE_F32, ZK_OPTIM_ADAMW); }
Test(slot, fp32_adam) { same_as_master_apart(ZK_STATE_FP32, ZK_DTYPE_F32, ZK_OPTIM_ADAM); }
Test(slot, fp32_adagrad) { same_as_master_apart(ZK_STATE_FP32, ZK_DTYPE_F32, ZK_OPTIM_ADAGRAD); }
Test(slot, fp32_lion) { same_as_master_apart(ZK_STATE_FP32, ZK_DTYPE_F32, ZK_OPTIM_LION); }
Test(slot, bf16_moments) { same_as_master_apart(ZK_STATE_BF16, ZK_DTYPE_F32, ZK_OPTIM_ADAMW); }
Test(slot, q8_moments) { same_as_master_apart(ZK_STATE_Q8, ZK_DTYPE_F32, ZK_OPTIM_ADAM); }
/* Its master is bf16: a bf16 slot is it. */
Test(slot, bf16_master_q8) { same_as_master_apart(ZK_STATE_BF16_Q8, ZK_DTYPE_BF16, ZK_OPTIM_ADAMW); }

/*
 * NVMe: the slot is the master there too, the disk keeping a chunk's m, v and scales
 * only.  Three steps and the transfers through the staging buffers and straight to the
 * caller's (a whole chunk, and a split part of one) give the bits of the same tensor
 * whose chunks keep their master (param offload), while each step moves two thirds of
 * its bytes for fp32, and the swap it takes is m, v and the scales alone.
 */
/* An odd number of KiB of bf16 master a chunk: its array rounded to 4 KiB in the layout. */
#define NVME_CHUNK 9216u

/* The swap a tensor whose slot is its master takes: each chunk's m, v and scales, 4 KiB rounded. */
static uint64_t
nvme_disk_bytes(enum zk_state_format f)
{
	uint64_t total = 0;

	for (uint64_t at = 0; at < N; at += NVME_CHUNK) {
		uint64_t len = N - at < NVME_CHUNK ? N - at : NVME_CHUNK;
		uint64_t s = (len + 1023) / 1024 * 1024;

		total += (2 * zk_state_moment_bytes(f, s) + 2 * sizeof(float) * zk_state_blocks(f, s) +
		    4095) / 4096 * 4096;
	}
	return total;
}

static struct ze_engine *
nvme_engine(char **dir)
{
	struct zs_swap *swap;
	struct ze_engine *e;
	char err[256];
	int r;

	*dir = th_tmpdir();
	r = th_engine(ZS_SWAP_PTHREAD, *dir, 64u << 20, 8, 0, NULL, &swap);
	cr_assert_eq(r, 0, "swap engine: %s", zs_strerror(r));
	cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 256u << 20,
		.numa_node = -1, .shm_budget = 256u << 20, .worker_threads = 2, .journal = true,
		.isa = zk_isa_best(), .staging_buffers = 2, .chunk_elements = NVME_CHUNK }, swap,
	    &callbacks, NULL, &e, err, sizeof(err)), 0, "%s", err);
	return e;
}

/* t's slot holds master (as read_all decodes it: a bf16 master widens exactly). */
static bool
slot_is(struct ze_tensor *t, enum zk_dtype pd, const float *master)
{
	const uint16_t *bf = ze_tensor_param_slot(t);

	if (pd == ZK_DTYPE_F32)
		return memcmp(ze_tensor_param_slot(t), master, N * sizeof(float)) == 0;
	for (size_t i = 0; i < N; i++) {
		uint32_t bits;

		memcpy(&bits, &master[i], sizeof(bits));
		if (bits != (uint32_t)bf[i] << 16)
			return false;
	}
	return true;
}

/* Master alone, as fp32, read or written (zc_tensor_read's and zc_tensor_write's path). */
static void
master_io(struct ze_engine *e, struct ze_tensor *t, bool write, float *buf)
{
	unsigned before = io_done;
	int r = ze_tensor_io(t, write, ZE_STATE_MASTER, 0, N, buf, 1, 1);

	cr_assert_geq(r, 0, "%s: %d", write ? "write" : "read", r);
	if (r == 0) {
		wait_for(e, &io_done, before + 1);
		cr_assert_eq(io_result, 0);
	}
}

static void
nvme_same_as_master_in_chunks(enum zk_state_format f, enum zk_dtype pd, enum zk_optim optim)
{
	size_t pbytes = N * (pd == ZK_DTYPE_F32 ? 4 : 2);
	float *init = malloc(3 * N * sizeof(float)), *a = malloc(3 * N * sizeof(float));
	float *b = malloc(3 * N * sizeof(float)), *pa = NULL, *pb = NULL;
	struct ze_tensor *one, *two, *ts[1];
	struct ze_stats s0, s1, s2;
	struct ze_account *ja;
	uint64_t pinned, swap;
	char *dir, err[256];
	struct ze_engine *e = nvme_engine(&dir);
	/* Each array of a chunk 4 KiB rounded: the last chunk's too. */
	uint64_t rounded = (N + 1023) / 1024 * 1024;

	cr_assert(init != NULL && a != NULL && b != NULL);
	cr_assert_eq(ze_account_new(&(struct ze_account_limits){ 0 }, &ja), 0);
	cr_assert_eq(posix_memalign((void **)&pa, 4096, 3 * NVME_CHUNK * sizeof(float)), 0);
	cr_assert_eq(posix_memalign((void **)&pb, 4096, 3 * NVME_CHUNK * sizeof(float)), 0);
	for (int k = 0; k < 2; k++)
		cr_assert_eq(ze_tensor_new(e, &(struct ze_tensor_desc){ .name = k ? "two" : "one",
			.numel = N, .grad_dtype = ZK_DTYPE_F32, .param_dtype = pd,
			.param_offload = k == 1, .policy = ZE_POLICY_NVME, .state_format = f },
		    k ? NULL : ja, NULL, NULL, k ? &two : &one, err, sizeof(err)), 0, "%s", err);
	cr_assert(ze_tensor_on_nvme(one) && ze_tensor_on_nvme(two));
	ze_account_usage(ja, &pinned, &swap);
	cr_assert_eq(swap, nvme_disk_bytes(f), "%llu bytes of swap, not m, v and the scales alone",
	    (unsigned long long)swap);
	restore_values(init);
	all(e, one, true, init);
	all(e, two, true, init);
	all(e, one, false, a);
	cr_assert(slot_is(one, pd, a), "a restore's master is not in the slot");
	for (uint64_t s = 1; s <= 3; s++) {
		ze_engine_stats(e, &s0);
		ts[0] = one;
		step(e, ts, 1, optim, s);
		ze_engine_stats(e, &s1);
		ts[0] = two;
		step(e, ts, 1, optim, s);
		ze_engine_stats(e, &s2);
		cr_assert_lt(s1.bytes_read - s0.bytes_read, s2.bytes_read - s1.bytes_read);
		cr_assert_eq(s1.bytes_read - s0.bytes_read, s1.bytes_written - s0.bytes_written);
		if (f == ZK_STATE_FP32)
			cr_assert_eq(s1.bytes_read - s0.bytes_read, 2 * rounded * sizeof(float),
			    "read %llu bytes, not m and v alone",
			    (unsigned long long)(s1.bytes_read - s0.bytes_read));
	}
	all(e, one, false, a);
	all(e, two, false, b);
	cr_assert(memcmp(a, b, 3 * N * sizeof(float)) == 0, "the state differs");
	cr_assert(memcmp(ze_tensor_param_slot(one), ze_tensor_param_slot(two), pbytes) == 0,
	    "the params differ");
	cr_assert(slot_is(one, pd, a), "the slot is not the master");
	/* The master alone is read from the slot: no chunk is read for it. */
	ze_engine_stats(e, &s0);
	master_io(e, one, false, b);
	ze_engine_stats(e, &s1);
	cr_assert_eq(s1.bytes_read, s0.bytes_read, "chunks read for the master alone");
	cr_assert(memcmp(a, b, N * sizeof(float)) == 0, "the master read alone differs");
	master_io(e, two, false, b);
	cr_assert(memcmp(a, b, N * sizeof(float)) == 0, "the master in chunks differs");
	/*
	 * And written alone into the slot, every chunk having been written whole: no chunk is
	 * moved for it, and the state is that of the same write through the chunks.
	 */
	for (size_t i = 0; i < N; i++)
		b[i] = a[i] * 0.75f;
	ze_engine_stats(e, &s0);
	master_io(e, one, true, b);
	ze_engine_stats(e, &s1);
	cr_assert(s1.bytes_read == s0.bytes_read && s1.bytes_written == s0.bytes_written,
	    "chunks moved for the master written alone");
	master_io(e, two, true, b);
	all(e, one, false, a);
	all(e, two, false, b);
	cr_assert(memcmp(a, b, 3 * N * sizeof(float)) == 0, "the state differs after the master");
	cr_assert(slot_is(one, pd, a), "the slot is not the master written alone");
	/* Chunk 1 whole, then a part of it from 4 KiB on: straight to the caller's buffer for fp32. */
	for (int k = 0; k < 2; k++) {
		uint64_t off = NVME_CHUNK + (k ? 1024 : 0), n = k ? 2048 : NVME_CHUNK;

		part(e, one, false, off, n, pa);
		part(e, two, false, off, n, pb);
		cr_assert(memcmp(pa, pb, 3 * n * sizeof(float)) == 0, "read %d differs", k);
		for (uint64_t i = 0; i < 3 * n; i++)
			pa[i] = pb[i] = pa[i] * 0.5f;
		part(e, one, true, off, n, pa);
		part(e, two, true, off, n, pb);
	}
	ts[0] = one;
	step(e, ts, 1, optim, 4);
	ts[0] = two;
	step(e, ts, 1, optim, 4);
	all(e, one, false, a);
	all(e, two, false, b);
	cr_assert(memcmp(a, b, 3 * N * sizeof(float)) == 0, "the state differs after the parts");
	cr_assert(slot_is(one, pd, a), "the slot is not the master after the parts");
	ze_tensor_free(one);
	ze_tensor_free(two);
	ze_account_unref(ja);
	ze_engine_free(e);
	th_rmdir(dir);
	free(init);
	free(a);
	free(b);
	free(pa);
	free(pb);
}

static void
nvme_f32(enum zk_state_format f, enum zk_optim optim)
{
	nvme_same_as_master_in_chunks(f, ZK_DTYPE_F32, optim);
}

Test(slot, nvme_fp32_adamw) { nvme_f32(ZK_STATE_FP32, ZK_OPTIM_ADAMW); }
Test(slot, nvme_fp32_lion) { nvme_f32(ZK_STATE_FP32, ZK_OPTIM_LION); }
Test(slot, nvme_q8_moments) { nvme_f32(ZK_STATE_Q8, ZK_OPTIM_ADAM); }
Test(slot, nvme_bf16_moments) { nvme_f32(ZK_STATE_BF16, ZK_OPTIM_ADAMW); }
/* A bf16 master, 2 B an element: its array in the chunk's staging layout rounded to 4 KiB. */
Test(slot, nvme_bf16_master_q8)
{
	nvme_same_as_master_in_chunks(ZK_STATE_BF16_Q8, ZK_DTYPE_BF16, ZK_OPTIM_ADAMW);
}

/* Dtypes that differ keep the slot a copy. */
/*
 * The master written alone before its chunks were written whole goes through them: that
 * write is what puts m and v on the disk, over what a freed tensor left there, keeping the
 * elements a restore's split part wrote.  Were it the slot's alone, every element would
 * count as written while the chunk is not, and the chunk would read as zeros: the split
 * part's m and v lost.
 */
Test(slot, nvme_master_alone_before_a_chunk_is_written)
{
	enum { PART = 1024 };
	float *old = malloc(3 * N * sizeof(float)), *got = malloc(3 * N * sizeof(float));
	float *master = malloc(N * sizeof(float)), *part_in = NULL;
	struct ze_tensor *t;
	struct ze_stats s0, s1;
	char *dir, err[256];
	struct ze_engine *e = nvme_engine(&dir);

	cr_assert(old != NULL && got != NULL && master != NULL);
	/* Aligned: the part goes to the disk from it, an I/O per array (nvme_xfer.c, SPLIT). */
	cr_assert_eq(posix_memalign((void **)&part_in, 4096, 3 * PART * sizeof(float)), 0);
	for (int k = 0; k < 2; k++) {
		/* First another tensor's state on the swap space, then freed. */
		cr_assert_eq(ze_tensor_new(e, &(struct ze_tensor_desc){ .name = k ? "w" : "old",
			.numel = N, .grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_F32,
			.policy = ZE_POLICY_NVME, .state_format = ZK_STATE_FP32 }, NULL, NULL, NULL,
		    &t, err, sizeof(err)), 0, "%s", err);
		if (k == 1)
			break;
		restore_values(old);
		all(e, t, true, old);
		ze_tensor_free(t);
	}
	/* A restore's split part of chunk 0, then the master alone (a registration's values). */
	fill(part_in, 3 * PART, 7);
	ze_engine_stats(e, &s0);
	part(e, t, true, PART, PART, part_in);
	ze_engine_stats(e, &s1);
	cr_assert_eq(s1.bytes_read, s0.bytes_read, "the part was not written split");
	fill(master, N, 8);
	ze_engine_stats(e, &s0);
	master_io(e, t, true, master);
	ze_engine_stats(e, &s1);
	cr_assert_gt(s1.bytes_written, s0.bytes_written, "no chunk written for m and v");
	all(e, t, false, got);
	cr_assert(memcmp(got, master, N * sizeof(float)) == 0, "the master differs");
	cr_assert(slot_is(t, ZK_DTYPE_F32, master), "the slot is not the master");
	for (int w = 1; w < 3; w++)
		for (size_t i = 0; i < N; i++)
			cr_assert_eq(got[(size_t)w * N + i], i >= PART && i < 2 * PART ?
			    part_in[(size_t)w * PART + i - PART] : 0.0f, "array %d, element %zu", w, i);
	ze_tensor_free(t);
	ze_engine_free(e);
	th_rmdir(dir);
	free(old);
	free(got);
	free(master);
	free(part_in);
}

Test(slot, other_dtypes_keep_a_copy)
{
	struct ze_engine *e = engine();
	struct ze_tensor *a = tensor(e, NULL, ZK_STATE_FP32, ZK_DTYPE_BF16, false);
	struct ze_tensor *b = tensor(e, NULL, ZK_STATE_BF16_Q8, ZK_DTYPE_F32, false);

	cr_assert_neq(ze_tensor_memory_raw(a, 0), ze_tensor_param_slot(a));
	cr_assert_neq(ze_tensor_memory_raw(b, 0), ze_tensor_param_slot(b));
	ze_tensor_free(a);
	ze_tensor_free(b);
	ze_engine_free(e);
}

/*
 * The client's descriptor of a slot that is the master binds it to reading:
 * no writable mapping, no write, no resize, no hole punched.
 */
Test(slot, client_cannot_write_it)
{
	struct ze_engine *e = engine();
	struct ze_tensor *t = tensor(e, NULL, ZK_STATE_FP32, ZK_DTYPE_F32, false);
	int fd = ze_tensor_param_fd(t);
	size_t bytes = (N * 4 + 4095) / 4096 * 4096;
	struct ze_tensor_fds fds;
	float one = 1.0f;
	void *map;

	cr_assert_eq(ze_tensor_memory_raw(t, 0), ze_tensor_param_slot(t));
	ze_tensor_fds(t, &fds);
	cr_assert_neq(fd, fds.param, "the client has the engine's own descriptor");
	cr_assert_eq(mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0), MAP_FAILED);
	cr_assert_eq(errno, EACCES);
	map = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
	cr_assert_neq(map, MAP_FAILED);
	cr_assert_neq(mprotect(map, bytes, PROT_READ | PROT_WRITE), 0);
	munmap(map, bytes);
	cr_assert_lt(pwrite(fd, &one, sizeof(one), 0), 0);
	cr_assert_neq(ftruncate(fd, 0), 0);
	cr_assert_neq(fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, 4096), 0);
	ze_tensor_free(t);
	ze_engine_free(e);
}

/*
 * A pinned tensor's slots and state of 4 MiB or more are in 2 MiB pages
 * whatever shmem_enabled says (memory.hugepages): the step streams them all,
 * and over 4 KiB pages it ran 8-10% slower.  Fails where a slot is mapped
 * off a 2 MiB boundary or not collapsed (the slots were in 4 KiB pages);
 * skipped where the kernel collapses no shared memory.  Without
 * memory.hugepages they stay in small pages.
 */
Test(slot, large_slots_and_state_in_huge_pages)
{
	size_t numel = 2u << 20, bytes = numel * sizeof(float);

	if (!th_kernel_collapses_shmem())
		cr_skip_test("this kernel does not collapse shared memory into huge pages");
	for (int huge = 1; huge >= 0; huge--) {
		struct ze_engine *e;
		struct ze_tensor *t;
		char err[256];
		void *grad, *param;

		cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 256u << 20,
			.numa_node = -1, .shm_budget = 256u << 20, .worker_threads = 2,
			.journal = true, .hugepages = huge, .isa = zk_isa_best() }, NULL, &callbacks,
		    NULL, &e, err, sizeof(err)), 0, "%s", err);
		cr_assert_eq(ze_tensor_new(e, &(struct ze_tensor_desc){ .name = "w", .numel = numel,
			.grad_dtype = ZK_DTYPE_F32, .param_dtype = ZK_DTYPE_F32,
			.policy = ZE_POLICY_CPU, .state_format = ZK_STATE_FP32 }, NULL, NULL, NULL, &t,
		    err, sizeof(err)), 0, "%s", err);
		grad = ze_tensor_grad_slot(t);
		param = ze_tensor_param_slot(t);
		if (huge) {
			cr_assert_eq((uintptr_t)grad % (2u << 20), 0);
			cr_assert_eq((uintptr_t)param % (2u << 20), 0);
			cr_assert_eq(th_shmem_pmd_kib(grad), bytes / 1024, "grad slot: %lu KiB of %zu "
			    "in 2 MiB pages", th_shmem_pmd_kib(grad), bytes / 1024);
			cr_assert_eq(th_shmem_pmd_kib(param), bytes / 1024, "param slot: %lu KiB of %zu "
			    "in 2 MiB pages", th_shmem_pmd_kib(param), bytes / 1024);
			/* m and v, one mapping: every whole 2 MiB page of it. */
			cr_assert_geq(th_shmem_pmd_kib(ze_tensor_memory_raw(t, 1)), 2 * bytes / 1024 - 2048,
			    "state: %lu KiB in 2 MiB pages",
			    th_shmem_pmd_kib(ze_tensor_memory_raw(t, 1)));
		} else {
			cr_assert_eq(th_shmem_pmd_kib(grad), 0);
			cr_assert_eq(th_shmem_pmd_kib(param), 0);
		}
		ze_tensor_free(t);
		ze_engine_free(e);
	}
}

/* t's descriptors, duplicated: they outlive it, as the fd store keeps them. */
static struct ze_tensor_fds
kept_fds(struct ze_tensor *t)
{
	struct ze_tensor_fds f, d;

	ze_tensor_fds(t, &f);
	d = (struct ze_tensor_fds){ .record = dup(f.record), .state = dup(f.state),
		.grad = dup(f.grad), .param = dup(f.param) };
	cr_assert(d.record >= 0 && d.state >= 0 && d.grad >= 0 && d.param >= 0);
	return d;
}

/*
 * Taken back by another engine from its kept descriptors: a tensor whose
 * slot is its master comes back so (master is the kept slot, with its
 * values), and a version 1 record (an earlier daemon's, which kept every
 * master in the state) comes back with its master in its state, as made.
 */
Test(slot, taken_back_from_kept_descriptors)
{
	static float init[3 * N], back[3 * N];
	struct ze_engine *e = engine(), *e2 = engine();
	struct ze_tensor *a = tensor(e, NULL, ZK_STATE_FP32, ZK_DTYPE_F32, false);
	struct ze_tensor *b = tensor(e, NULL, ZK_STATE_FP32, ZK_DTYPE_BF16, false);
	struct ze_tensor_fds fa, fb;
	struct ze_adopt_report rep;
	struct ze_tensor *a2, *b2;
	uint32_t v1 = 1;
	char err[256];

	fill(init, 3 * N, 7);
	all(e, a, true, init);
	all(e, b, true, init);
	fa = kept_fds(a);
	fb = kept_fds(b);
	ze_tensor_free(a);
	ze_tensor_free(b);
	/* The version field, past the 8-byte magic (outside the checksum). */
	cr_assert_eq(pwrite(fb.record, &v1, sizeof(v1), 8), (ssize_t)sizeof(v1));
	cr_assert_eq(ze_tensor_adopt(e2, &fa, NULL, NULL, NULL, &a2, &rep, err, sizeof(err)), 0,
	    "%s", err);
	cr_assert_eq(ze_tensor_adopt(e2, &fb, NULL, NULL, NULL, &b2, &rep, err, sizeof(err)), 0,
	    "%s", err);
	cr_assert_eq(ze_tensor_memory_raw(a2, 0), ze_tensor_param_slot(a2));
	cr_assert_neq(ze_tensor_memory_raw(b2, 0), ze_tensor_param_slot(b2));
	all(e2, a2, false, back);
	cr_assert(memcmp(back, init, sizeof(back)) == 0, "the slot-master tensor came back changed");
	all(e2, b2, false, back);
	cr_assert(memcmp(back, init, sizeof(back)) == 0, "the version 1 tensor came back changed");
	ze_tensor_free(a2);
	ze_tensor_free(b2);
	ze_engine_free(e);
	ze_engine_free(e2);
}

/* A memfd with fd's bytes now: what a SIGKILL at this instant would leave in it. */
static int
snapshot(int fd)
{
	struct stat st;
	off64_t in = 0, out = 0;
	int c = memfd_create("snapshot", MFD_CLOEXEC);

	cr_assert(c >= 0 && fstat(fd, &st) == 0 && ftruncate(c, st.st_size) == 0);
	while (in < st.st_size)
		cr_assert_gt(copy_file_range(fd, &in, c, &out, (size_t)(st.st_size - in), 0), 0);
	return c;
}

/* Holds worker 0 in its first block until worker 1 has finished its range, then snapshots. */
struct crash {
	struct ze_tensor_fds fds;
	int journal;
	float before;			/* the last element's master before the step */
	struct ze_tensor_fds kept;
	int kept_journal;
	bool fired;
};

static void
crash_gate(void *arg, uint64_t step, uint64_t unit, uint64_t block)
{
	struct crash *c = arg;
	float last;

	/* Worker 1 comes here too, for its own blocks. */
	if (block != 0 || __atomic_exchange_n(&c->fired, true, __ATOMIC_ACQ_REL))
		return;
	/*
	 * Worker 1's range ends with the tensor's last, short q8 block: once the
	 * last element has changed, its range is done but for its record, a few
	 * stores later (the wait after is for those; a slow machine that missed
	 * it leaves a record inside the range, which the test passes too).
	 */
	for (int i = 0; i < 5000; i++) {
		cr_assert_eq(pread(c->fds.param, &last, sizeof(last), (off_t)(N - 1) * 4),
		    (ssize_t)sizeof(last));
		if (last != c->before)
			break;
		nanosleep(&(struct timespec){ .tv_nsec = 1000000 }, NULL);
	}
	nanosleep(&(struct timespec){ .tv_nsec = 20000000 }, NULL);
	c->kept = (struct ze_tensor_fds){ .record = snapshot(c->fds.record),
		.state = snapshot(c->fds.state), .grad = snapshot(c->fds.grad),
		.param = snapshot(c->fds.param) };
	c->kept_journal = snapshot(c->journal);
}

/*
 * A crash while one worker of a slice is mid-block and the other has
 * finished its range, which ends on the tensor's short last q8 block: the
 * journal finishes the slice at adoption, bit for bit the uninterrupted
 * step.  The finished worker's record (its range's end, nothing half
 * done) was stepped again as an empty range from there, which a q8 range
 * must not start at: the slice came back torn (-EINVAL).
 */
Test(slot, crash_with_a_worker_done_at_a_short_last_block)
{
	static float init[3 * N], want[3 * N], got[3 * N];
	struct crash c = { 0 };
	struct ze_engine *e, *e2;
	struct ze_tensor *t, *t2, *ts[1];
	struct ze_adopt_report rep;
	char err[256];
	int r;

	cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 256u << 20,
		.numa_node = -1, .shm_budget = 256u << 20, .worker_threads = 2, .journal = true,
		.isa = zk_isa_best(), .block_gate = { crash_gate, &c } }, NULL, &callbacks, NULL,
	    &e, err, sizeof(err)), 0, "%s", err);
	t = tensor(e, NULL, ZK_STATE_Q8, ZK_DTYPE_F32, false);
	fill(init, 3 * N, 3);
	for (size_t i = 0; i < N; i++)
		init[2 * N + i] = init[N + i] * init[N + i];
	all(e, t, true, init);
	ze_tensor_fds(t, &c.fds);
	c.journal = ze_engine_journal_fd(e);
	c.before = init[N - 1];
	ts[0] = t;
	step(e, ts, 1, ZK_OPTIM_ADAMW, 1);
	cr_assert(c.fired, "the gate was not reached");
	all(e, t, false, want);
	e2 = NULL;
	cr_assert_eq(ze_engine_new(&(struct ze_config){ .pinned_budget = 256u << 20,
		.numa_node = -1, .shm_budget = 256u << 20, .worker_threads = 2, .journal = true,
		.kept_journal_fd = c.kept_journal, .isa = zk_isa_best() }, NULL, &callbacks, NULL,
	    &e2, err, sizeof(err)), 0, "%s", err);
	r = ze_tensor_adopt(e2, &c.kept, NULL, NULL, NULL, &t2, &rep, err, sizeof(err));
	cr_assert_eq(r, 0, "%s", err);
	cr_assert_eq(rep.finish_error, 0, "the journal could not finish the slice: %d",
	    rep.finish_error);
	cr_assert_eq(rep.torn_step, 0);
	cr_assert_eq(rep.last_step, 1);
	all(e2, t2, false, got);
	cr_assert(memcmp(got, want, sizeof(got)) == 0, "not the uninterrupted step's state");
	ze_tensor_free(t2);
	ze_tensor_free(t);
	ze_engine_free(e2);
	ze_engine_free(e);
}

/* Visible: Criterion's sandbox finds main by symbol to start test workers. */
__attribute__((visibility("default"))) int
main(int argc, char **argv)
{
	return th_main(argc, argv, th_environment_problem);
}
