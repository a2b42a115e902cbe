// Launching kernels of kernels/*.cu on CPU threads (see cuda_cpu.h for the execution model).
//
//   int hvd_cpu_launch(name, grid, block, shared_bytes, args, err, errlen)
//
// runs kernel `name` (registered by the generated entry files) with `args` as cudaLaunchKernel
// takes them (an array of pointers to the argument values). One launch at a time. Returns 0, or
// non-zero with a message in `err`: 1 unknown kernel, 2 a deadlock (a barrier some thread never
// reached), 3 an exception in a thread.
#include "cuda_cpu.h"

#include <chrono>
#include <iterator>
#include <condition_variable>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_cpu_entry.h"

namespace hvd_cpu {

thread_local ThreadCtx ctx;

namespace {

struct Abort {};

double g_timeout = 20.0;  // seconds a thread waits at a barrier before a deadlock is reported
std::mutex g_launch;

std::map<std::string, Kernel>& registry() {
    static std::map<std::string, Kernel> r;
    return r;
}

struct Launch;
Launch* g_current = nullptr;

struct Barrier {
    std::mutex m;
    std::condition_variable cv;
    int count = 0, waiting = 0;
    unsigned generation = 0;
    void wait(Launch* L, const char* what);
};

struct Warp {
    Barrier bar;
    uint64_t slots[32];
};

struct Launch {
    const char* name;
    unsigned grid, block;
    Barrier sync_bar, end_bar;
    std::vector<std::unique_ptr<Warp>> warps;
    std::unique_ptr<char[]> shared;
    std::mutex err_m;
    std::string error;
    int code = 0;
    volatile bool aborted = false;

    void fail(int c, const std::string& msg) {
        std::lock_guard<std::mutex> g(err_m);
        if (code == 0) {
            code = c;
            error = msg;
        }
        aborted = true;
    }
};

void Barrier::wait(Launch* L, const char* what) {
    std::unique_lock<std::mutex> lk(m);
    unsigned gen = generation;
    if (++waiting == count) {
        waiting = 0;
        ++generation;
        cv.notify_all();
        return;
    }
    auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(g_timeout);
    while (gen == generation) {
        if (L->aborted) throw Abort();
        cv.wait_for(lk, std::chrono::milliseconds(20));
        if (gen != generation) break;
        if (std::chrono::steady_clock::now() > deadline) {
            char buf[400];
            snprintf(buf, sizeof buf,
                     "deadlock in %s: thread %u of block %u waited %.0f s at %s; %d of %d threads arrived "
                     "(a barrier some threads never reach)",
                     L->name, ctx.thread.x, ctx.block.x, g_timeout, what, waiting, count);
            L->fail(2, buf);
            throw Abort();
        }
    }
}

void run_thread(Launch* L, Kernel kernel, void** args, unsigned tid) {
    ctx.thread = {tid, 0, 0};
    ctx.block_dim = {L->block, 1, 1};
    ctx.grid_dim = {L->grid, 1, 1};
    try {
        for (unsigned b = 0; b < L->grid; ++b) {
            ctx.block = {b, 0, 0};
            kernel(args);
            L->end_bar.wait(L, "the end of the block");
        }
    } catch (Abort&) {
    } catch (std::exception& e) {
        L->fail(3, std::string("exception in ") + L->name + ": " + e.what());
    }
}

}  // namespace

void syncthreads() { g_current->sync_bar.wait(g_current, "__syncthreads"); }

unsigned ballot(unsigned mask, bool pred) {
    Launch* L = g_current;
    if (mask != 0xffffffffU) L->fail(3, std::string(L->name) + ": only full-warp masks are emulated");
    unsigned lane = ctx.thread.x & 31;
    Warp& w = *L->warps[ctx.thread.x >> 5];
    w.slots[lane] = pred ? 1 : 0;
    w.bar.wait(L, "__ballot_sync");
    unsigned out = 0;
    for (int j = 0; j < 32; ++j) out |= (unsigned)(w.slots[j] != 0) << j;
    w.bar.wait(L, "__ballot_sync (leaving)");
    return out;
}

uint64_t shfl_down(unsigned mask, uint64_t value, unsigned delta) {
    Launch* L = g_current;
    if (mask != 0xffffffffU) L->fail(3, std::string(L->name) + ": only full-warp masks are emulated");
    unsigned lane = ctx.thread.x & 31;
    Warp& w = *L->warps[ctx.thread.x >> 5];
    w.slots[lane] = value;
    w.bar.wait(L, "__shfl_down_sync");
    uint64_t out = lane + delta < 32 ? w.slots[lane + delta] : value;
    w.bar.wait(L, "__shfl_down_sync (leaving)");
    return out;
}

void* dynamic_shared() { return g_current->shared.get(); }

Registrar::Registrar(const Entry* entries, int n) {
    for (int i = 0; i < n; ++i) registry()[entries[i].name] = entries[i].kernel;
}

}  // namespace hvd_cpu

extern "C" {

void hvd_cpu_set_timeout(double seconds) { hvd_cpu::g_timeout = seconds; }

int hvd_cpu_count() { return (int)hvd_cpu::registry().size(); }

const char* hvd_cpu_name(int i) {
    auto it = hvd_cpu::registry().begin();
    std::advance(it, i);
    return it->first.c_str();
}

int hvd_cpu_launch(const char* name, unsigned grid, unsigned block, unsigned long long shared_bytes, void** args,
                   char* err, int errlen) {
    using namespace hvd_cpu;
    std::lock_guard<std::mutex> one_at_a_time(g_launch);
    auto it = registry().find(name);
    if (it == registry().end()) {
        snprintf(err, errlen, "unknown kernel %s", name);
        return 1;
    }
    if (block == 0 || block % 32 || grid == 0) {
        snprintf(err, errlen, "%s: block %u must be a non-zero multiple of 32, grid %u non-zero", name, block, grid);
        return 3;
    }
    Launch L;
    L.name = it->first.c_str();
    L.grid = grid;
    L.block = block;
    L.sync_bar.count = L.end_bar.count = (int)block;
    for (unsigned w = 0; w < block / 32; ++w) {
        L.warps.emplace_back(new Warp());
        L.warps.back()->bar.count = 32;
    }
    if (shared_bytes) L.shared.reset(new char[shared_bytes]);
    g_current = &L;
    std::vector<std::thread> threads;
    threads.reserve(block);
    for (unsigned t = 0; t < block; ++t) threads.emplace_back(run_thread, &L, it->second, args, t);
    for (auto& t : threads) t.join();
    g_current = nullptr;
    if (L.code) snprintf(err, errlen, "%s", L.error.c_str());
    return L.code;
}

}  // extern "C"
