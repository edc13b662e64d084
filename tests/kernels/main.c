/* Entry point of the kernels tests: picks the ISA under test and exits 77 when the CPU lacks it. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>

#include "helpers.h"

static const char *isa_env(void)
{
	const char *s = getenv("ZK_TEST_ISA");

	return s && *s ? s : NULL;
}

bool test_isa_enabled(enum zk_isa isa)
{
	const char *s = isa_env();
	enum zk_isa want;

	if (!zk_isa_supported(isa))
		return false;
	if (!s)
		return true;
	return zk_isa_parse(s, &want) == 0 && want == isa;
}

bool test_general_enabled(void)
{
	const char *s = isa_env();

	return !s || !strcmp(s, "scalar");
}

long first_mismatch(const void *a, const void *b, enum zk_dtype dtype, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		if (dtype == ZK_DTYPE_F32) {
			uint32_t x = ((const uint32_t *)a)[i], y = ((const uint32_t *)b)[i];

			if (x != y && !(f32_nan(x) && f32_nan(y)))
				return (long)i;
		} else {
			uint16_t x = ((const uint16_t *)a)[i], y = ((const uint16_t *)b)[i];
			bool nx = dtype == ZK_DTYPE_BF16 ? bf16_nan(x) : f16_nan(x);
			bool ny = dtype == ZK_DTYPE_BF16 ? bf16_nan(y) : f16_nan(y);

			if (x != y && !(nx && ny))
				return (long)i;
		}
	}
	return -1;
}

/*
 * Default visibility: the project builds with -fvisibility=hidden, and
 * Criterion (BoxFort) finds main by name in the worker processes it spawns.
 */
__attribute__((visibility("default"))) int main(int argc, char *argv[]);

int main(int argc, char *argv[])
{
	const char *s = isa_env();
	struct criterion_test_set *tests;
	enum zk_isa isa;
	int result = 0;

	if (s) {
		if (zk_isa_parse(s, &isa) < 0) {
			fprintf(stderr, "ZK_TEST_ISA=%s: unknown ISA\n", s);
			return 1;
		}
		if (!zk_isa_supported(isa)) {
			fprintf(stderr, "ZK_TEST_ISA=%s: this CPU lacks it, skipped\n", s);
			return 77;
		}
	}
	tests = criterion_initialize();
	if (criterion_handle_args(argc, argv, true))
		result = !criterion_run_all_tests(tests);
	criterion_finalize(tests);
	return result;
}
