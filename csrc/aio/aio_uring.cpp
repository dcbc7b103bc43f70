// io_uring backend: one ring per worker thread, up to queue_depth chunks in
// flight, SQEs batched into one io_uring_submit_and_wait, every CQE checked,
// short transfers and -EAGAIN resubmitted for the remainder.
#include "aio_engine.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>

#ifdef INFINITY_HAVE_LIBURING
#include <liburing.h>
#endif

namespace infinity_aio {

#ifdef INFINITY_HAVE_LIBURING

bool built_with_liburing() { return true; }

int uring_probe() {
    struct io_uring ring;
    int r = io_uring_queue_init(4, &ring, 0);
    if (r < 0) return -r;
    struct io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    io_uring_prep_nop(sqe);
    r = io_uring_submit_and_wait(&ring, 1);
    int res = 0;
    if (r < 0) {
        res = -r;
    } else {
        struct io_uring_cqe* cqe = nullptr;
        r = io_uring_peek_cqe(&ring, &cqe);
        if (r < 0) res = -r;
        else if (cqe->res < 0) res = -cqe->res;
        if (cqe) io_uring_cqe_seen(&ring, cqe);
    }
    io_uring_queue_exit(&ring);
    return res;
}

namespace {

struct Slot {
    WorkItem item;
    char* bounce = nullptr;  // lazily allocated, block_size bytes
    uint64_t done = 0;
    bool busy = false;
};

class UringWorker : public Worker {
public:
    UringWorker(uint64_t block_size, uint32_t queue_depth)
        : bs_(block_size), qd_(queue_depth), slots_(queue_depth) {
        unsigned flags = 0;
#ifdef IORING_SETUP_COOP_TASKRUN
        flags |= IORING_SETUP_COOP_TASKRUN;
#endif
        int r = io_uring_queue_init(qd_, &ring_, flags);
        if (r == -EINVAL && flags) r = io_uring_queue_init(qd_, &ring_, 0);
        if (r < 0)
            throw AioOsError(-r, "", 0, 0,
                             std::string("cannot create an io_uring (queue depth ") +
                                 std::to_string(qd_) + "): " + strerror(-r));
        for (uint32_t i = 0; i < qd_; ++i) free_.push_back(qd_ - 1 - i);
    }
    ~UringWorker() override {
        io_uring_queue_exit(&ring_);
        for (auto& s : slots_) free(s.bounce);
        free(partial_bounce_);
    }

    void run(WorkQueue& q) override {
        std::vector<WorkItem> batch;
        uint32_t inflight = 0;
        for (;;) {
            bool queue_drained = true;
            uint32_t room = qd_ - inflight;
            if (room > 0) {
                batch.clear();
                size_t n = q.pop(batch, room, /*block=*/inflight == 0);
                if (n == 0 && inflight == 0) {
                    if (q.stopping()) return;
                    continue;
                }
                queue_drained = n < room;
                for (auto& it : batch) {
                    Chunk& c = it.req->chunks[it.idx];
                    if (c.kind == CK_PARTIAL) {  // small, locked read-modify-write: do it here
                        if (!partial_bounce_)
                            partial_bounce_ = static_cast<char*>(aligned_alloc_bytes(4096, 1u << 16));
                        run_partial_sync(*it.req, c, partial_bounce_);
                        continue;
                    }
                    uint32_t si = free_.back();
                    free_.pop_back();
                    Slot& s = slots_[si];
                    s.item = std::move(it);
                    s.done = 0;
                    s.busy = true;
                    if (c.kind == CK_BOUNCE) {
                        if (!s.bounce) s.bounce = static_cast<char*>(aligned_alloc_bytes(4096, bs_));
                        if (s.item.req->op == OP_WRITE) memcpy(s.bounce, c.buf, c.len);
                    }
                    prep(si);
                    ++inflight;
                }
            }
            if (inflight == 0) continue;
            unsigned wait_nr = (inflight == qd_ || queue_drained) ? 1 : 0;
            int r = io_uring_submit_and_wait(&ring_, wait_nr);
            if (r < 0 && r != -EINTR && r != -EAGAIN && r != -EBUSY) {
                // Should not happen; fall back to waiting for whatever is in flight.
                struct io_uring_cqe* cqe;
                io_uring_wait_cqe(&ring_, &cqe);
            }
            inflight -= reap();
        }
    }

private:
    void prep(uint32_t si) {
        Slot& s = slots_[si];
        const Chunk& c = s.item.req->chunks[s.item.idx];
        char* buf = (c.kind == CK_BOUNCE ? s.bounce : c.buf) + s.done;
        unsigned len = (unsigned)(c.len - s.done);
        uint64_t off = c.offset + s.done;
        struct io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        while (!sqe) {  // SQ full (cannot happen with qd entries, but be safe)
            io_uring_submit(&ring_);
            sqe = io_uring_get_sqe(&ring_);
        }
        if (s.item.req->op == OP_READ)
            io_uring_prep_read(sqe, c.file->fd(), buf, len, off);
        else
            io_uring_prep_write(sqe, c.file->fd(), buf, len, off);
        io_uring_sqe_set_data(sqe, (void*)(uintptr_t)(si + 1));
    }

