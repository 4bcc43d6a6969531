#include "communicator.h"

#include <linux/futex.h>
#include <signal.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <stdexcept>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace hfreduce {

// [Note: the barrier protocol]
// Each local rank owns one 32-bit counter `seq` in the shared header: the number of barriers it has
// arrived at. Counters only grow (compared modulo 2^32), so there is no reset phase and no 3-state
// rotation. To pass barrier g a rank publishes seq = g and waits until every peer's seq >= g.
//
//   step | publisher (rank p)              | waiter (rank q, waiting for p)
//   -----+---------------------------------+---------------------------------------------------
//    1   | writes its data (plain stores)  | spins `spin_iters` times on seq[p] (acquire loads)
//    2   | seq[p].store(g)      (seq_cst)  | sleepers[p] += 1                        (seq_cst)
//    3   | if sleepers[p] > 0: futex_wake  | if seq[p] < g: futex_wait(seq[p], seen, 100 ms)
//    4   |                                 | sleepers[p] -= 1; on each wake-up: deadline, pid alive?
//
// The seq_cst pair (store seq / load sleepers) against (add sleepers / load seq) guarantees that either
// the publisher sees a sleeper and wakes it, or the waiter sees the new seq and does not sleep; the
// futex compares the word atomically with `seen` as a second guard. The release semantics of step 2
// publish the data of step 1; the waiter's acquire load makes it visible.
//
// [Note: staging buffers]
// Chunks are staged in three sets of per-rank slots used in rotation. A rank writes a set again only
// after passing a barrier that every peer reaches after it finished reading that set's previous chunk.
// So copy-in/read-all collectives (small all-reduce, reduce-scatter, all-gather, broadcast) take one
// barrier per chunk, and so does the pipelined all-reduce (see [Note: all-reduce of an ordinary tensor]).

namespace {
constexpr uint64_t kMagic = 0x6866726564756365ULL;  // "hfreduce"
constexpr int kMaxLocalRanks = 256;
constexpr size_t kSmallChunkBytes = 32 << 10;  // below this every rank reduces the whole chunk
constexpr size_t kAlign = 64;
constexpr size_t kBufferBlockBytes = 256 << 10;
constexpr int kStagingSets = 3;  // see [Note: staging buffers]

struct alignas(64) PeerState {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> pid;
};

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

long futex(std::atomic<uint32_t>* word, int op, uint32_t value, const struct timespec* timeout) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0);
}

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

bool reached(uint32_t seq, uint32_t generation) { return static_cast<int32_t>(seq - generation) >= 0; }

bool process_alive(int32_t pid) { return pid <= 0 || kill(pid, 0) == 0 || errno != ESRCH; }

// Element range [begin, end) of `rank`'s slice when `count` elements are split over `parts` ranks;
// boundaries fall on cache lines so no two ranks write the same line.
std::pair<size_t, size_t> slice(size_t count, int parts, int rank, size_t elem_size) {
  const size_t per_line = std::max<size_t>(1, kAlign / elem_size);
  const size_t lines = (count + per_line - 1) / per_line;
  const size_t lines_per_rank = (lines + parts - 1) / parts;
  const size_t begin = std::min(count, static_cast<size_t>(rank) * lines_per_rank * per_line);
  const size_t end = std::min(count, begin + lines_per_rank * per_line);
  return {begin, end};
}
}  // namespace

struct Header {
  uint64_t magic;
  int32_t local_size;
  uint64_t slot_bytes;
  std::atomic<int32_t> attached;
  PeerState peers[kMaxLocalRanks];
};

struct Communicator::PeerFailure {
  ErrorKind kind;
  std::string message;
  std::vector<int> ranks;
};

// ---------------------------------------------------------------------------------------------- Work

bool Work::wait(double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  if (timeout_s < 0) {
    cv_.wait(lock, [this] { return done_; });
    return true;
  }
  return cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), [this] { return done_; });
}

bool Work::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

ErrorKind Work::error_kind() {
  std::lock_guard<std::mutex> lock(mu_);
  return kind_;
}

std::string Work::error_message() {
  std::lock_guard<std::mutex> lock(mu_);
  return message_;
}

std::vector<int> Work::error_ranks() {
  std::lock_guard<std::mutex> lock(mu_);
  return ranks_;
}

void Work::finish(ErrorKind kind, std::string message, std::vector<int> ranks) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    kind_ = kind;
    message_ = std::move(message);
    ranks_ = std::move(ranks);
  }
  cv_.notify_all();
}

// ------------------------------------------------------------------------------------- SharedBuffer

SharedBuffer::SharedBuffer(const std::string& name, size_t region_bytes, int local_size, bool create)
    : segment_(name, std::max<size_t>(round_up(region_bytes, 4096), 4096) * local_size, create),
      region_bytes_(std::max<size_t>(round_up(region_bytes, 4096), 4096)),
      local_size_(local_size),
      base_(static_cast<char*>(segment_.data())) {}

