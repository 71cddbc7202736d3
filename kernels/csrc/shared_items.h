// Work items [0, n) shared by the threads of one parallel region, for kernels that run several phases in one
// region (decode_layer_cpu.cpp) instead of one fork/join each.
//
// Each thread first claims, one at a time, the items of its own contiguous share (so it streams one run of the
// weights, as at::parallel_for's static split does), then what is left of the others' shares. A phase is over
// when every item has run, whoever ran it: a thread that comes late (descheduled on a busy host) finds its share
// taken and holds nobody up, where a static split would wait for its whole share.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace kubellm_cpu {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#endif
}

class SharedItems {
 public:
  // Ready for threads 0..threads-1 to claim items [0, n).
  void reset(int64_t n, int threads) {
    n_ = n;
    threads_ = threads;
    shares_ = std::make_unique<Share[]>(threads);
    for (int t = 0; t < threads; ++t) {
      shares_[t].next.store(n * t / threads, std::memory_order_relaxed);
      shares_[t].end = n * (t + 1) / threads;
      shares_[t].ran.store(0, std::memory_order_relaxed);
    }
  }

  // Thread t runs f(item) on every item it claims: its own share first, then the others'.
  template <class F>
  void run(int t, const F& f) {
    int64_t ran = 0;
    for (int i = 0; i < threads_; ++i) {
      Share& s = shares_[(t + i) % threads_];
      for (int64_t item = s.next.fetch_add(1, std::memory_order_relaxed); item < s.end;
           item = s.next.fetch_add(1, std::memory_order_relaxed)) {
        f(item);
        ++ran;
      }
    }
    // Release: the items' outputs are visible to whoever sees the count.
    shares_[t].ran.fetch_add(ran, std::memory_order_release);
  }

  bool done() const {
    int64_t ran = 0;
    for (int t = 0; t < threads_; ++t) ran += shares_[t].ran.load(std::memory_order_acquire);
    return ran == n_;
  }

  void wait() const {
    while (!done()) cpu_relax();
  }

 private:
  struct alignas(64) Share {  // one cache line per thread: claims on one's own share do not bounce
    std::atomic<int64_t> next{0};
    int64_t end = 0;
    std::atomic<int64_t> ran{0};
  };
  int64_t n_ = 0;
  int threads_ = 1;
  std::unique_ptr<Share[]> shares_;
};

}  // namespace kubellm_cpu
