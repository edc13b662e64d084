/* Entry point of the GPU kernel tests: exits 77 (skipped) when no CUDA device is usable. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

/*
 * Counted in a child: a process that has initialised CUDA must not fork, and
 * Criterion runs every test in a child of this one.
 */
static int
gpu_count(void)
{
	int status, n = 0;
	pid_t pid;

	fflush(NULL);
	pid = fork();
	if (pid < 0)
		return 0;
	if (pid == 0) {
		if (cudaGetDeviceCount(&n) != cudaSuccess)
			n = 0;
		_exit(n > 100 ? 100 : n);
	}
	if (waitpid(pid, &status, 0) != pid || !WIFEXITED(status))
		return 0;
	return WEXITSTATUS(status);
}

/*
 * Default visibility: the project builds with -fvisibility=hidden, and
 * Criterion (BoxFort) finds main by name in the worker processes it spawns.
 */
__attribute__((visibility("default"))) int main(int argc, char *argv[]);

int
main(int argc, char *argv[])
{
	struct criterion_test_set *tests;
	int result = 0;

	if (gpu_count() == 0) {
		fprintf(stderr, "no usable CUDA device: skipped\n");
		return 77;
	}
	tests = criterion_initialize();
	if (criterion_handle_args(argc, argv, true))
		result = !criterion_run_all_tests(tests);
	criterion_finalize(tests);
	return result;
}
