// Parallel regions whose tasks are taken one at a time by whichever intra-op thread is free, instead of
// at::parallel_for's equal contiguous shares. With a share per thread, a thread the OS takes off its core (the
// server's front end, a client, another job on the machine) holds up the whole region while the other thread, done
// with its share, waits; taking tasks from a queue, the thread that runs does the work of the one that does not.
// Measured on Zen 4's 2 cores: the same speed alone (SmolLM2's matmuls at 64 rows 41.5-42.2 ms a step before, 42.1-
// 42.3 after), decode attention from memory 318-352 -> 311-314 us a layer (its tasks longest first), and with a busy
// loop beside the engine 429.4 -> 429.9 tok/s (the engine then ran on ~1 core of CPU time either way).
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

namespace megapipe_parallel {

class TaskQueue {
 public:
  explicit TaskQueue(int64_t tasks) : tasks_(tasks) {}
  // the next task nobody has taken yet, or -1 once all are taken
  int64_t take() {
    const int64_t task = next_.fetch_add(1, std::memory_order_relaxed);
    return task < tasks_ ? task : -1;
  }

 private:
  std::atomic<int64_t> next_{0};
  const int64_t tasks_;
};

// worker(queue) once on each of up to `tasks` intra-op threads (inline on this one inside a parallel region or with
// one thread); every worker takes tasks from the one queue until none are left
template <typename Worker>
void parallel_tasks(int64_t tasks, const Worker& worker) {
  if (tasks <= 0) return;
  TaskQueue queue(tasks);
  const int64_t threads = std::min<int64_t>(tasks, at::get_num_threads());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) { worker(queue); });
}

}  // namespace megapipe_parallel
