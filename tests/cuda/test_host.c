/* libzclient_cuda without a GPU: partitioning, errno mapping, argument checks before any launch. */
#include <criterion/criterion.h>
#include <errno.h>
#include <string.h>

#include "zclient_cuda.h"
#include "zk_cuda.h"

Test(partition, covers_every_element_once)
{
	static const uint64_t sizes[] = { 1, 2, 127, 128, 129, 1000, 4097, 1u << 20, 12345679 };

	for (size_t i = 0; i < sizeof(sizes) / sizeof(sizes[0]); i++) {
		for (uint32_t world = 1; world <= 9; world++) {
			uint64_t covered = 0, next = 0;

			for (uint32_t rank = 0; rank < world; rank++) {
				struct zcc_partition p;

				cr_assert_eq(zcc_partition(sizes[i], world, rank, 128, &p), 0);
				cr_assert_eq(p.shard_numel % 128, 0);
				cr_assert_eq(p.padded_numel, p.shard_numel * world);
				cr_assert_geq(p.padded_numel, sizes[i]);
				/* Padding is less than one aligned piece per rank. */
				cr_assert_lt(p.padded_numel - sizes[i], (uint64_t)world * 128 + world);
				cr_assert_eq(p.offset, next);
				cr_assert_leq(p.valid, p.shard_numel);
				if (p.valid < p.shard_numel)
					cr_assert_geq(p.offset + p.valid, sizes[i]);
				covered += p.valid;
				next += p.shard_numel;
			}
			cr_assert_eq(covered, sizes[i], "numel %llu world %u",
			    (unsigned long long)sizes[i], world);
		}
	}
}

Test(partition, align_zero_means_one)
{
	struct zcc_partition p;

	cr_assert_eq(zcc_partition(10, 3, 2, 0, &p), 0);
	cr_assert_eq(p.shard_numel, 4);
	cr_assert_eq(p.offset, 8);
	cr_assert_eq(p.valid, 2);
}

Test(partition, rejects_bad_arguments)
{
	struct zcc_partition p;

	cr_assert_eq(zcc_partition(10, 0, 0, 1, &p), -EINVAL);
	cr_assert_eq(zcc_partition(10, 2, 2, 1, &p), -EINVAL);
	cr_assert_eq(zcc_partition(0, 2, 0, 1, &p), -EINVAL);
	cr_assert_neq(strstr(zcc_errmsg(), "partition"), NULL);
	cr_assert_eq(zcc_partition(UINT64_MAX, 2, 0, 1u << 20, &p), -EOVERFLOW);
}

Test(zero3, option_and_count_without_an_object)
{
	cr_assert_eq(zcc_zero3_set_param_offload(NULL, true), -EINVAL);
	cr_assert_neq(strstr(zcc_errmsg(), "zcc_zero3_set_param_offload"), NULL);
	cr_assert_eq(zcc_zero3_submitted(NULL), 0);
}

Test(errors, cuda_and_nccl_map_to_errno)
{
	cr_assert_eq(zcc_errno_cuda(cudaSuccess), 0);
	cr_assert_eq(zcc_errno_cuda(cudaErrorMemoryAllocation), -ENOMEM);
	cr_assert_eq(zcc_errno_cuda(cudaErrorInvalidValue), -EINVAL);
	cr_assert_eq(zcc_errno_cuda(cudaErrorNoDevice), -ENODEV);
	cr_assert_eq(zcc_errno_cuda(cudaErrorHostMemoryAlreadyRegistered), -EEXIST);
	cr_assert_eq(zcc_errno_cuda(cudaErrorLaunchFailure), -EIO);
	cr_assert_eq(zcc_errno_nccl(ncclSuccess), 0);
	cr_assert_eq(zcc_errno_nccl(ncclInvalidArgument), -EINVAL);
	cr_assert_eq(zcc_errno_nccl(ncclRemoteError), -ECONNRESET);
	cr_assert_eq(zcc_errno_nccl(ncclSystemError), -EIO);
}

Test(kernels, bad_arguments_fail_before_launch)
{
	uint64_t n = 4;
	void *p = NULL;
	struct zcc_grad_stats *stats = NULL;

	cr_assert_eq(zcc_cast(NULL, ZC_F32, NULL, ZC_BF16, 0, NULL), 0);
	cr_assert_eq(zcc_cast(NULL, ZC_F32, NULL, ZC_BF16, 5, NULL), -EINVAL);
	cr_assert_eq(zcc_cast((void *)16, (enum zc_dtype)7, (void *)32, ZC_BF16, 5, NULL), -EINVAL);
	/* fp32 -> bf16 in place would let threads read what others already wrote. */
	cr_assert_eq(zcc_cast((void *)16, ZC_F32, (void *)16, ZC_BF16, 5, NULL), -EINVAL);
	cr_assert_neq(strstr(zcc_errmsg(), "zcc_cast"), NULL);
	cr_assert_eq(zcc_unscale_norm(&p, &n, 1, ZC_BF16, 1.0f, false, stats, NULL), -EINVAL);
	/* Rejected in C, before it becomes the kernels' C++ enum (UBSan: an invalid enum load). */
	cr_assert_eq(zcc_unscale_norm(&p, &n, 1, (enum zc_dtype)9, 1.0f, false,
	    (struct zcc_grad_stats *)&n, NULL), -EINVAL);
	cr_assert_neq(strstr(zcc_errmsg(), "unknown dtype 9"), NULL);
	cr_assert_eq(zcc_flatten((void *)16, (const void *const *)&p, &n, 1, 2, NULL), -EINVAL);
	cr_assert_eq(zcc_unflatten((void *)16, &p, &n, 1, 3, NULL), -EINVAL);
	/* Nothing to do is not an error, and launches nothing. */
	cr_assert_eq(zkc_flatten(NULL, NULL, NULL, 0, 4, NULL), 0);
}
