// POSIX backend: each worker thread executes one chunk at a time with
// pread/pwrite. Used when io_uring is unavailable (seccomp, sysctl, no liburing).
#include <cstdlib>

#include "aio_engine.h"

namespace infinity_aio {

namespace {

class PosixWorker : public Worker {
public:
    PosixWorker(uint64_t block_size, uint32_t max_align)
        : bounce_size_(block_size > max_align ? block_size : max_align) {}
    ~PosixWorker() override { free(bounce_); }

    void run(WorkQueue& q) override {
        std::vector<WorkItem> batch;
        for (;;) {
            batch.clear();
            if (q.pop(batch, 1, /*block=*/true) == 0) return;  // stopping
            WorkItem& it = batch[0];
            const Chunk& c = it.req->chunks[it.idx];
            if (c.kind != CK_DIRECT && !bounce_)
                bounce_ = static_cast<char*>(aligned_alloc_bytes(kPage, bounce_size_));
            run_chunk_sync(*it.req, c, bounce_);
        }
    }

private:
    static constexpr size_t kPage = 4096;
    uint64_t bounce_size_;
    char* bounce_ = nullptr;
};

}  // namespace

std::unique_ptr<Worker> make_posix_worker(uint64_t block_size, uint32_t max_align) {
    return std::unique_ptr<Worker>(new PosixWorker(block_size, max_align));
}

}  // namespace infinity_aio
