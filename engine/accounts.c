/* The engine's accounts: what a job may hold pinned and on swap, shared by its tensors by reference. */
#include <errno.h>
#include <stdlib.h>

#include "engine_impl.h"

int
ze_account_new(const struct ze_account_limits *l, struct ze_account **ret)
{
	struct ze_account *a = calloc(1, sizeof(*a));

	if (a == NULL)
		return -ENOMEM;
	a->refs = 1;
	a->limits = *l;
	*ret = a;
	return 0;
}

struct ze_account *
ze_account_ref(struct ze_account *a)
{
	a->refs++;
	return a;
}

void
ze_account_unref(struct ze_account *a)
{
	if (a == NULL || --a->refs > 0)
		return;
	free(a);
}

void
ze_account_set_limits(struct ze_account *a, const struct ze_account_limits *l)
{
	a->limits = *l;
}

void
ze_account_usage(const struct ze_account *a, uint64_t *ret_pinned, uint64_t *ret_swap)
{
	*ret_pinned = a->pinned_bytes;
	*ret_swap = a->swap_bytes;
}
