// How a parallel loop over n indices is cut into chunks: ATen's OpenMP split, which parallel_team.h's teams keep
// (bit-identical results), warm_ahead.h predicts and parallel_blocks.h balances. Included at global scope.
#pragma once

#include <algorithm>
#include <cstdint>

namespace ascent_par {

// `chunks` chunks of `size` indices (the last may be shorter), chunk i on thread i; one chunk (inline on the
// caller) when n <= grain, n == 1 or one thread.
struct ChunkSplit {
  int64_t chunks = 1;
  int64_t size = 0;
};

inline ChunkSplit split_chunks(int64_t n, int64_t grain, int64_t threads) {
  if (n <= grain || n == 1 || threads <= 1) return {1, n};
  const int64_t chunks = std::min<int64_t>(threads, grain > 0 ? (n + grain - 1) / grain : threads);
  return {chunks, (n + chunks - 1) / chunks};
}

}  // namespace ascent_par
