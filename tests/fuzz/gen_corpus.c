/* Writes one valid encoded message of every type the codec knows into a directory: the proto fuzzer's seeds. */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto.h"

/* Fields that pass validation for the types this file knows; other types are tried with a zero payload. */
static void
fill(struct zp_msg *m)
{
	switch (m->hdr.type) {
	case ZP_HELLO:
		strcpy(m->u.hello.client_name, "pid 4242");
		break;
	case ZP_JOB_OPEN:
		strcpy(m->u.job_open.job_name, "llama-7b");
		m->u.job_open.rank = 3;
		m->u.job_open.world_size = 8;
		m->u.job_open.policy = ZP_POLICY_AUTO;
		m->u.job_open.pinned_budget = 8ull << 30;
		break;
	case ZP_JOB_DROP:
		strcpy(m->u.job_drop.job_name, "llama-7b");
		break;
	case ZP_TENSOR_REGISTER:
		strcpy(m->u.tensor_register.name, "layers.0.attn.wq");
		m->u.tensor_register.numel = 4096 * 512;
		m->u.tensor_register.grad_dtype = ZP_DTYPE_BF16;
		m->u.tensor_register.param_dtype = ZP_DTYPE_BF16;
		m->u.tensor_register.flags = ZP_TENSOR_PARAM_OFFLOAD;
		break;
	case ZP_TENSOR_UNREGISTER:
		m->u.tensor_handle.handle = 7;
		break;
	case ZP_TENSOR_SET_STEP:
		m->u.tensor_step = (struct zp_tensor_step){ .handle = 7, .step = 120 };
		break;
	case ZP_PARAM_FETCH:
	case ZP_PARAM_RELEASE:
		m->u.handles.count = 3;
		for (uint32_t i = 0; i < m->u.handles.count; i++)
			m->u.handles.handles[i] = 2 * i + 1;
		break;
	case ZP_GRAD_PASS:
		m->u.grad_pass.grad_scale = 1024;
		m->u.grad_pass.count = 2;
		m->u.grad_pass.handles[0] = 3;
		m->u.grad_pass.handles[1] = 5;
		break;
	case ZP_GRAD_PARTIAL:
		m->u.grad_partial = (struct zp_grad_partial){ .sumsq = 12.5, .nonfinite = 0,
			.elements = 1u << 20 };
		break;
	case ZP_PARAM_READY:
		m->u.param_ready.handle = 7;
		m->u.param_ready.error = -EIO;
		break;
	case ZP_TENSOR_WRITE:
	case ZP_TENSOR_READ:
		m->u.tensor_io.handle = 7;
		m->u.tensor_io.state = ZP_STATE_EXP_AVG;
		m->u.tensor_io.offset = 4096;
		m->u.tensor_io.count = 1u << 20;
		break;
	case ZP_STEP_SUBMIT: {
		struct zp_step_submit *s = &m->u.step_submit;

		s->step = 12;
		s->optim = ZP_OPTIM_ADAMW;
		s->flags = ZP_STEP_CHECK_FINITE;
		s->lr = 1e-4;
		s->beta1 = 0.9;
		s->beta2 = 0.95;
		s->eps = 1e-8;
		s->weight_decay = 0.1;
		s->grad_scale = 65536;
		s->max_grad_norm = 1.0;
		s->count = 5;
		for (uint32_t i = 0; i < s->count; i++)
			s->handles[i] = i + 1;
		break;
	}
	case ZP_ERROR:
		m->u.error.code = -ENOSPC;
		strcpy(m->u.error.message, "tensor 'w' needs 1.5 GiB of optimizer state");
		break;
	case ZP_HELLO_OK:
		m->u.hello_ok.session_id = 9;
		m->u.hello_ok.uid = 1000;
		strcpy(m->u.hello_ok.daemon_version, "0.1.0");
		break;
	case ZP_JOB_OK:
		m->u.job_ok.job_id = 2;
		m->u.job_ok.last_step = 11;
		break;
	case ZP_TENSOR_OK:
		m->u.tensor_ok.handle = 7;
		m->u.tensor_ok.grad_bytes = 4096;
		m->u.tensor_ok.param_bytes = 4096;
		m->u.tensor_ok.resumed = 1;
		m->u.tensor_ok.last_step = 11;
		break;
	case ZP_XFER_OK:
		m->u.xfer_ok.bytes = 16u << 20;
		break;
	case ZP_JSON_FD:
		m->u.json_fd.bytes = 200u << 10;
		break;
	case ZP_JSON:
		m->u.json.text = "{\"sessions\":1,\"tiers\":{\"pinned\":{\"used_bytes\":0}}}";
		m->u.json.len = (uint32_t)strlen(m->u.json.text);
		break;
	case ZP_CKPT_WRITE:
	case ZP_CKPT_READ:
		m->u.ckpt_write = (struct zp_ckpt_write){ .handle = 7, .offset = 0,
			.count = 1u << 20, .format = 2, .file_offset = { 4096, 4096 + (4u << 20),
			4096 + (4u << 20) + 16384, 4096 + (5u << 20) + 16384, 4096 + (6u << 20) +
			16384 } };
		break;
	case ZP_CKPT_DONE:
		m->u.ckpt_done = (struct zp_ckpt_done){ .crc = { 0xe3069283u, 1, 2, 3, 4 },
			.last_step = 12 };
		break;
	case ZP_TENSOR_DONE:
		m->u.tensor_done.handle = 7;
		m->u.tensor_done.step = 12;
		m->u.tensor_done.status = ZP_STEP_SKIPPED_NONFINITE;
		break;
	case ZP_STEP_DONE:
		m->u.step_done.step = 12;
		m->u.step_done.grad_norm = 0.75;
		m->u.step_done.latency_ns = 1500000;
		m->u.step_done.count = 5;
		break;
	default:
		break;
	}
}

int
main(int argc, char **argv)
{
	static struct zp_msg m, back;
	static uint8_t buf[ZP_MAX_MESSAGE];
	unsigned written = 0;

	if (argc != 2) {
		fprintf(stderr, "usage: %s DIR\n", argv[0]);
		return 2;
	}
	for (unsigned type = 1; type < 256; type++) {
		const char *name = zp_type_name((uint16_t)type);
		char path[4096], lower[64];
		size_t len, i;
		FILE *f;

		if (name == NULL)
			continue;
		memset(&m, 0, sizeof(m));
		m.hdr.type = (uint16_t)type;
		m.hdr.request_id = 1000 + type;
		fill(&m);
		/* Only seeds that decode: a seed the decoder refuses teaches the fuzzer little. */
		if (zp_encode(&m, buf, sizeof(buf), &len) != ZP_S_OK ||
		    zp_decode(buf, len, &back, NULL, 0) != ZP_S_OK) {
			fprintf(stderr, "%s: no valid seed (fill it in gen_corpus.c)\n", name);
			continue;
		}
		for (i = 0; name[i] != '\0' && i < sizeof(lower) - 1; i++)
			lower[i] = (char)tolower((unsigned char)name[i]);
		lower[i] = '\0';
		snprintf(path, sizeof(path), "%s/%s.bin", argv[1], lower);
		f = fopen(path, "wb");
		if (f == NULL || fwrite(buf, 1, len, f) != len || fclose(f) != 0) {
			fprintf(stderr, "%s: %s\n", path, strerror(errno));
			return 1;
		}
		written++;
	}
	printf("%u seeds written to %s\n", written, argv[1]);
	return 0;
}
