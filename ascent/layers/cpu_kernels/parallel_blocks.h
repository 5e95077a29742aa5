// A parallel loop over weight blocks whose result does not depend on which thread computes which block (each block
// writes only its own outputs), balanced by stealing: the blocks are split over the threads exactly as
// parallel_for splits them, each thread reads its own chunk from the front as S side-by-side streams
// (ascent_prefetch::side_by_side's order), and a thread done with its chunk takes what is left of the others' from
// the back, one unit at a time, until every block is taken.
//
// Why: a static split waits for the slower thread at every loop's end. Measured on a Xeon with AMX (SmolLM2 bf16,
// batch-1 decode stack, 2 threads, rdtsc at each loop's end): over the 150 loops of a step the caller finished its
// chunks 2.2-2.5 ms after the server in total, the server idle meanwhile, in a step of ~12 ms. The thread that
// waits less (the caller, which also runs the serial work) gets less warm-ahead (warm_ahead.h), so it is the slower
// one; on other hosts it may be the other. Stealing balances either way. Measured there, alternated in one process
// against the same loop without the stealing (10 rounds of 128 tokens): batch-1 stack 8.55 -> 8.20 ms per token,
// the step 11.55 -> 11.20 ms; at batch 35 (the AMX tile paths) the stack 30.8 -> 30.4 ms, within the noise.
#pragma once

#include <atomic>
#include <cstdint>
#include <vector>

#include "parallel_split.h"
#include "parallel_team.h"

namespace ascent_par {

// Chunk c's blocks as units: unit u < part is block u of each of its S equal parts (S blocks side by side), the
// units after them the leftover blocks one at a time; and its untaken units [front, back) as one word, which the
// owner takes from the front and the other threads from the back.
struct alignas(64) ChunkUnits {
  std::atomic<uint64_t> word{0};
  int64_t begin = 0, len = 0, part = 0;

  void reset(int64_t b, int64_t length, int streams) {
    begin = b;
    len = length;
    part = length / streams;
    const uint64_t units = static_cast<uint64_t>(part + (len - streams * part));
    word.store(units << 32, std::memory_order_relaxed);
  }

  // The next unit from the front (owner) or the back (thief), or -1 when none is left.
  int64_t take(bool from_front) {
    uint64_t w = word.load(std::memory_order_relaxed);
    for (;;) {
      const uint32_t front = static_cast<uint32_t>(w), back = static_cast<uint32_t>(w >> 32);
      if (front >= back) return -1;
      const uint64_t next = from_front ? w + 1 : w - (uint64_t{1} << 32);
      if (word.compare_exchange_weak(w, next, std::memory_order_relaxed)) return from_front ? front : back - 1;
    }
  }

  // The blocks of unit u into idx; returns how many (S or 1).
  template <int S>
  int blocks(int64_t u, int64_t (&idx)[S]) const {
    if (u < part) {
      for (int s = 0; s < S; ++s) idx[s] = begin + s * part + u;
      return S;
    }
    idx[0] = begin + S * part + (u - part);
    return 1;
  }
};

// f(state, idx, count) for every block of [begin, end), each exactly once, count = S (side by side) or 1, with
// state = make_state() made once per thread that takes part (its destructor runs after the thread's last unit).
// Chunks as parallel_for(begin, end, grain) would cut them; within a team (parallel_team.h) or through
// at::parallel_for.
template <int S, class MakeState, class F>
void parallel_blocks(int64_t begin, int64_t end, int64_t grain, const MakeState& make_state, const F& f) {
  const int64_t n = end - begin;
  if (n <= 0) return;
  const int64_t threads = current_team != nullptr ? current_team->threads() : at::get_num_threads();
  // (Inside a parallel region outside a team the loop below runs inline: the caller then drains every chunk.)
  const ChunkSplit split = split_chunks(n, grain, threads);
  const int64_t chunks = split.chunks;
  std::vector<ChunkUnits> units(chunks);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t b = begin + c * split.size;
    units[c].reset(b, std::max<int64_t>(0, std::min(end, b + split.size) - b), S);
  }
  const auto drain = [&](auto& state, int64_t c, bool own) {
    int64_t idx[S];
    for (int64_t u; (u = units[c].take(own)) >= 0;) {
      const int count = units[c].template blocks<S>(u, idx);
      f(state, static_cast<const int64_t(&)[S]>(idx), count);
    }
  };
  parallel_for(0, chunks, 1, [&](int64_t first, int64_t last) {
    auto state = make_state();
    for (int64_t c = first; c < last; ++c) drain(state, c, true);
    for (int64_t c = last % chunks; c != first; c = (c + 1) % chunks) drain(state, c, false);
  });
}

}  // namespace ascent_par
