/* The engine's result codes as text and errno: the swap engine's list, the one the engine reports through. */
#include "engine_impl.h"
#include "swap.h"

const char *
ze_strerror(int code)
{
	return zs_strerror(code);
}

int
ze_errno(int code)
{
	return zs_errno(code);
}
