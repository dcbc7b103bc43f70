// Engine core: request bookkeeping, chunking (aligned / bounce / partial
// blocks), the shared queue, synchronous chunk execution used by the POSIX
// backend and for partial blocks, and the worker pool.
#include "aio_engine.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <unistd.h>

namespace infinity_aio {

constexpr uint32_t kMaxBounceAlign = 1u << 16;  // largest DIO offset alignment we bounce

// ----------------------------------------------------------------- Request

void Request::finish_one() {
    if (remaining.fetch_sub(1, std::memory_order_acq_rel) == 1) {
        {
            std::lock_guard<std::mutex> g(mu_);
            finished_.store(true, std::memory_order_release);
        }
        cv_.notify_all();
        if (on_finish) on_finish();
    }
}

void Request::chunk_done(File* f, uint64_t nbytes) {
    if (f) f->io_end();
    bytes_.fetch_add(nbytes, std::memory_order_relaxed);
    finish_one();
}

void Request::chunk_failed(int err, File* f, uint64_t off, uint64_t len, const std::string& what) {
    if (f) f->io_end();
    {
        std::lock_guard<std::mutex> g(mu_);
        if (err_ == 0) {
            err_ = err ? err : EIO;
            err_path_ = f ? f->path() : std::string();
            err_off_ = off;
            err_len_ = len;
            err_msg_ = what;
        }
    }
    finish_one();
}

uint64_t Request::wait() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return finished_.load(std::memory_order_acquire); });
    return bytes_.load();
}

// --------------------------------------------------------------- WorkQueue

void WorkQueue::push_many(const std::shared_ptr<Request>& req) {
    {
        std::lock_guard<std::mutex> g(mu_);
        for (uint32_t i = 0; i < req->chunks.size(); ++i) q_.push_back(WorkItem{req, i});
    }
    cv_.notify_all();
}

size_t WorkQueue::pop(std::vector<WorkItem>& out, size_t max, bool block) {
    std::unique_lock<std::mutex> g(mu_);
    if (block) cv_.wait(g, [&] { return stop_ || !q_.empty(); });
    size_t n = 0;
    while (n < max && !q_.empty()) {
        out.push_back(std::move(q_.front()));
        q_.pop_front();
        ++n;
    }
    return n;
}

void WorkQueue::stop() {
    {
        std::lock_guard<std::mutex> g(mu_);
        stop_ = true;
    }
    cv_.notify_all();
}

// ------------------------------------------------------- synchronous I/O

namespace {

std::string describe(int op, const File* f, uint64_t off, uint64_t len, int err) {
    return std::string(op == OP_READ ? "read" : "write") + " of " + std::to_string(len) +
           " bytes at offset " + std::to_string(off) + " in " + f->path() + " failed: " +
           strerror(err);
}

// Full pread/pwrite loop; returns bytes transferred (< len only at EOF for
// reads) or -errno.
int64_t xfer_all(int op, int fd, char* buf, uint64_t len, uint64_t off, bool stop_at_eof,
                 uint64_t align = 1) {
    uint64_t done = 0;
    while (done < len) {
        ssize_t r = op == OP_READ ? ::pread(fd, buf + done, len - done, (off_t)(off + done))
                                  : ::pwrite(fd, buf + done, len - done, (off_t)(off + done));
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            return -(int64_t)errno;
        }
        if (r == 0) {
            if (op == OP_READ && stop_at_eof) break;
            return op == OP_READ ? -(int64_t)ENODATA : -(int64_t)EIO;
        }
        done += (uint64_t)r;
        // A short O_DIRECT read that stops off alignment is the end of the file;
        // asking again at an unaligned offset would only give EINVAL.
        if (op == OP_READ && stop_at_eof && done < len && (off + done) % align != 0) break;
    }
    return (int64_t)done;
}

}  // namespace

