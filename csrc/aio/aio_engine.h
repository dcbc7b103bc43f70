// The engine core: requests split into chunks, a shared chunk queue, and a
// fixed pool of worker threads (io_uring or POSIX backend) that drain it.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aio_file.h"

namespace infinity_aio {

enum Op : int { OP_READ = 0, OP_WRITE = 1 };

// How a chunk is executed.
enum ChunkKind : int {
    CK_DIRECT = 0,   // buffer, offset and length all aligned (or buffered file): straight I/O
    CK_BOUNCE = 1,   // offset/length aligned, buffer address not: through an aligned bounce buffer
    CK_PARTIAL = 2,  // a partially covered block: locked read-modify-write through a bounce buffer
};

struct Chunk {
    File* file;
    char* buf;          // user memory for this chunk
    uint64_t offset;    // file offset of the user bytes
    uint32_t len;       // user bytes
    int kind;
    uint64_t block;     // CK_PARTIAL: aligned start of the block
};

struct Segment {
    std::shared_ptr<File> file;
    char* buf;
    uint64_t offset;
    uint64_t len;
};

class Request {
public:
    Request(int op, std::vector<Segment> segs) : op(op), segments(std::move(segs)) {}
    const int op;
    std::vector<Segment> segments;  // keeps the files open until completion
    std::vector<Chunk> chunks;
    uint64_t total = 0;

    // Called by workers.
    // Both first tell the chunk's file (idle tracking), then the waiter.
    void chunk_done(File* f, uint64_t nbytes);
    void chunk_failed(int err, File* f, uint64_t off, uint64_t len, const std::string& what);

    // Called by the owner (GIL released by the binding).
    uint64_t wait();
    bool done() const { return finished_.load(std::memory_order_acquire); }
    int error() const { return err_; }
    const std::string& error_path() const { return err_path_; }
    uint64_t error_offset() const { return err_off_; }
    uint64_t error_length() const { return err_len_; }
    const std::string& error_message() const { return err_msg_; }
    uint64_t bytes() const { return bytes_.load(); }

    std::atomic<int64_t> remaining{0};
    std::function<void()> on_finish;  // set by the engine (outstanding-count bookkeeping)

private:
    void finish_one();
    std::atomic<uint64_t> bytes_{0};
    std::atomic<bool> finished_{false};
    std::mutex mu_;
    std::condition_variable cv_;
    int err_ = 0;
    std::string err_path_, err_msg_;
    uint64_t err_off_ = 0, err_len_ = 0;
};

struct WorkItem {
    std::shared_ptr<Request> req;
    uint32_t idx;
};

// Shared chunk queue (FIFO) between submitters and workers.
class WorkQueue {
public:
    void push_many(const std::shared_ptr<Request>& req);
    // Pops up to `max` items. Blocks while empty if `block`; returns 0 when
    // stopping and empty.
    size_t pop(std::vector<WorkItem>& out, size_t max, bool block);
    void stop();
    bool stopping() const { return stop_; }

private:
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<WorkItem> q_;
    bool stop_ = false;
};

// Executes one chunk synchronously with pread/pwrite (all kinds). `bounce` is
// an aligned scratch buffer of at least max(block_size, offset_align) bytes.
// Returns true on success; on failure the request has been told.
bool run_chunk_sync(Request& req, const Chunk& c, char* bounce);

// Completes the read-modify-write of a partial block (after the block read).
// Shared by both backends.
bool run_partial_sync(Request& req, const Chunk& c, char* bounce);

class Worker {
public:
    virtual ~Worker() = default;
    virtual void run(WorkQueue& q) = 0;
};

class Engine {
public:
    // kind: "uring" or "posix". Throws AioOsError when "uring" cannot run.
    Engine(const std::string& kind, uint64_t block_size, uint32_t queue_depth, uint32_t threads);
    ~Engine();
    std::shared_ptr<Request> submit(int op, std::vector<Segment> segs);
    void drain();   // waits until all submitted requests completed
    void close();   // drain, then stop and join the workers (idempotent)
    const std::string& kind() const { return kind_; }
    uint64_t block_size() const { return block_size_; }
    uint32_t queue_depth() const { return queue_depth_; }
    uint32_t threads() const { return threads_; }

private:
    void split(Request& r);
    std::string kind_;
    uint64_t block_size_;
    uint32_t queue_depth_, threads_;
    WorkQueue queue_;
    std::vector<std::unique_ptr<Worker>> workers_;
    std::vector<std::thread> threads_v_;
    std::mutex out_mu_;
    std::condition_variable out_cv_;
    int64_t outstanding_ = 0;
    bool closed_ = false;
};

std::unique_ptr<Worker> make_posix_worker(uint64_t block_size, uint32_t max_align);
// Throws AioOsError(errno) when the ring cannot be created.
std::unique_ptr<Worker> make_uring_worker(uint64_t block_size, uint32_t queue_depth);
bool built_with_liburing();
int uring_probe();  // 0 when io_uring works, else a positive errno

}  // namespace infinity_aio
