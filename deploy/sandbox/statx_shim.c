/*
 * statx shim for gVisor (runsc) releases that reject AT_NO_AUTOMOUNT.
 *
 * Debian bookworm's runsc (release 20221219) answers every statx() call that
 * carries AT_NO_AUTOMOUNT with EINVAL. coreutils passes that flag, so `ls -l`,
 * `stat`, `cp -p` and friends fail with "Invalid argument" under gVisor. This
 * library, listed in /etc/ld.so.preload, retries such a call once without the
 * flag (a sandbox has no automount points, so the flag changes nothing there).
 * Under runc, and under a gVisor that accepts the flag, the first call succeeds
 * and the shim is a pass-through. It depends on nothing but syscall(2), so it
 * survives image and gVisor upgrades.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sys/syscall.h>
#include <unistd.h>

struct statx;

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
	long ret = syscall(SYS_statx, dirfd, path, flags, mask, buf);
	if (ret == -1 && errno == EINVAL && (flags & AT_NO_AUTOMOUNT))
		ret = syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
	return (int)ret;
}