bool run_partial_sync(Request& req, const Chunk& c, char* bounce) {
    File* f = c.file;
    const uint64_t A = f->offset_align();
    const uint64_t in_block = c.offset - c.block;
    f->lock_block(c.block);
    int64_t got = xfer_all(OP_READ, f->fd(), bounce, A, c.block, /*stop_at_eof=*/true, A);
    if (got < 0) {
        f->unlock_block(c.block);
        req.chunk_failed((int)-got, f, c.offset, c.len, describe(OP_READ, f, c.block, A, (int)-got));
        return false;
    }
    if (req.op == OP_READ) {
        f->unlock_block(c.block);
        if ((uint64_t)got < in_block + c.len) {
            req.chunk_failed(ENODATA, f, c.offset, c.len,
                             "read of " + std::to_string(c.len) + " bytes at offset " +
                                 std::to_string(c.offset) + " in " + f->path() +
                                 " goes past the end of the data (file holds " +
                                 std::to_string(c.block + (uint64_t)got) + " bytes)");
            return false;
        }
        memcpy(c.buf, bounce + in_block, c.len);
        req.chunk_done(f, c.len);
        return true;
    }
    if ((uint64_t)got < A) memset(bounce + got, 0, A - (uint64_t)got);
    memcpy(bounce + in_block, c.buf, c.len);
    int64_t put = xfer_all(OP_WRITE, f->fd(), bounce, A, c.block, false);
    // The whole block was written: if it ends past the logical size, the zero
    // padding is cut off once the file is idle (File::io_end).
    if (put >= 0 && c.block + A > f->logical_size()) f->mark_padded();
    f->unlock_block(c.block);
    if (put < 0) {
        req.chunk_failed((int)-put, f, c.offset, c.len, describe(OP_WRITE, f, c.block, A, (int)-put));
        return false;
    }
    req.chunk_done(f, c.len);
    return true;
}

bool run_chunk_sync(Request& req, const Chunk& c, char* bounce) {
    File* f = c.file;
    if (c.kind == CK_PARTIAL) return run_partial_sync(req, c, bounce);
    char* buf = c.kind == CK_BOUNCE ? bounce : c.buf;
    if (c.kind == CK_BOUNCE && req.op == OP_WRITE) memcpy(bounce, c.buf, c.len);
    int64_t r = xfer_all(req.op, f->fd(), buf, c.len, c.offset, /*stop_at_eof=*/true,
                         f->direct() ? f->offset_align() : 1);
    if (r < 0) {
        int e = (int)-r;
        if (e == ENODATA)
            req.chunk_failed(e, f, c.offset, c.len,
                             "read of " + std::to_string(c.len) + " bytes at offset " +
                                 std::to_string(c.offset) + " in " + f->path() +
                                 " goes past the end of the data");
        else
            req.chunk_failed(e, f, c.offset, c.len, describe(req.op, f, c.offset, c.len, e));
        return false;
    }
    if ((uint64_t)r < c.len) {
        req.chunk_failed(ENODATA, f, c.offset, c.len,
                         "read of " + std::to_string(c.len) + " bytes at offset " +
                             std::to_string(c.offset) + " in " + f->path() +
                             " goes past the end of the data (only " + std::to_string(r) +
                             " bytes there)");
        return false;
    }
    if (c.kind == CK_BOUNCE && req.op == OP_READ) memcpy(c.buf, bounce, c.len);
    req.chunk_done(f, c.len);
    return true;
}

// ------------------------------------------------------------------ Engine

Engine::Engine(const std::string& kind, uint64_t block_size, uint32_t queue_depth, uint32_t threads)
    : kind_(kind), block_size_(block_size), queue_depth_(queue_depth), threads_(threads) {
    if (block_size_ < 4096 || block_size_ % 4096 != 0)
        throw std::invalid_argument("block_size must be a positive multiple of 4096, got " +
                                    std::to_string(block_size_));
    if (queue_depth_ < 1 || queue_depth_ > 4096)
        throw std::invalid_argument("queue_depth must be in 1..4096");
    if (threads_ < 1 || threads_ > 256) throw std::invalid_argument("threads must be in 1..256");
    if (kind_ != "uring" && kind_ != "posix")
        throw std::invalid_argument("engine kind must be 'uring' or 'posix', got '" + kind_ + "'");
    for (uint32_t t = 0; t < threads_; ++t) {
        if (kind_ == "uring")
            workers_.push_back(make_uring_worker(block_size_, queue_depth_));
        else
            workers_.push_back(make_posix_worker(block_size_, kMaxBounceAlign));
    }
    for (auto& w : workers_) {
        Worker* wp = w.get();
        threads_v_.emplace_back([this, wp] { wp->run(queue_); });
    }
}

