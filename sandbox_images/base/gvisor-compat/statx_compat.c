/*
 * gVisor up to at least release 20221219 (Debian bookworm's runsc) answers EINVAL to
 * statx() with AT_NO_AUTOMOUNT, which coreutils passes on every call: `ls -l`, `stat`, `du`
 * fail with "Invalid argument". Sandboxes have no automount points, so the flag changes
 * nothing there; this preload strips it. The exec agent preloads it for commands only when
 * the sandbox runs under runsc.
 */
#define _GNU_SOURCE
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int statx(int dirfd, const char *path, int flags, unsigned int mask, struct statx *buf)
{
    return (int)syscall(SYS_statx, dirfd, path, flags & ~AT_NO_AUTOMOUNT, mask, buf);
}
