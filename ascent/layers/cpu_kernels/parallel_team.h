// A team of torch's threads that stays up for a whole decode step, and the parallel_for every kernel of this
// directory calls instead of at::parallel_for.
//
// A decode step of the C++ stack (decode_stack_cpu.cpp) runs ~10 parallel loops per layer, each an OpenMP fork and
// join through at::parallel_for: at batch 1 about 1-3 us apiece, a tenth of a SmolLM2 W8A8 step. Inside
// `run_as_team(body)` the calling thread runs `body` while the other threads of torch's pool wait (spinning, then
// yielding) for loops to share; each `ascent_par::parallel_for` in `body` then costs a release store and an acquire
// spin instead of a fork.
//
// Contract (what keeps results bit-identical to at::parallel_for): a loop is split exactly as ATen's OpenMP backend
// splits it: inline when end - begin <= grain, or one thread, or already inside a chunk; else into
// min(threads, ceil(n / grain)) chunks of ceil(n / chunks) iterations, chunk i on thread i (the caller takes chunk 0).
// Outside a team, parallel_for *is* at::parallel_for. An exception thrown by a chunk is rethrown by parallel_for on
// the caller after all chunks finished, as at::parallel_for does. Torch ops with their own intra-op parallelism
// called from `body` run on one thread (torch sees a parallel region): keep such ops out of teams.
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <utility>

#include "parallel_split.h"
#include "warm_ahead.h"

namespace ascent_par {

class Team {
 public:
  explicit Team(int64_t threads) : threads_(threads) {}

  int64_t threads() const { return threads_; }

  // Runs f(begin, end) over [begin, end) split as at::parallel_for would split it (see the contract above).
  template <class F>
  void run(int64_t begin, int64_t end, int64_t grain, const F& f) {
    const int64_t n = end - begin;
    if (n <= 0) return;
    const ChunkSplit split = split_chunks(n, grain, threads_);
    if (in_chunk_ || split.chunks == 1) return f(begin, end);
    fn_ = [](const void* ctx, int64_t b, int64_t e) { (*static_cast<const F*>(ctx))(b, e); };
    ctx_ = &f;
    begin_ = begin;
    end_ = end;
    size_ = split.size;
    chunks_ = split.chunks;
    loop_hint_ = next_;
    pending_.store(threads_ - 1, std::memory_order_relaxed);  // every server checks in, with a chunk or without
    generation_.fetch_add(1, std::memory_order_release);
    run_chunk(0);
    for (int64_t spins = 0; pending_.load(std::memory_order_acquire) != 0;) {
      if (caller_warm_.active(next_, 0, threads_)) {
        caller_warm_.step();
      } else {
        wait_a_little(spins++);
      }
    }
    rethrow_error();
  }

  // The weight stream of the next loop that reads one (warm_ahead.h): threads that wait before it prefetch their
  // part's first lines. Caller only, between loops; published with each later loop.
  void set_next_stream(const StreamHint& hint) { next_ = hint; }

  // The waiting side: thread `tid` (> 0) takes chunk `tid` of each published loop until stop(). Counting starts at
  // the team's first generation, not at the one serve() first sees: the caller may publish before a server arrives.
  void serve(int64_t tid) {
    uint64_t seen = 0;
    StreamHint hint;  // the last loop's, warmed while waiting for the next
    WarmAhead warm;
    for (;;) {
      uint64_t now;
      for (int64_t spins = 0; (now = generation_.load(std::memory_order_acquire)) == seen;) {
        if (warm.active(hint, tid, threads_)) {
          warm.step();
        } else {
          wait_a_little(spins++);
        }
      }
      seen = now;
      if (stopped_.load(std::memory_order_acquire)) return;
      if (tid < chunks_) run_chunk(tid);
      hint = loop_hint_;
      // Checked in only after the last read of the loop's fields: the caller rewrites them for the next loop once
      // every server has checked in.
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  void stop() {
    stopped_.store(true, std::memory_order_release);
    generation_.fetch_add(1, std::memory_order_release);
  }

 private:
  // Spin first (a loop is usually published within microseconds), then yield the core: with more runnable threads
  // than cores a pure spin would hold the core the awaited thread needs.
  static void wait_a_little(int64_t spins) {
    if (spins < kSpinsBeforeYield) {
      _mm_pause();
    } else {
      std::this_thread::yield();
    }
  }

  void run_chunk(int64_t tid) {
    const int64_t b = begin_ + tid * size_;
    if (b >= end_) return;
    in_chunk_ = true;
    try {
      fn_(ctx_, b, std::min(end_, b + size_));
    } catch (...) {
      std::lock_guard<std::mutex> lock(error_mutex_);
      if (!error_) error_ = std::current_exception();
    }
    in_chunk_ = false;
  }

  void rethrow_error() {
    std::exception_ptr error;
    {
      std::lock_guard<std::mutex> lock(error_mutex_);
      std::swap(error, error_);
    }
    if (error) std::rethrow_exception(error);
  }

  static constexpr int64_t kSpinsBeforeYield = 4096;
  static thread_local bool in_chunk_;  // a loop inside a chunk runs inline (as ATen's nested loops do)
  const int64_t threads_;
  // The published loop, written by the caller before the release increment of generation_.
  void (*fn_)(const void*, int64_t, int64_t) = nullptr;
  const void* ctx_ = nullptr;
  int64_t begin_ = 0, end_ = 0, size_ = 0, chunks_ = 0;
  StreamHint loop_hint_;  // next_ as it was when the loop was published
  StreamHint next_;       // the caller's, set_next_stream
  WarmAhead caller_warm_;
  alignas(64) std::atomic<uint64_t> generation_{0};
  alignas(64) std::atomic<int64_t> pending_{0};
  std::atomic<bool> stopped_{false};
  std::mutex error_mutex_;
  std::exception_ptr error_;
};

inline thread_local bool Team::in_chunk_ = false;

// The team of the calling thread while it runs a `run_as_team` body, else null.
inline thread_local Team* current_team = nullptr;

// at::parallel_for, or the calling thread's team while it runs a `run_as_team` body.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (Team* team = current_team) return team->run(begin, end, grain, f);
  at::parallel_for(begin, end, grain, f);
}

// Tells the calling thread's team (if any) which weight stream its next weight-reading loop reads.
inline void set_next_stream(const StreamHint& hint) {
  if (Team* team = current_team) team->set_next_stream(hint);
}

// Runs body() on the calling thread with torch's other threads serving its parallel_for loops and returns its
// result (an exception from body is rethrown once the team disbanded). Plain body() when torch has one thread or the
// caller is already inside a parallel region or a team.
template <class Body>
auto run_as_team(const Body& body) -> decltype(body()) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || at::in_parallel_region() || current_team != nullptr) return body();
  Team team(threads);
  decltype(body()) result;
  std::exception_ptr error;
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    if (first != 0) return team.serve(first);  // until stop(); takes chunks only when the team was formed
    // One index per thread means all `threads` threads are here; else OpenMP gave fewer and body runs alone (its
    // loops inline, as inside any parallel region).
    if (last == 1) current_team = &team;
    try {
      result = body();
    } catch (...) {
      error = std::current_exception();
    }
    current_team = nullptr;
    team.stop();
  });
  if (error) std::rethrow_exception(error);
  return result;
}

}  // namespace ascent_par
