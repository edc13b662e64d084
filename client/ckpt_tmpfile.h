/*
 * A rank file's temporary, while a save writes it: `.rank-RRRRR-of-WWWWW.safetensors.PID.tmp`
 * beside where it goes, under an exclusive flock(2) from its creation until it is renamed
 * into place.  A writer that dies (killed mid-save) leaves it unlocked, and the next save
 * into the directory, or a restore or inspect of it, removes it; a locked one belongs to
 * a live writer (or the daemon still writing through its descriptor) and stays.
 * Shared by libzclient and zoffctl; no connection needed.
 */
#ifndef ZCK_TMPFILE_H
#define ZCK_TMPFILE_H

/*
 * Creates (or truncates) path for writing and locks it: its descriptor, or -errno.  A
 * cleaner that took the name away before the lock was ours makes it try again.  Where
 * the file system has no flock the file stays unlocked (and no cleaner can lock it).
 */
int zck_tmp_create(const char *path);

/* Removes dir's temporaries of dead writers: how many, or -errno if dir cannot be read. */
int zck_tmp_remove_stale(const char *dir);

#endif
