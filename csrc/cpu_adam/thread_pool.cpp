// Persistent worker pool for the CPU Adam kernels (see thread_pool.h).
#include "thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace infinity_adam {
namespace {

// Below this many elements a step is run on the calling thread alone: waking
// workers costs more than it saves.
constexpr size_t kInlineBelow = size_t(1) << 15;
constexpr size_t kAlign = 64;          // chunk boundaries: whole cache lines in every stream
constexpr size_t kMinChunk = size_t(1) << 14;

class Pool {
public:
    explicit Pool(int n) : n_(n) {
        for (int i = 1; i < n; ++i) workers_.emplace_back([this, i] { loop(i); });
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> g(mu_);
            stop_ = true;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return n_; }

    // Runs job(i) for i in [0, n_), i == 0 on the caller; returns when all are done.
    void run(const std::function<void(int)>& job) {
        {
            std::lock_guard<std::mutex> g(mu_);
            job_ = &job;
            pending_ = n_ - 1;
            ++gen_;
        }
        cv_.notify_all();
        job(0);
        std::unique_lock<std::mutex> lk(mu_);
        done_cv_.wait(lk, [this] { return pending_ == 0; });
        job_ = nullptr;
    }

private:
    void loop(int idx) {
        uint64_t seen = 0;
        for (;;) {
            const std::function<void(int)>* job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return stop_ || gen_ != seen; });
                if (stop_) return;
                seen = gen_;
                job = job_;
            }
            (*job)(idx);
            {
                std::lock_guard<std::mutex> g(mu_);
                if (--pending_ == 0) done_cv_.notify_one();
            }
        }
    }

    const int n_;
    std::vector<std::thread> workers_;
    std::mutex mu_;
    std::condition_variable cv_, done_cv_;
    const std::function<void(int)>* job_ = nullptr;
    uint64_t gen_ = 0;
    int pending_ = 0;
    bool stop_ = false;
};

std::mutex g_mu;            // held for each parallel call and pool change, and across fork()
Pool* g_pool = nullptr;     // created lazily
int g_threads = 0;          // 0: not yet decided (default_num_threads())

void atfork_prepare() { g_mu.lock(); }
void atfork_parent() { g_mu.unlock(); }
void atfork_child() {
    g_pool = nullptr;  // its threads do not exist in the child: leak the object, start afresh
    g_mu.unlock();
}

struct AtForkRegistrar {
    AtForkRegistrar() { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }
} g_atfork;

int threads_locked() {
    if (g_threads <= 0) g_threads = default_num_threads();
    return g_threads;
}

}  // namespace

int default_num_threads() {
    cpu_set_t set;
    CPU_ZERO(&set);
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        const int c = CPU_COUNT(&set);
        if (c > 0) return c;
    }
    const unsigned h = std::thread::hardware_concurrency();
    return h ? static_cast<int>(h) : 1;
}

int get_num_threads() {
    std::lock_guard<std::mutex> g(g_mu);
    return threads_locked();
}

void set_num_threads(int n) {
    if (n < 1) n = 1;
    std::lock_guard<std::mutex> g(g_mu);
    if (g_pool && g_pool->size() == n) return;
    delete g_pool;
    g_pool = nullptr;
    g_threads = n;
}

void parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn) {
    if (n == 0) return;
    if (n < kInlineBelow) {
        fn(0, n);
        return;
    }
    std::lock_guard<std::mutex> g(g_mu);
    const int t = threads_locked();
    if (t == 1) {
        fn(0, n);
        return;
    }
    if (!g_pool) g_pool = new Pool(t);
    // Dynamic chunks: threads take the next chunk from a shared counter, so a thread
    // slowed down by another process (shared machine) does less of the work instead of
    // holding everyone up. ~16 chunks per thread, multiples of kAlign elements.
    size_t chunk = n / (static_cast<size_t>(t) * 16);
    if (chunk < kMinChunk) chunk = kMinChunk;
    chunk = (chunk + kAlign - 1) / kAlign * kAlign;
    std::atomic<size_t> next{0};
    auto job = [&](int) {
        for (;;) {
            const size_t begin = next.fetch_add(chunk, std::memory_order_relaxed);
            if (begin >= n) return;
            fn(begin, begin + chunk < n ? begin + chunk : n);
        }
    };
    g_pool->run(job);
}

}  // namespace infinity_adam
