// Warm-ahead: a team thread that waits (its chunk done before the other's, or the caller in a serial section)
// prefetches the start of its part of the *next* weight stream into its L2 instead of only spinning.
//
// In a batch-1 decode step both threads of a 2-core team stream weights, but each also waits: the caller for the
// slower server at the end of every loop and the server through the caller's serial work (norms, per-call host
// work). Measured on a Xeon with AMX (SmolLM2 bf16, 2 threads, perf): the caller spun 8 % of its time at loop ends
// and the server 17 % inside the stack, while one core alone cannot draw the memory's whole bandwidth. A thread
// that knows the next stream's layout (the decode stack says which projection comes next, StreamHint) pulls its
// first lines meanwhile, so the next loop starts on L2-resident lines. Only prefetches: no result depends on it.
// Measured there (batch-1 decode, alternated in one process, 8 rounds of 128 tokens): the stack 9.38 -> 8.97 ms
// per token, the whole step 12.60 -> 12.20 ms; at batch 35 no difference beyond the host's noise.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>

#include "parallel_split.h"

namespace ascent_par {

// The weight bytes a later parallel loop reads, by thread: indices [0, n) (column blocks, rows, ...) of `bytes`
// each from `base`, split over the team as the loop will split them (`grain`, parallel_team.h's contract), each
// thread's range read as `streams` equal side-by-side parts (ascent_prefetch::side_by_side; 1 = front to back).
// An empty hint (base null) warms nothing.
struct StreamHint {
  const char* base = nullptr;
  int64_t n = 0;
  int64_t grain = 1;
  int64_t bytes = 0;
  int streams = 1;
};

// What thread `tid` of a team of `threads` warms of a hinted stream: the first `limit` bytes of each of `parts`
// parts of `part_bytes`, the first starting at `first` (the others follow it back to back); limit 0 = nothing.
struct WarmPlan {
  const char* first = nullptr;
  int64_t part_bytes = 0;
  int parts = 1;
  int64_t limit = 0;
};

// Bytes warmed per thread and hint, over all its parts: a quarter of a 2 MiB L2.
constexpr int64_t kWarmBudget = 512 * 1024;

inline WarmPlan warm_plan(const StreamHint& hint, int64_t tid, int64_t threads) {
  WarmPlan plan;
  if (hint.base == nullptr || hint.n <= 0 || hint.bytes <= 0 || hint.streams < 1) return plan;
  const ChunkSplit split = split_chunks(hint.n, hint.grain, threads);
  const int64_t begin = tid * split.size, end = std::min(hint.n, begin + split.size);
  if (begin >= end) return plan;
  const int64_t part = (end - begin) / hint.streams;  // side_by_side's parts; none when the range is shorter
  plan.parts = part > 0 ? hint.streams : 1;
  plan.part_bytes = (part > 0 ? part : end - begin) * hint.bytes;
  plan.first = hint.base + begin * hint.bytes;
  plan.limit = std::min<int64_t>(plan.part_bytes, kWarmBudget / plan.parts);
  return plan;
}

// Prefetches, a few lines per call, one thread's warm_plan in the order the loop will read it (line j of every
// part in turn). Continues where the last call on the same hint stopped, so the waits around one loop add up.
class WarmAhead {
 public:
  static constexpr int kLinesPerCall = 16;

  // Whether anything is left to prefetch of thread `tid`'s plan for `hint` (a team of `threads`).
  bool active(const StreamHint& hint, int64_t tid, int64_t threads) {
    if (hint.base != base_ || hint.n != n_ || tid != tid_) {
      base_ = hint.base;
      n_ = hint.n;
      tid_ = tid;
      plan_ = warm_plan(hint, tid, threads);
      offset_ = 0;
    }
    return offset_ < plan_.limit;
  }

  // Issues up to kLinesPerCall prefetches into L2 (after active() returned true).
  void step() {
    for (int i = 0; i < kLinesPerCall && offset_ < plan_.limit; i += plan_.parts) {
      for (int s = 0; s < plan_.parts; ++s) _mm_prefetch(plan_.first + s * plan_.part_bytes + offset_, _MM_HINT_T1);
      offset_ += 64;
    }
  }

 private:
  const char* base_ = nullptr;
  int64_t n_ = -1, tid_ = -1;
  WarmPlan plan_;
  int64_t offset_ = 0;
};

}  // namespace ascent_par
