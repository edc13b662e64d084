/* Replays files through a fuzz target without libFuzzer, so builds without clang still run every seed; takes libFuzzer's arguments. */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int
run_file(const char *path)
{
	uint8_t *data = NULL;
	size_t len = 0, cap = 0, n;
	FILE *f = fopen(path, "rb");

	if (f == NULL) {
		fprintf(stderr, "%s: %s\n", path, strerror(errno));
		return -1;
	}
	do {
		if (cap - len < 4096) {
			uint8_t *bigger = realloc(data, cap = cap ? cap * 2 : 8192);

			if (bigger == NULL) {
				fclose(f);
				free(data);
				return -1;
			}
			data = bigger;
		}
		n = fread(data + len, 1, cap - len, f);
		len += n;
	} while (n > 0);
	fclose(f);
	LLVMFuzzerTestOneInput(data, len);
	free(data);
	return 0;
}

int
main(int argc, char **argv)
{
	unsigned files = 0;

	for (int i = 1; i < argc; i++) {
		struct stat st;

		/* libFuzzer's options (-runs=0, -dict=...) mean nothing here. */
		if (argv[i][0] == '-')
			continue;
		if (stat(argv[i], &st) != 0) {
			fprintf(stderr, "%s: %s\n", argv[i], strerror(errno));
			return 1;
		}
		if (S_ISDIR(st.st_mode)) {
			struct dirent *e;
			DIR *dir = opendir(argv[i]);

			if (dir == NULL)
				return 1;
			while ((e = readdir(dir)) != NULL) {
				char path[4096];

				if (e->d_name[0] == '.')
					continue;
				snprintf(path, sizeof(path), "%s/%s", argv[i], e->d_name);
				if (run_file(path) != 0)
					return 1;
				files++;
			}
			closedir(dir);
		} else {
			if (run_file(argv[i]) != 0)
				return 1;
			files++;
		}
	}
	printf("%u inputs replayed\n", files);
	return files > 0 ? 0 : 1;
}
