// File: opening with O_DIRECT (falling back to buffered), DIO alignment
// discovery via statx(STATX_DIOALIGN), fallocate/truncate, block locks.
#include "aio_file.h"

#include <cerrno>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef O_TMPFILE
#define O_TMPFILE (020000000 | O_DIRECTORY)
#endif
#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#endif

namespace infinity_aio {

namespace {

std::string errmsg(int e) { return std::string(strerror(e)); }

// Raw statx, so that we do not depend on glibc knowing stx_dio_*_align.
// Layout of struct statx (include/uapi/linux/stat.h): stx_mask at 0,
// stx_blksize at 4, stx_dio_mem_align at 152, stx_dio_offset_align at 156.
bool statx_dioalign(int fd, uint32_t* mem, uint32_t* off, uint32_t* blksize) {
#ifdef SYS_statx
    alignas(8) unsigned char buf[256];
    memset(buf, 0, sizeof buf);
    long r = syscall(SYS_statx, fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, buf);
    if (r != 0) return false;
    uint32_t mask, m, o, b;
    memcpy(&mask, buf + 0, 4);
    memcpy(&b, buf + 4, 4);
    memcpy(&m, buf + 152, 4);
    memcpy(&o, buf + 156, 4);
    *blksize = b;
    if (!(mask & STATX_DIOALIGN)) return false;
    *mem = m;
    *off = o;
    return true;
#else
    (void)fd; (void)mem; (void)off; (void)blksize;
    return false;
#endif
}

// queue/logical_block_size of block device maj:min (a partition's queue is its parent's);
// 0 when unknown (not a block device: tmpfs, NFS, ...) or not a power of two in [512, 64K].
uint32_t sysfs_logical_block_size(unsigned maj, unsigned min) {
    const char* fmts[] = {"/sys/dev/block/%u:%u/queue/logical_block_size",
                          "/sys/dev/block/%u:%u/../queue/logical_block_size"};
    for (const char* fmt : fmts) {
        char path[128];
        std::snprintf(path, sizeof path, fmt, maj, min);
        FILE* f = std::fopen(path, "re");
        if (!f) continue;
        unsigned long v = 0;
        int n = std::fscanf(f, "%lu", &v);
        std::fclose(f);
        if (n == 1 && v >= 512 && v <= 65536 && (v & (v - 1)) == 0) return (uint32_t)v;
    }
    return 0;
}

}  // namespace

void* aligned_alloc_bytes(size_t align, size_t len) {
    if (align < 4096) align = 4096;
    if (len == 0) len = align;
    void* p = nullptr;
    if (posix_memalign(&p, align, (len + align - 1) / align * align) != 0) throw std::bad_alloc();
    return p;
}

std::shared_ptr<File> File::open(const std::string& path, bool create, bool direct,
                                 bool truncate, int mode) {
    std::shared_ptr<File> f(new File());
    f->path_ = path;
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT : 0) | (truncate ? O_TRUNC : 0);
    int fd = -1;
    if (direct) {
        fd = ::open(path.c_str(), flags | O_DIRECT, mode);
        if (fd < 0 && errno == EINVAL) {
            f->direct_refused_ = true;
            direct = false;
        } else if (fd < 0) {
            int e = errno;
            throw AioOsError(e, path, 0, 0, "cannot open " + path + ": " + errmsg(e));
        }
    }
    if (fd < 0) {
        fd = ::open(path.c_str(), flags, mode);
        if (fd < 0) {
            int e = errno;
            throw AioOsError(e, path, 0, 0, "cannot open " + path + ": " + errmsg(e));
        }
    }
    f->fd_ = fd;
    f->direct_ = direct;
    if (direct) f->discover_alignment();
    f->logical_size_ = f->size();
    return f;
}

std::shared_ptr<File> File::open_tmpfile(const std::string& dir, bool direct) {
    std::shared_ptr<File> f(new File());
    f->path_ = dir + "/<anonymous swap file>";
    int flags = O_TMPFILE | O_RDWR | O_CLOEXEC;
    int fd = -1;
    if (direct) {
        fd = ::open(dir.c_str(), flags | O_DIRECT, 0600);
        if (fd < 0 && errno == EINVAL) {
            // Either O_TMPFILE or O_DIRECT is refused: try O_TMPFILE alone first.
            fd = ::open(dir.c_str(), flags, 0600);
            if (fd >= 0) { f->direct_refused_ = true; direct = false; }
        }
    } else {
        fd = ::open(dir.c_str(), flags, 0600);
    }
    if (fd < 0 && (errno == EOPNOTSUPP || errno == EISDIR || errno == EINVAL || errno == ENOENT)) {
        // No O_TMPFILE on this file system: create a unique 0600 file and unlink it at once.
        std::string tmpl = dir + "/swap-XXXXXX";
        std::string buf = tmpl;
        int tfd = mkostemp(&buf[0], O_CLOEXEC);
        if (tfd < 0) {
            int e = errno;
            throw AioOsError(e, dir, 0, 0, "cannot create a swap file in " + dir + ": " + errmsg(e));
        }
        ::fchmod(tfd, 0600);
        if (direct) {
            fd = ::open(buf.c_str(), O_RDWR | O_CLOEXEC | O_DIRECT);
            if (fd < 0) { f->direct_refused_ = true; direct = false; fd = tfd; tfd = -1; }
        } else {
            fd = tfd; tfd = -1;
        }
        ::unlink(buf.c_str());
        if (tfd >= 0) ::close(tfd);
    }
    if (fd < 0) {
        int e = errno;
        throw AioOsError(e, dir, 0, 0, "cannot create a swap file in " + dir + ": " + errmsg(e));
    }
    f->fd_ = fd;
    f->direct_ = direct;
    if (direct) f->discover_alignment();
    f->logical_size_ = 0;
    return f;
}