// ------------------------------------------------------------------------------------- Communicator

size_t Communicator::segment_bytes(int local_size, size_t slot_bytes) {
  return round_up(sizeof(Header), 4096) + kStagingSets * static_cast<size_t>(local_size) * slot_bytes;
}

Communicator::Communicator(Config config)
    : config_([&] {
        if (config.local_size < 1 || config.local_size > kMaxLocalRanks) {
          throw std::invalid_argument("hfreduce: local_size must be in [1, " + std::to_string(kMaxLocalRanks) +
                                      "], got " + std::to_string(config.local_size));
        }
        if (config.local_rank < 0 || config.local_rank >= config.local_size) {
          throw std::invalid_argument("hfreduce: local_rank out of range");
        }
        if (config.slot_bytes < 4096 || config.slot_bytes % 4096 != 0) {
          throw std::invalid_argument("hfreduce: slot_bytes must be a positive multiple of 4096");
        }
        return config;
      }()),
      segment_(config_.name, segment_bytes(config_.local_size, config_.slot_bytes), config_.create),
      header_(static_cast<Header*>(segment_.data())),
      data_(static_cast<char*>(segment_.data()) + round_up(sizeof(Header), 4096)) {
  if (config_.create) {
    header_->local_size = config_.local_size;
    header_->slot_bytes = config_.slot_bytes;
    header_->magic = kMagic;
  } else if (header_->magic != kMagic || header_->local_size != config_.local_size ||
             header_->slot_bytes != config_.slot_bytes) {
    throw std::runtime_error("hfreduce: segment " + config_.name + " was made for another communicator");
  }
  header_->peers[config_.local_rank].pid.store(static_cast<int32_t>(getpid()));
  header_->attached.fetch_add(1);
  worker_ = std::thread([this] { worker_loop(); });
}

Communicator::~Communicator() { stop(); }

