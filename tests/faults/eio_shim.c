/* An LD_PRELOAD shim that makes a file system fail: once the file named by
 * EIO_SHIM_TRIGGER exists, every open, read, write and sync of a file under
 * the directory EIO_SHIM_DIR fails with EIO, as a dying disk's would.
 *
 * Built by tests/faults/test_failing_disk.py:
 *     gcc -shared -fPIC -O2 -o eio_shim.so eio_shim.c -ldl
 *
 * The errors reach the process through the C library, exactly where the
 * kernel's would: Python's os module sees an OSError with errno EIO. Other
 * files (sockets, the DRAM arena in /dev/shm, imports) are untouched. Once
 * the trigger was seen the disk stays failed, as a real one does.
 */
/* The fortified inline wrappers of read() and open() would clash with ours. */
#undef _FORTIFY_SOURCE
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <unistd.h>

static volatile int failed; /* the trigger was seen: failing for good */

static const char *dir_prefix(size_t *len) {
    static char prefix[PATH_MAX];
    static size_t prefix_len;
    static int ready;
    if (!ready) {
        const char *dir = getenv("EIO_SHIM_DIR");
        if (dir != NULL && dir[0] != '\0' && strlen(dir) + 2 < sizeof prefix) {
            strcpy(prefix, dir);
            prefix_len = strlen(prefix);
            if (prefix[prefix_len - 1] != '/') {
                prefix[prefix_len++] = '/';
                prefix[prefix_len] = '\0';
            }
        }
        ready = 1;
    }
    *len = prefix_len;
    return prefix_len ? prefix : NULL;
}

static int triggered(void) {
    if (failed) return 1;
    const char *trigger = getenv("EIO_SHIM_TRIGGER");
    if (trigger == NULL || trigger[0] == '\0') return 0;
    int saved = errno;
    struct stat st;
    /* stat is not wrapped here: no recursion. */
    if (stat(trigger, &st) == 0) failed = 1;
    errno = saved;
    return failed;
}

static int path_under(const char *path) {
    size_t len;
    const char *prefix = dir_prefix(&len);
    if (prefix == NULL || path == NULL) return 0;
    char real[PATH_MAX];
    const char *p = path;
    if (path[0] != '/') {
        /* Relative: resolve against the working directory. */
        char cwd[PATH_MAX];
        if (getcwd(cwd, sizeof cwd) == NULL) return 0;
        if ((size_t)snprintf(real, sizeof real, "%s/%s", cwd, path) >= sizeof real) return 0;
        p = real;
    }
    if (strncmp(p, prefix, len) == 0) return 1;
    /* The directory itself: the prefix without its slash. */
    return strncmp(p, prefix, len - 1) == 0 && p[len - 1] == '\0';
}

static int fd_under(int fd) {
    if (fd < 0) return 0;
    char link[64], target[PATH_MAX];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    int saved = errno;
    ssize_t n = readlink(link, target, sizeof target - 1);
    errno = saved;
    if (n <= 0) return 0;
    target[n] = '\0';
    return path_under(target);
}

static int fail_fd(int fd) {
    if (!triggered() || !fd_under(fd)) return 0;
    errno = EIO;
    return 1;
}

static int fail_path(int dirfd, const char *path) {
    if (!triggered()) return 0;
    if (path != NULL && path[0] != '/' && dirfd != AT_FDCWD) {
        if (!fd_under(dirfd)) return 0;
    } else if (!path_under(path)) {
        return 0;
    }
    errno = EIO;
    return 1;
}

#define REAL(name) \
    static __typeof__(&name) real_##name; \
    if (real_##name == NULL) real_##name = (__typeof__(&name))dlsym(RTLD_NEXT, #name)

/* -- reads and writes ------------------------------------------------------ */
ssize_t read(int fd, void *buf, size_t n) {
    REAL(read);
    if (fail_fd(fd)) return -1;
    return real_read(fd, buf, n);
}

ssize_t write(int fd, const void *buf, size_t n) {
    REAL(write);
    if (fail_fd(fd)) return -1;
    return real_write(fd, buf, n);
}

ssize_t readv(int fd, const struct iovec *iov, int cnt) {
    REAL(readv);
    if (fail_fd(fd)) return -1;
    return real_readv(fd, iov, cnt);
}

ssize_t writev(int fd, const struct iovec *iov, int cnt) {
    REAL(writev);
    if (fail_fd(fd)) return -1;
    return real_writev(fd, iov, cnt);
}

#define POSITIONED(name, buf_t)                                   \
    ssize_t name(int fd, buf_t buf, size_t n, off_t off) {        \
        REAL(name);                                               \
        if (fail_fd(fd)) return -1;                               \
        return real_##name(fd, buf, n, off);                      \
    }
POSITIONED(pread, void *)
POSITIONED(pread64, void *)
POSITIONED(pwrite, const void *)
POSITIONED(pwrite64, const void *)

#define VECTORED(name)                                                      \
    ssize_t name(int fd, const struct iovec *iov, int cnt, off_t off) {     \
        REAL(name);                                                         \
        if (fail_fd(fd)) return -1;                                         \
        return real_##name(fd, iov, cnt, off);                              \
    }
VECTORED(preadv)
VECTORED(preadv64)
VECTORED(pwritev)
VECTORED(pwritev64)

#define VECTORED2(name)                                                              \
    ssize_t name(int fd, const struct iovec *iov, int cnt, off_t off, int flags) {   \
        REAL(name);                                                                  \
        if (fail_fd(fd)) return -1;                                                  \
        return real_##name(fd, iov, cnt, off, flags);                                \
    }
VECTORED2(preadv2)
VECTORED2(preadv64v2)
VECTORED2(pwritev2)
VECTORED2(pwritev64v2)

int fsync(int fd) {
    REAL(fsync);
    if (fail_fd(fd)) return -1;
    return real_fsync(fd);
}

int fdatasync(int fd) {
    REAL(fdatasync);
    if (fail_fd(fd)) return -1;
    return real_fdatasync(fd);
}

/* -- opening --------------------------------------------------------------- */
static mode_t mode_arg(int flags, va_list ap) {
    return (flags & O_CREAT) || (flags & __O_TMPFILE) == __O_TMPFILE ? va_arg(ap, mode_t) : 0;
}

#define OPEN(name)                                          \
    int name(const char *path, int flags, ...) {            \
        REAL(name);                                         \
        va_list ap;                                         \
        va_start(ap, flags);                                \
        mode_t mode = mode_arg(flags, ap);                  \
        va_end(ap);                                         \
        if (fail_path(AT_FDCWD, path)) return -1;           \
        return real_##name(path, flags, mode);              \
    }
OPEN(open)
OPEN(open64)

#define OPENAT(name)                                        \
    int name(int dirfd, const char *path, int flags, ...) { \
        REAL(name);                                         \
        va_list ap;                                         \
        va_start(ap, flags);                                \
        mode_t mode = mode_arg(flags, ap);                  \
        va_end(ap);                                         \
        if (fail_path(dirfd, path)) return -1;              \
        return real_##name(dirfd, path, flags, mode);       \
    }
OPENAT(openat)
OPENAT(openat64)
