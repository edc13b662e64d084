/* Internal to libzclient: what its other files (checkpoints) need from the connection. */
#ifndef ZCLIENT_IMPL_H
#define ZCLIENT_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "proto.h"
#include "zclient.h"

/*
 * Names start with zci_, not zc_: the version script exports zc_* only.
 * zci_rpc_fd sends req with sendfd (-1: none), waits for reply_type; the
 * reply stays valid until the next request on the connection.
 */
int zci_rpc_fd(struct zc_conn *c, struct zp_msg *req, uint16_t reply_type, int sendfd,
    const struct zp_msg **reply);
int zci_seterr(struct zc_conn *c, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
/* False when no job is open. */
bool zci_job_rank(const struct zc_conn *c, uint32_t *rank, uint32_t *world_size);
/* zc_tensor_register, where init NULL means the caller writes master itself next. */
int zci_tensor_register(struct zc_conn *c, const struct zc_tensor_desc *desc, const float *init,
    struct zc_tensor **ret);
const char *zci_tensor_name(const struct zc_tensor *t);
uint32_t zci_tensor_handle(const struct zc_tensor *t);
bool zci_tensor_pending(const struct zc_tensor *t);
struct zc_conn *zci_tensor_conn(const struct zc_tensor *t);

#endif
