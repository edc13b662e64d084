/* --check-config's checks of a parsed configuration against this machine. */
#ifndef ZD_CONFIG_CHECK_H
#define ZD_CONFIG_CHECK_H

#include <stdio.h>

#include "config.h"

/*
 * Swap paths exist (or their directory does) and are writable by the caller,
 * their capacities fit the free space of their file systems (said how much is
 * free), none is on a memory file system unless swap.allow_memory_fs, and
 * socket.group exists.  Writes one "ok: " or "error: " line per finding to
 * out; returns the number of errors.
 */
unsigned zd_config_check_host(const struct zd_config *cfg, FILE *out);

#endif