void File::discover_alignment() {
    uint32_t mem = 0, off = 0, blksize = 0;
    // INFINITY_AIO_IGNORE_STATX=1: behave as on a kernel without STATX_DIOALIGN (< 6.1)
    const char* no_statx = std::getenv("INFINITY_AIO_IGNORE_STATX");
    bool use_statx = !(no_statx && no_statx[0] && std::strcmp(no_statx, "0") != 0);
    if (use_statx && statx_dioalign(fd_, &mem, &off, &blksize)) {
        if (mem == 0 || off == 0) {
            // The kernel says: no direct I/O on this file. Reopen buffered.
            int flags = fcntl(fd_, F_GETFL);
            if (flags >= 0 && fcntl(fd_, F_SETFL, flags & ~O_DIRECT) == 0) {
                direct_ = false;
                direct_refused_ = true;
                mem_align_ = offset_align_ = 1;
                align_source_ = "buffered (statx: no direct I/O)";
                return;
            }
        } else {
            mem_align_ = mem;
            offset_align_ = off;
            align_source_ = "statx";
            return;
        }
    }
    // No STATX_DIOALIGN: the logical block size of the device (the file's own for a block
    // device, else the one its file system sits on, from sysfs), else 4096 (safe).
    struct stat st;
    uint32_t guess = 4096;
    if (fstat(fd_, &st) == 0) {
        if (S_ISBLK(st.st_mode)) {
            int lbs = 0;
            if (ioctl(fd_, BLKSSZGET, &lbs) == 0 && lbs > 0) guess = (uint32_t)lbs;
        } else {
            uint32_t lbs = sysfs_logical_block_size(major(st.st_dev), minor(st.st_dev));
            if (lbs) guess = lbs;
        }
    }
    mem_align_ = offset_align_ = guess;
    align_source_ = "fallback";
}

File::~File() { close(); }

void File::close() {
    {
        std::unique_lock<std::mutex> g(io_mu_);
        idle_cv_.wait(g, [&] { return inflight_ == 0; });
    }
    if (fd_ >= 0) {
        if (padded_.exchange(false)) trim_padding();
        ::close(fd_);
        fd_ = -1;
    }
}

uint64_t File::size() const {
    struct stat st;
    if (fstat(fd_, &st) != 0) {
        int e = errno;
        throw AioOsError(e, path_, 0, 0, "cannot stat " + path_ + ": " + errmsg(e));
    }
    return (uint64_t)st.st_size;
}

void File::fallocate(uint64_t offset, uint64_t len) {
    int r;
    do { r = ::fallocate(fd_, 0, (off_t)offset, (off_t)len); } while (r != 0 && errno == EINTR);
    if (r != 0) {
        int e = errno;
        if (e == EOPNOTSUPP) {  // file system without fallocate: extend the size instead
            if (::ftruncate(fd_, (off_t)(offset + len)) == 0) { note_write_end(offset + len); return; }
            e = errno;
        }
        throw AioOsError(e, path_, offset, len,
                         "cannot preallocate " + std::to_string(len) + " bytes at offset " +
                             std::to_string(offset) + " in " + path_ + ": " + errmsg(e));
    }
    note_write_end(offset + len);
}

void File::truncate(uint64_t size) {
    std::lock_guard<std::mutex> g(size_mu_);
    if (::ftruncate(fd_, (off_t)size) != 0) {
        int e = errno;
        throw AioOsError(e, path_, size, 0, "cannot truncate " + path_ + ": " + errmsg(e));
    }
    logical_size_ = size;
}

void File::note_write_end(uint64_t end) {
    uint64_t cur = logical_size_.load();
    while (end > cur && !logical_size_.compare_exchange_weak(cur, end)) {}
}

void File::io_begin(int64_t n) {
    std::lock_guard<std::mutex> g(io_mu_);
    inflight_ += n;
}

void File::io_end() {
    std::lock_guard<std::mutex> g(io_mu_);
    if (--inflight_ == 0) {
        if (padded_.exchange(false)) trim_padding();
        idle_cv_.notify_all();
    }
}

void File::trim_padding() {
    std::lock_guard<std::mutex> g(size_mu_);
    struct stat st;
    if (fstat(fd_, &st) != 0) return;
    uint64_t logical = logical_size_.load();
    if ((uint64_t)st.st_size > logical) {
        if (::ftruncate(fd_, (off_t)logical) != 0) { /* size is cosmetic; data is intact */ }
    }
}

void File::lock_block(uint64_t b) {
    std::unique_lock<std::mutex> g(lock_mu_);
    lock_cv_.wait(g, [&] { return locked_.count(b) == 0; });
    locked_.insert(b);
}

void File::unlock_block(uint64_t b) {
    {
        std::lock_guard<std::mutex> g(lock_mu_);
        locked_.erase(b);
    }
    lock_cv_.notify_all();
}

}  // namespace infinity_aio