void Communicator::wait_attached() {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(config_.timeout_s);
  while (header_->attached.load() < config_.local_size) {
    if (std::chrono::steady_clock::now() > deadline) {
      throw std::runtime_error("hfreduce: timed out after " + std::to_string(config_.timeout_s) +
                               " s waiting for local peers to map segment " + config_.name);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  if (config_.create) segment_.unlink();
}

void Communicator::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

std::shared_ptr<Work> Communicator::submit(std::function<void()> body, bool blocking) {
  auto work = std::make_shared<Work>();
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    work->finish(ErrorKind::kOther, "hfreduce: the communicator was stopped", {});
    return work;
  }
  if (!blocking) {
    queue_.emplace_back(std::move(body), work);
    lock.unlock();
    cv_.notify_all();
    return work;
  }
  cv_.wait(lock, [this] { return queue_.empty() && !busy_; });  // earlier collectives go first
  busy_ = true;
  lock.unlock();
  execute(body, *work);
  lock.lock();
  busy_ = false;
  lock.unlock();
  cv_.notify_all();
  return work;
}

void Communicator::execute(const std::function<void()>& body, Work& work) {
  if (!broken_.empty()) {
    work.finish(ErrorKind::kOther, "hfreduce: communicator unusable after an earlier failure: " + broken_, {});
    return;
  }
  try {
    body();
    work.finish(ErrorKind::kNone, "", {});
  } catch (const PeerFailure& failure) {
    broken_ = failure.message;
    work.finish(failure.kind, failure.message, failure.ranks);
  } catch (const std::exception& e) {
    broken_ = e.what();
    work.finish(ErrorKind::kOther, e.what(), {});
  }
}

void Communicator::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;
    auto item = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    execute(item.first, *item.second);
    lock.lock();
    busy_ = false;
    cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------- synchronization

void Communicator::arrive_and_wait() {
  const uint32_t generation = ++generation_;
  PeerState& me = header_->peers[config_.local_rank];
  me.seq.store(generation);
  if (me.sleepers.load() != 0) futex(&me.seq, FUTEX_WAKE, INT_MAX, nullptr);
  for (int peer = 0; peer < config_.local_size; ++peer) {
    if (peer != config_.local_rank) wait_for_peer(peer, generation);
  }
}

void Communicator::wait_for_peer(int peer, uint32_t generation) {
  PeerState& state = header_->peers[peer];
  for (int i = 0; i < config_.spin_iters; ++i) {
    if (reached(state.seq.load(std::memory_order_acquire), generation)) return;
    cpu_relax();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(config_.timeout_s);
  const struct timespec slice_timeout = {0, 100 * 1000 * 1000};
  for (;;) {
    state.sleepers.fetch_add(1);
    const uint32_t seen = state.seq.load();
    if (!reached(seen, generation)) futex(&state.seq, FUTEX_WAIT, seen, &slice_timeout);
    state.sleepers.fetch_sub(1);
    if (reached(state.seq.load(std::memory_order_acquire), generation)) return;
    if (!process_alive(state.pid.load())) fail_waiting(ErrorKind::kPeerDied, generation, peer);
    if (std::chrono::steady_clock::now() > deadline) fail_waiting(ErrorKind::kTimeout, generation, -1);
  }
}

void Communicator::fail_waiting(ErrorKind kind, uint32_t generation, int dead_peer) {
  std::vector<int> ranks;
  std::string list;
  for (int peer = 0; peer < config_.local_size; ++peer) {
    const bool missing = kind == ErrorKind::kPeerDied ? peer == dead_peer
                                                      : !reached(header_->peers[peer].seq.load(), generation);
    if (peer == config_.local_rank || !missing) continue;
    ranks.push_back(peer);
    list += (list.empty() ? "" : ", ") + std::to_string(peer);
  }
  std::string message = kind == ErrorKind::kPeerDied
                            ? "hfreduce: local rank " + list + " (pid " +
                                  std::to_string(header_->peers[dead_peer].pid.load()) + ") died"
                            : "hfreduce: timed out after " + std::to_string(config_.timeout_s) +
                                  " s waiting for local ranks [" + list + "]";
  throw PeerFailure{kind, std::move(message), std::move(ranks)};
}

char* Communicator::staging(int set, int rank) const {
  return data_ + (static_cast<size_t>(set) * config_.local_size + rank) * config_.slot_bytes;
}

int Communicator::next_set() {
  const int set = set_;
  set_ = (set_ + 1) % kStagingSets;
  return set;
}

// ------------------------------------------------------------------------------------- collectives

std::shared_ptr<Work> Communicator::all_reduce(const void* src, void* dst, size_t count, DType dtype,
                                               double divisor, bool blocking) {
  return submit([=] { run_all_reduce(static_cast<const char*>(src), static_cast<char*>(dst), count, dtype, divisor); },
                blocking);
}

std::shared_ptr<Work> Communicator::all_reduce_buffer(std::shared_ptr<SharedBuffer> buffer, size_t offset_bytes,
                                                      size_t count, DType dtype, double divisor, bool blocking) {
  if (offset_bytes + count * element_size(dtype) > buffer->region_bytes()) {
    throw std::invalid_argument("hfreduce: all_reduce_buffer range exceeds the buffer");
  }
  return submit([=] { run_all_reduce_buffer(*buffer, offset_bytes, count, dtype, divisor); }, blocking);
}

std::shared_ptr<Work> Communicator::reduce_scatter(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                                   double divisor, bool blocking) {
  return submit(
      [=] { run_reduce_scatter(static_cast<const char*>(src), static_cast<char*>(dst), count_per_rank, dtype, divisor); },
      blocking);
}

std::shared_ptr<Work> Communicator::all_gather(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                               bool blocking) {
  return submit([=] { run_all_gather(static_cast<const char*>(src), static_cast<char*>(dst), count_per_rank, dtype); },
                blocking);
}

std::shared_ptr<Work> Communicator::broadcast(void* buffer, size_t count, DType dtype, int root, bool blocking) {
  if (root < 0 || root >= config_.local_size) throw std::invalid_argument("hfreduce: broadcast root out of range");
  return submit([=] { run_broadcast(static_cast<char*>(buffer), count, dtype, root); }, blocking);
}

std::shared_ptr<Work> Communicator::barrier(bool blocking) {
  return submit([this] { arrive_and_wait(); }, blocking);
}

void Communicator::run_all_reduce(const char* src, char* dst, size_t count, DType dtype, double divisor) {
  const size_t es = element_size(dtype);
  const int ranks = config_.local_size;
  const int me = config_.local_rank;
  std::vector<const void*> srcs(ranks);
  if (count * es <= kSmallChunkBytes || ranks == 1) {
    // Small: one chunk, one barrier, and every rank reduces all of it.
    const size_t chunk = config_.slot_bytes / es;
    for (size_t off = 0; off < count; off += chunk) {
      const size_t n = std::min(chunk, count - off);
      const int set = next_set();
      std::memcpy(staging(set, me), src + off * es, n * es);
      arrive_and_wait();
      for (int k = 0; k < ranks; ++k) srcs[k] = staging(set, k);
      reduce(dtype, dst + off * es, srcs.data(), ranks, n, divisor);
    }
    return;
  }
  // [Note: all-reduce of an ordinary tensor] Chunk k passes through: stage (each rank copies in only
  // the slices its peers reduce) | reduce its own slice, straight from `src` and the peers' staging,
  // into `dst` and its staging | copy the peers' reduced slices out. One barrier per chunk separates
  // "reduce k, stage k+1" from "copy out k": with three staging sets, the set that chunk k+3 overwrites
  // was last read by a peer's copy-out of chunk k, which finished before that peer's next barrier.
  const size_t chunk = config_.slot_bytes / es;
  const size_t chunks = (count + chunk - 1) / chunk;
  auto bounds = [&](size_t k) { return std::make_pair(k * chunk, std::min(chunk, count - k * chunk)); };
  auto stage = [&](size_t k, int set) {
    const auto [off, n] = bounds(k);
    for (int r = 0; r < ranks; ++r) {
      const auto [b, e] = slice(n, ranks, r, es);
      if (r != me) std::memcpy(staging(set, me) + b * es, src + (off + b) * es, (e - b) * es);
    }
  };
  const size_t block = std::max<size_t>(1, kBufferBlockBytes / es);
  int set = next_set();
  stage(0, set);
  arrive_and_wait();
  for (size_t k = 0; k < chunks; ++k) {
    const auto [off, n] = bounds(k);
    const auto [begin, end] = slice(n, ranks, me, es);
    char* out = dst + off * es;
    for (size_t b = begin; b < end; b += block) {
      const size_t len = std::min(block, end - b);
      for (int r = 0; r < ranks; ++r) srcs[r] = (r == me ? src + off * es : staging(set, r)) + b * es;
      reduce(dtype, out + b * es, srcs.data(), ranks, len, divisor);
      std::memcpy(staging(set, me) + b * es, out + b * es, len * es);
    }
    const int next = k + 1 < chunks ? next_set() : set;
    if (k + 1 < chunks) stage(k + 1, next);
    arrive_and_wait();
    for (int r = 0; r < ranks; ++r) {
      const auto [b, e] = slice(n, ranks, r, es);
      if (r != me) std::memcpy(out + b * es, staging(set, r) + b * es, (e - b) * es);
    }
    set = next;
  }
}

void Communicator::run_all_reduce_buffer(const SharedBuffer& buffer, size_t offset, size_t count, DType dtype,
                                         double divisor) {
  const size_t es = element_size(dtype);
  const int ranks = config_.local_size;
  const int me = config_.local_rank;
  arrive_and_wait();  // every rank's data is in its region
  const auto [begin, end] = slice(count, ranks, me, es);
  const size_t block = std::max<size_t>(1, kBufferBlockBytes / es);
  std::vector<const void*> srcs(ranks);
  for (size_t b = begin; b < end; b += block) {
    const size_t n = std::min(block, end - b);
    const size_t at = offset + b * es;
    for (int k = 0; k < ranks; ++k) srcs[k] = buffer.region(k) + at;
    reduce(dtype, buffer.region(me) + at, srcs.data(), ranks, n, divisor);
    for (int k = 0; k < ranks; ++k) {
      if (k != me) std::memcpy(buffer.region(k) + at, buffer.region(me) + at, n * es);
    }
  }
  arrive_and_wait();  // every slice is written back everywhere
}

void Communicator::run_reduce_scatter(const char* src, char* dst, size_t count, DType dtype, double divisor) {
  const size_t es = element_size(dtype);
  const int ranks = config_.local_size;
  const int me = config_.local_rank;
  const size_t piece = std::max<size_t>(1, config_.slot_bytes / (es * ranks));
  std::vector<const void*> srcs(ranks);
  for (size_t off = 0; off < count; off += piece) {
    const size_t n = std::min(piece, count - off);
    const int set = next_set();
    char* mine = staging(set, me);
    for (int j = 0; j < ranks; ++j) std::memcpy(mine + j * n * es, src + (j * count + off) * es, n * es);
    arrive_and_wait();
    for (int k = 0; k < ranks; ++k) srcs[k] = staging(set, k) + me * n * es;
    reduce(dtype, dst + off * es, srcs.data(), ranks, n, divisor);
  }
}

void Communicator::run_all_gather(const char* src, char* dst, size_t count, DType dtype) {
  const size_t es = element_size(dtype);
  const size_t chunk = config_.slot_bytes / es;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    const int set = next_set();
    std::memcpy(staging(set, config_.local_rank), src + off * es, n * es);
    arrive_and_wait();
    for (int k = 0; k < config_.local_size; ++k) std::memcpy(dst + (k * count + off) * es, staging(set, k), n * es);
  }
}

void Communicator::run_broadcast(char* buffer, size_t count, DType dtype, int root) {
  const size_t es = element_size(dtype);
  const size_t chunk = config_.slot_bytes / es;
  for (size_t off = 0; off < count; off += chunk) {
    const size_t n = std::min(chunk, count - off);
    const int set = next_set();
    if (config_.local_rank == root) std::memcpy(staging(set, root), buffer + off * es, n * es);
    arrive_and_wait();
    if (config_.local_rank != root) std::memcpy(buffer + off * es, staging(set, root), n * es);
  }
}

}  // namespace hfreduce
