"""C++ source of the CPU kernels' own thread pool: `run_tasks(tasks, f)` runs f(i) for i in [0, tasks).

Why not `at::parallel_for`: in a torch C++ extension built without `-fopenmp` it is a plain serial
loop (ATen's OpenMP backend is inline code behind `#ifdef _OPENMP`), so the decode projections ran
on one thread whatever `torch.set_num_threads` said. With OpenMP the region ends in a barrier that
waits for every thread of the team: on a busy box a thread that the scheduler has not run yet holds
the whole call (measured on the loaded 2-core dev box, SmolLM2's projections: 1.4 s per step at 2
OpenMP threads against 0.16 s at 1). Here the caller takes tasks itself from a shared counter and
waits only for tasks another thread has *claimed*: a worker that wakes late finds nothing left and
goes back to sleep, so a busy box costs at most one task's time, never a whole step.

Workers (`at::get_num_threads() - 1` of them, started on first use, never joined) spin on the job
word for `SPIN_US` after their last task, then sleep on it (a futex): the calls of one decode step
come microseconds apart and find them awake; the caller wakes sleepers only when there are some.
Tasks are claimed with a compare-and-swap on (job number << 32 | next task), so a worker that read
an old job can never run a task of a newer one. After fork() the child has no workers: the caller
runs every task (correct, one thread).
"""
from __future__ import annotations

SPIN_US = 200

SOURCE = r"""
#include <ATen/Parallel.h>
#include <atomic>
#include <chrono>
#include <exception>
#include <mutex>
#include <sched.h>
#include <thread>
#include <unistd.h>

namespace tidal_pool {

constexpr int64_t SPIN_US = """ + str(SPIN_US) + r""";

static inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

struct Pool {
  std::atomic<uint64_t> state{0};    // job number << 32 | next unclaimed task
  std::atomic<uint32_t> wake{0};     // job number, for the sleepers' futex
  std::atomic<int64_t> done{0};      // tasks of the current job finished
  std::atomic<int> sleepers{0};
  std::atomic<int> active{0};        // workers that may take tasks (threads - 1)
  std::atomic<void (*)(void*, int64_t)> fn{nullptr};
  std::atomic<void*> ctx{nullptr};
  std::atomic<int64_t> tasks{0};
  std::exception_ptr error;           // the first task's exception of the current job
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::mutex busy;  // one caller at a time; another thread's call runs its tasks alone
  int started = 0;
  pid_t owner = 0;

  // Take and run tasks of job `job` until none is left.
  void drain(uint32_t job) {
    uint64_t s = state.load(std::memory_order_acquire);
    for (;;) {
      if (static_cast<uint32_t>(s >> 32) != job) return;
      const int64_t i = static_cast<int64_t>(s & 0xffffffffu);
      const int64_t n = tasks.load(std::memory_order_relaxed);
      if (i >= n) return;
      void (*f)(void*, int64_t) = fn.load(std::memory_order_relaxed);
      void* c = ctx.load(std::memory_order_relaxed);
      if (state.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire)) {
        try {
          f(c, i);
        } catch (...) {
          if (!failed.test_and_set()) error = std::current_exception();
        }
        done.fetch_add(1, std::memory_order_release);
        s = state.load(std::memory_order_acquire);
      }
    }
  }

  void worker(int id) {
    uint32_t seen = wake.load(std::memory_order_acquire);
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint32_t now = wake.load(std::memory_order_acquire);
      for (int spin = 0; now == seen; ++spin) {
        cpu_relax();
        if ((spin & 255) == 255 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(SPIN_US)) {
          sleepers.fetch_add(1, std::memory_order_seq_cst);
          if (wake.load(std::memory_order_seq_cst) == seen) wake.wait(seen, std::memory_order_acquire);
          sleepers.fetch_sub(1, std::memory_order_relaxed);
          t0 = std::chrono::steady_clock::now();
        }
        now = wake.load(std::memory_order_acquire);
      }
      seen = now;
      if (id < active.load(std::memory_order_relaxed)) drain(now);
    }
  }

  void run(int64_t n, void (*f)(void*, int64_t), void* c, int threads) {
    if (owner != getpid()) { started = 0; owner = getpid(); }  // a forked child has no workers
    for (; started < threads - 1; ++started) std::thread([this, id = started] { worker(id); }).detach();
    active.store(threads - 1, std::memory_order_relaxed);
    fn.store(f, std::memory_order_relaxed);
    ctx.store(c, std::memory_order_relaxed);
    tasks.store(n, std::memory_order_relaxed);
    done.store(0, std::memory_order_relaxed);
    failed.clear();
    error = nullptr;
    const uint32_t job = wake.load(std::memory_order_relaxed) + 1;
    state.store(static_cast<uint64_t>(job) << 32, std::memory_order_release);
    wake.store(job, std::memory_order_seq_cst);
    if (sleepers.load(std::memory_order_seq_cst) > 0) wake.notify_all();
    drain(job);
    // every task is claimed: wait for the ones other threads are still running
    for (int spin = 0; done.load(std::memory_order_acquire) < n; ++spin) {
      if (spin < 4096) cpu_relax(); else sched_yield();
    }
    if (error) std::rethrow_exception(error);  // raised in the caller, as at::parallel_for does
  }
};

static Pool& pool() {
  static Pool* p = new Pool();  // never destroyed: detached workers may outlive static destructors
  return *p;
}

template <typename F>
static void trampoline(void* c, int64_t i) { (*static_cast<const F*>(c))(i); }

// f(i) for i in [0, tasks), spread over at::get_num_threads() threads (the caller is one of them).
template <typename F>
void run_tasks(int64_t tasks, const F& f) {
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), tasks));
  std::unique_lock<std::mutex> lock(pool().busy, std::defer_lock);
  if (threads <= 1 || at::in_parallel_region() || !lock.try_lock()) {
    for (int64_t i = 0; i < tasks; ++i) f(i);
    return;
  }
  pool().run(tasks, &trampoline<F>, const_cast<void*>(static_cast<const void*>(&f)), threads);
}

}  // namespace tidal_pool
"""
