/* The dispatch table: one row for every request type, whose descriptors agree with the protocol's. */
#include <criterion/criterion.h>
#include <stdbool.h>
#include <stdint.h>

#include "proto.h"
#include "requests.h"

static const uint16_t all_types[] = {
#define TYPE(name, value) ZP_##name,
	ZP_TYPES(TYPE)
#undef TYPE
};

Test(requests, every_request_has_one_row_and_nothing_else_has_one)
{
	unsigned requests = 0;

	for (size_t i = 0; i < sizeof(all_types) / sizeof(all_types[0]); i++) {
		uint16_t t = all_types[i];
		const struct zd_request_row *row = zd_request_row(t);

		if (!zp_type_is_request(t)) {
			cr_expect_null(row, "%s is not a request but has a row", zp_type_name(t));
			continue;
		}
		requests++;
		cr_assert_not_null(row, "request %s has no row", zp_type_name(t));
		/* The transport passes what came; the row must expect what a client sends. */
		cr_expect_eq(row->fds, zp_type_fds(t), "%s: the table says %u descriptors, the "
		    "protocol %u", zp_type_name(t), row->fds, zp_type_fds(t));
		cr_expect(row->fds <= 1, "%s: no handler takes more than one descriptor",
		    zp_type_name(t));
		cr_expect((row->fds > 0) == (row->handle_fd != NULL) &&
		    (row->handle == NULL) == (row->handle_fd != NULL), "%s: exactly one handler, "
		    "the one for its descriptors", zp_type_name(t));
	}
	cr_expect_eq(zd_nrequests, requests, "%zu rows for %u requests", zd_nrequests, requests);
	for (size_t i = 0; i < zd_nrequests; i++)
		for (size_t j = i + 1; j < zd_nrequests; j++)
			cr_expect_neq(zd_requests[i].type, zd_requests[j].type, "%s has two rows",
			    zp_type_name(zd_requests[i].type));
}

/* A drain refuses what would start new work, and only that: the rest lets clients finish. */
Test(requests, a_drain_refuses_new_jobs_tensors_and_steps_only)
{
	for (size_t i = 0; i < zd_nrequests; i++) {
		uint16_t t = zd_requests[i].type;
		bool starts = t == ZP_JOB_OPEN || t == ZP_TENSOR_REGISTER || t == ZP_STEP_SUBMIT;

		cr_expect_eq(zd_requests[i].refused_draining, starts, "%s: refused while draining "
		    "is %d", zp_type_name(t), zd_requests[i].refused_draining);
	}
}