    // Processes all available completions; returns how many slots were released.
    uint32_t reap() {
        uint32_t released = 0;
        struct io_uring_cqe* cqe;
        unsigned head, seen = 0;
        io_uring_for_each_cqe(&ring_, head, cqe) {
            ++seen;
            uint32_t si = (uint32_t)(uintptr_t)io_uring_cqe_get_data(cqe) - 1;
            if (complete(si, cqe->res)) ++released;
        }
        io_uring_cq_advance(&ring_, seen);
        return released;
    }

    // Returns true when the slot is released (done or failed), false when resubmitted.
    bool complete(uint32_t si, int res) {
        Slot& s = slots_[si];
        Request& req = *s.item.req;
        const Chunk& c = req.chunks[s.item.idx];
        File* f = c.file;
        if (res == -EAGAIN || res == -EINTR) {
            prep(si);
            return false;
        }
        if (res < 0 || res == 0) {
            int e = res < 0 ? -res : (req.op == OP_READ ? ENODATA : EIO);
            std::string what =
                e == ENODATA
                    ? "read of " + std::to_string(c.len) + " bytes at offset " + std::to_string(c.offset) +
                          " in " + f->path() + " goes past the end of the data"
                    : std::string(req.op == OP_READ ? "read" : "write") + " of " +
                          std::to_string(c.len - s.done) + " bytes at offset " +
                          std::to_string(c.offset + s.done) + " in " + f->path() +
                          " failed: " + strerror(e);
            req.chunk_failed(e, f, c.offset + s.done, c.len - s.done, what);
            release(si);
            return true;
        }
        s.done += (uint64_t)res;
        if (s.done < c.len) {
            uint64_t A = f->direct() ? f->offset_align() : 1;
            if (req.op == OP_READ && (c.offset + s.done) % A != 0) {  // short read at end of file
                req.chunk_failed(ENODATA, f, c.offset, c.len,
                                 "read of " + std::to_string(c.len) + " bytes at offset " +
                                     std::to_string(c.offset) + " in " + f->path() +
                                     " goes past the end of the data (only " +
                                     std::to_string(s.done) + " bytes there)");
                release(si);
                return true;
            }
            prep(si);  // short transfer: resubmit the remainder
            return false;
        }
        if (c.kind == CK_BOUNCE && req.op == OP_READ) memcpy(c.buf, s.bounce, c.len);
        req.chunk_done(f, c.len);
        release(si);
        return true;
    }

    void release(uint32_t si) {
        slots_[si].busy = false;
        slots_[si].item.req.reset();
        free_.push_back(si);
    }

    uint64_t bs_;
    uint32_t qd_;
    struct io_uring ring_;
    std::vector<Slot> slots_;
    std::vector<uint32_t> free_;
    char* partial_bounce_ = nullptr;
};

}  // namespace

std::unique_ptr<Worker> make_uring_worker(uint64_t block_size, uint32_t queue_depth) {
    return std::unique_ptr<Worker>(new UringWorker(block_size, queue_depth));
}

#else  // !INFINITY_HAVE_LIBURING

bool built_with_liburing() { return false; }
int uring_probe() { return ENOSYS; }
std::unique_ptr<Worker> make_uring_worker(uint64_t, uint32_t) {
    throw AioOsError(ENOSYS, "", 0, 0,
                     "infinity was built without liburing: install liburing-dev and rebuild "
                     "(bash scripts/setup.sh), or use engine='posix'");
}

#endif

}  // namespace infinity_aio
