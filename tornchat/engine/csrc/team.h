// Threads that stay together through a whole forward (with_team), so that each parallel loop inside it
// (team::parallel_for: a one-row step's ~137, its matrix products and attention's passes) is handed to threads
// already spinning, instead of an OpenMP fork and join per loop: a fork cost about 0.9 us and the second thread
// started 1.0-1.6 us after the first, on steps of 4-5 ms made of such loops (the 135M's, AMD Zen 3).
//
// team::parallel_for splits a range exactly as at::parallel_for does (contiguous parts of ceil(n / parts),
// at most ceil(n / grain) parts; inline when n <= grain), so a loop's parts, and what each part computes, do not
// depend on whether a team runs it. Outside with_team, and inside a part (nested loops), it is at::parallel_for.
// team::share hands out items whose results do not depend on the thread either, for the threads to balance.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <thread>
#include <utility>

namespace tornchat::team {

// A busy wait's step: a hint to the core (and to a sibling hyperthread) that this thread only polls; after many,
// the thread yields its core, where more threads than cores are runnable (the server's IOLoop thread).
inline void pause(uint32_t& spins) {
  if (++spins > 4096) {
    std::this_thread::yield();
    return;
  }
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// The threads of one with_team call: role r of roles runs part r of each loop; the calling thread (the leader)
// holds roles [own_first, own_last) and posts the loops, the others hold the rest.
struct Team {
  static constexpr uint64_t STOP = ~uint64_t{0};
  struct alignas(64) Done {
    std::atomic<uint64_t> loop{0};  // the last loop this role finished
  };

  explicit Team(int64_t roles_) : roles(roles_), done(new Done[roles_]) {}

  int64_t roles;
  int64_t own_first = 0, own_last = 0;
  bool busy = false;  // the leader is inside a part: loops nested in it run inline
  // The posted loop: its number (posted.load() != a role's last: new work), range and body.
  alignas(64) std::atomic<uint64_t> posted{0};
  int64_t begin = 0, end = 0, chunk = 0;
  const void* body = nullptr;
  void (*call)(const void*, int64_t, int64_t) = nullptr;
  std::exception_ptr error;
  std::atomic_flag failed = ATOMIC_FLAG_INIT;
  std::unique_ptr<Done[]> done;

  void run_part(int64_t role) {
    const int64_t first = begin + role * chunk;
    if (first >= end) return;
    try {
      call(body, first, std::min(end, first + chunk));
    } catch (...) {
      if (!failed.test_and_set()) error = std::current_exception();
    }
  }

  // A helper's loop: each posted loop's parts of roles [first, last), until STOP.
  void serve(int64_t first, int64_t last) {
    uint64_t seen = 0;
    for (;;) {
      uint64_t loop;
      for (uint32_t spins = 0; (loop = posted.load(std::memory_order_acquire)) == seen;) pause(spins);
      if (loop == STOP) return;
      for (int64_t r = first; r < last; ++r) run_part(r);
      for (int64_t r = first; r < last; ++r) done[r].loop.store(loop, std::memory_order_release);
      seen = loop;
    }
  }

  template <class F>
  void run(int64_t b, int64_t e, int64_t grain, const F& f) {
    const int64_t n = e - b;
    const int64_t parts = std::min(roles, grain > 0 ? (n + grain - 1) / grain : n);
    begin = b, end = e, chunk = (n + parts - 1) / parts;
    body = &f;
    call = [](const void* g, int64_t first, int64_t last) { (*static_cast<const F*>(g))(first, last); };
    const uint64_t loop = posted.load(std::memory_order_relaxed) + 1;
    posted.store(loop, std::memory_order_release);
    busy = true;
    for (int64_t r = own_first; r < own_last; ++r) run_part(r);
    busy = false;
    for (int64_t r = 0; r < roles; ++r) {
      if (r >= own_first && r < own_last) continue;
      for (uint32_t spins = 0; done[r].loop.load(std::memory_order_acquire) != loop;) pause(spins);
    }
    if (failed.test()) {
      failed.clear();
      std::rethrow_exception(std::exchange(error, nullptr));
    }
  }
};

// The team the calling thread leads, in with_team; else none.
inline thread_local Team* current = nullptr;

// at::parallel_for(begin, end, grain, f), run by the calling thread's team where it leads one.
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  Team* team = current;
  if (team == nullptr || team->busy || begin >= end) {
    at::parallel_for(begin, end, grain, f);
    return;
  }
  if (end - begin <= grain || end - begin == 1 || team->roles == 1) {
    f(begin, end);
    return;
  }
  team->run(begin, end, grain, f);
}

// f(i) for the items i of 0 .. n - 1, each once, where what an item computes does not depend on which thread takes
// it (a product's chunks of columns). Each thread starts on its own contiguous run, the part parallel_for would
// give it, so that it reads its memory in order; one done with its run takes the items left in another's from its
// back, one at a time. Split statically, the thread that finished first waited for the other at the end of every
// product: on a 2-core VM one core ran the same tiles 15% slower than the other (perf, 2026-12-07, AMD Zen 4), and
// with the runs shared a 1B's one-row step took 0.92-0.95x the time, its 4-row step 0.94x, a prefill chunk 0.96x.
template <class F>
void share(int64_t n, const F& f) {
  if (n <= 0) return;
  const int64_t parts = std::min<int64_t>(std::max(1, at::get_num_threads()), n), per = (n + parts - 1) / parts;
  struct alignas(64) Run {
    std::atomic<uint64_t> span;  // the run's next item << 32 | its end
  };
  const std::unique_ptr<Run[]> runs(new Run[parts]);
  for (int64_t p = 0; p < parts; ++p)
    runs[p].span.store(static_cast<uint64_t>(std::min(n, p * per)) << 32 | static_cast<uint64_t>(std::min(n, p * per + per)),
                       std::memory_order_relaxed);
  const auto take = [](Run& run, bool front, int64_t& item) {  // the run's next item (front) or its last
    uint64_t span = run.span.load(std::memory_order_relaxed);
    while ((span >> 32) < (span & 0xffffffffu)) {
      if (run.span.compare_exchange_weak(span, front ? span + (uint64_t{1} << 32) : span - 1, std::memory_order_relaxed)) {
        item = front ? static_cast<int64_t>(span >> 32) : static_cast<int64_t>(span & 0xffffffffu) - 1;
        return true;
      }
    }
    return false;
  };
  parallel_for(0, parts, 1, [&](int64_t first, int64_t last) {
    for (int64_t p = first; p < last; ++p) {
      int64_t item;
      while (take(runs[p], true, item)) f(item);
      for (int64_t other = 1; other < parts; ++other)
        while (take(runs[(p + other) % parts], false, item)) f(item);
    }
  });
}

// body() with the threads at::parallel_for would use held together until it returns: its team::parallel_for
// loops run on them. Where those threads are one (or this is already inside a parallel region): body() alone.
template <class Body>
auto with_team(const Body& body) -> decltype(body()) {
  const int64_t roles = at::get_num_threads();
  if (roles < 2 || at::in_parallel_region() || current != nullptr) return body();
  Team team(roles);
  const auto leader = std::this_thread::get_id();
  decltype(body()) result;
  at::parallel_for(0, roles, 1, [&](int64_t first, int64_t last) {
    if (std::this_thread::get_id() != leader) {
      team.serve(first, last);
      return;
    }
    team.own_first = first, team.own_last = last;
    struct Leading {  // the helpers stop however body ends
      Team& team;
      explicit Leading(Team& t) : team(t) { current = &team; }
      ~Leading() {
        current = nullptr;
        team.posted.store(Team::STOP, std::memory_order_release);
      }
    } leading(team);
    result = body();
  });
  return result;
}

}  // namespace tornchat::team
