/* zclient.h must compile on its own, first and alone, as users include it. */
#include "zclient.h"

int
main(void)
{
	struct zc_tensor_desc desc = { .name = "x", .numel = 1 };

	return desc.numel == 1 && ZC_F32 == 0 ? 0 : 1;
}
