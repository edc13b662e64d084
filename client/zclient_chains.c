/*
 * libzclient: requests of several chains in flight at once (a save's or a restore's
 * tensors, one request of each at a time), so that zoffloadd works on one tensor's file
 * while it moves another through the tiers.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>

#include "zclient_impl.h"

int
zci_chains_run(struct zc_conn *c, size_t n, unsigned ahead, uint16_t type,
    zci_chain_fn *advance, void *arg)
{
	uint64_t *req = calloc(n > 0 ? n : 1, sizeof(*req));
	size_t next = 0, active = 0;
	char first[sizeof(c->err)];
	int err = 0;

	if (req == NULL)
		return zci_seterr(c, -ENOMEM, "out of memory");
	err = zci_ready(c, NULL, ZCI_NO_DEADLINE);
	if (err < 0) {
		free(req);
		return err;
	}
	for (;;) {
		int64_t r;

		while (err == 0 && active < ahead && next < n) {
			r = advance(arg, next, NULL);
			if (r < 0) {
				err = (int)r;
				snprintf(first, sizeof(first), "%s", c->err);
			} else if (r > 0) {
				req[next] = (uint64_t)r;
				active++;
			}
			next++;
		}
		if (active == 0)
			break;
		r = zci_recv_reply(c, type, zci_deadline_after(c->timeout_ms));
		if (r < 0) {
			err = (int)r;	/* nothing more can be heard: the connection is gone */
			snprintf(first, sizeof(first), "%s", c->err);
			break;
		}
		for (size_t i = 0; i < next; i++) {
			if (req[i] == 0 || req[i] != c->msg->hdr.request_id)
				continue;
			req[i] = 0;
			active--;
			/* After an error the chains in flight are only waited for. */
			if (err < 0)
				break;
			r = advance(arg, i, c->msg);
			if (r < 0) {
				err = (int)r;
				snprintf(first, sizeof(first), "%s", c->err);
			} else if (r > 0) {
				req[i] = (uint64_t)r;
				active++;
			}
			break;
		}
	}
	free(req);
	if (err < 0)
		zci_seterr(c, err, "%s", first);
	return err;
}
