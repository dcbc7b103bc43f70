// An open file for the I/O engine: descriptor, O_DIRECT alignment, and the
// per-block locks that serialise read-modify-write of partially covered blocks.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <stdexcept>
#include <string>

namespace infinity_aio {

// An OS error with the context a user needs: errno, path, offset, length.
struct AioOsError : std::runtime_error {
    int err;
    std::string path;
    uint64_t offset, length;
    AioOsError(int e, std::string p, uint64_t off, uint64_t len, const std::string& msg)
        : std::runtime_error(msg), err(e), path(std::move(p)), offset(off), length(len) {}
};

class File {
public:
    // Opens (or creates, mode 0600 unless given) `path`. With `direct`, tries
    // O_DIRECT first and falls back to buffered I/O when the file system refuses
    // it (then `direct_refused()` is true so the caller can warn once).
    static std::shared_ptr<File> open(const std::string& path, bool create, bool direct,
                                      bool truncate, int mode);
    // An anonymous file (O_TMPFILE) inside directory `dir`: never visible in the
    // directory, its blocks are released when the last descriptor closes, even
    // after SIGKILL. Falls back to create-0600-then-unlink when O_TMPFILE is refused.
    static std::shared_ptr<File> open_tmpfile(const std::string& dir, bool direct);

    ~File();
    File(const File&) = delete;
    File& operator=(const File&) = delete;

    int fd() const { return fd_; }
    const std::string& path() const { return path_; }
    bool direct() const { return direct_; }
    bool direct_refused() const { return direct_refused_; }
    uint32_t mem_align() const { return mem_align_; }       // 1 when buffered
    uint32_t offset_align() const { return offset_align_; } // 1 when buffered
    std::string align_source() const { return align_source_; }

    uint64_t size() const;                       // fstat size
    void fallocate(uint64_t offset, uint64_t len);  // throws AioOsError (ENOSPC...)
    void truncate(uint64_t size);
    void close();  // waits for in-flight chunks, then closes; idempotent; also in the destructor

    // Logical size: the largest end of any write submitted so far (or the size
    // at open). A padded read-modify-write of a tail block grows the file past
    // it (mark_padded()); the padding is cut off when the file becomes idle:
    // io_end() of the last in-flight chunk truncates, while io_begin() of new
    // chunks waits. Truncating while O_DIRECT I/O is in flight on the same file
    // system block would race with the page-cache zeroing of that block.
    void note_write_end(uint64_t end);
    void io_begin(int64_t nchunks);
    void io_end();
    void mark_padded() { padded_.store(true); }
    uint64_t logical_size() const { return logical_size_.load(); }
    void trim_padding();  // caller holds io_mu_ (or the file is idle)

    // Block-range lock for read-modify-write of shared (partially covered) blocks.
    void lock_block(uint64_t block_start);
    void unlock_block(uint64_t block_start);

private:
    File() = default;
    void discover_alignment();

    int fd_ = -1;
    std::string path_;
    bool direct_ = false, direct_refused_ = false;
    uint32_t mem_align_ = 1, offset_align_ = 1;
    std::string align_source_ = "buffered";
    std::atomic<uint64_t> logical_size_{0};
    std::mutex size_mu_;
    std::mutex io_mu_;
    int64_t inflight_ = 0;
    std::condition_variable idle_cv_;
    std::atomic<bool> padded_{false};
    std::mutex lock_mu_;
    std::condition_variable lock_cv_;
    std::set<uint64_t> locked_;
};

// Allocates `len` bytes aligned to `align` (at least a page); throws std::bad_alloc.
void* aligned_alloc_bytes(size_t align, size_t len);

}  // namespace infinity_aio
