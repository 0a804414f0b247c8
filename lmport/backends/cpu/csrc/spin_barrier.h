// The threads of one parallel region waiting for each other between a step's ops. A decode step's ops are
// microseconds apart: the threads spin rather than sleep, on a count and a generation each on its own
// cache line, which costs a fraction of what opening a parallel region for every op does. A thread that
// has spun for a while yields its core at each look: with more threads than cores, the one it waits for
// may be waiting for that core.
#pragma once

#include <atomic>
#include <thread>

#include "isa/isa.h"

namespace lmport {

class SpinBarrier {
 public:
  explicit SpinBarrier(int threads) : threads_(threads) {}

  // Returns once all ``threads`` have called it (the last to arrive starts the next generation).
  void wait() {
    const int generation = generation_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) + 1 == threads_) {
      arrived_.store(0, std::memory_order_relaxed);
      generation_.store(generation + 1, std::memory_order_release);
    } else {
      for (int spins = 0; generation_.load(std::memory_order_acquire) == generation; ++spins)
        if (spins < kSpins) isa::spin_pause();
        else std::this_thread::yield();
    }
  }

 private:
  static constexpr int kSpins = 1 << 12;   // pauses before yielding: some microseconds
  alignas(64) std::atomic<int> arrived_{0};
  alignas(64) std::atomic<int> generation_{0};
  alignas(64) const int threads_;
};

}  // namespace lmport