Engine::~Engine() { close(); }

void Engine::split(Request& r) {
    for (auto& s : r.segments) {
        File* f = s.file.get();
        const uint64_t A = f->direct() ? f->offset_align() : 1;
        const uint64_t M = f->direct() ? f->mem_align() : 1;
        if (A > kMaxBounceAlign)
            throw std::invalid_argument("direct I/O alignment of " + f->path() + " is " +
                                        std::to_string(A) + " bytes, more than supported");
        uint64_t bs = block_size_ / A * A;
        if (bs == 0) bs = A;
        const uint64_t off = s.offset, end = s.offset + s.len;
        r.total += s.len;
        if (s.len == 0) continue;
        if (r.op == OP_WRITE) f->note_write_end(end);
        if (A == 1) {
            for (uint64_t o = off; o < end; o += bs) {
                uint64_t n = std::min(bs, end - o);
                r.chunks.push_back(Chunk{f, s.buf + (o - off), o, (uint32_t)n, CK_DIRECT, 0});
            }
            continue;
        }
        const uint64_t lo = (off + A - 1) / A * A;  // first aligned offset inside
        const uint64_t hi = end / A * A;            // last aligned offset inside
        const uint64_t head_block = off / A * A, tail_block = hi;
        if (off % A != 0) {  // head partial block
            uint64_t n = std::min(end, head_block + A) - off;
            r.chunks.push_back(Chunk{f, s.buf, off, (uint32_t)n, CK_PARTIAL, head_block});
        }
        if (lo < hi) {
            for (uint64_t o = lo; o < hi; o += bs) {
                uint64_t n = std::min(bs, hi - o);
                char* p = s.buf + (o - off);
                int kind = ((uintptr_t)p % M == 0) ? CK_DIRECT : CK_BOUNCE;
                r.chunks.push_back(Chunk{f, p, o, (uint32_t)n, kind, 0});
            }
        }
        if (end % A != 0 && !(off % A != 0 && tail_block == head_block)) {  // tail partial block
            uint64_t start = std::max(off, tail_block);
            r.chunks.push_back(Chunk{f, s.buf + (start - off), start, (uint32_t)(end - start),
                                     CK_PARTIAL, tail_block});
        }
    }
}

std::shared_ptr<Request> Engine::submit(int op, std::vector<Segment> segs) {
    auto r = std::make_shared<Request>(op, std::move(segs));
    split(*r);
    {
        std::lock_guard<std::mutex> g(out_mu_);
        if (closed_) throw std::runtime_error("the I/O engine is closed");
        ++outstanding_;
    }
    r->on_finish = [this] {
        {
            std::lock_guard<std::mutex> g(out_mu_);
            --outstanding_;
        }
        out_cv_.notify_all();
    };
    if (r->chunks.empty()) {
        r->remaining = 1;
        r->chunk_done(nullptr, 0);
        return r;
    }
    r->remaining = (int64_t)r->chunks.size();
    for (auto& c : r->chunks) c.file->io_begin(1);
    queue_.push_many(r);
    return r;
}

void Engine::drain() {
    std::unique_lock<std::mutex> g(out_mu_);
    out_cv_.wait(g, [&] { return outstanding_ == 0; });
}

void Engine::close() {
    {
        std::lock_guard<std::mutex> g(out_mu_);
        if (closed_) return;
        closed_ = true;
    }
    drain();
    queue_.stop();
    for (auto& t : threads_v_)
        if (t.joinable()) t.join();
    threads_v_.clear();
    workers_.clear();
}

}  // namespace infinity_aio
