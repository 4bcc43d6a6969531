#include "communicator.h"

#include <fcntl.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
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
//   step | publisher (rank p)                   | waiter (rank q, waiting for p)
//   -----+--------------------------------------+----------------------------------------------------
//    1   | writes its data (plain stores); at a | spins `spin_iters` times on seq[p] (acquire loads)
//        | collective's first barrier also its  |
//        | fingerprint calls[p][c % 2]          |
//    2   | seq[p].store(g)      (seq_cst)       | sleepers[p] += 1                        (seq_cst)
//    3   | if sleepers[p] > 0: futex_wake       | if seq[p] < g: futex_wait(seq[p], seen, 100 ms)
//    4   |                                      | sleepers[p] -= 1; on each wake-up: deadline, pid alive?
//    5   |                                      | at a first barrier: calls[p][c % 2] == its own call?
//
// The seq_cst pair (store seq / load sleepers) against (add sleepers / load seq) guarantees that either
// the publisher sees a sleeper and wakes it, or the waiter sees the new seq and does not sleep; the
// futex compares the word atomically with `seen` as a second guard. The release semantics of step 2
// publish the data of step 1; the waiter's acquire load makes it visible.
//
// [Note: abort]
// A rank whose program failed (an exception between or inside collectives) must end its peers' waits at
// once, not when its process exits. The header holds one abort record for the host:
//
//   step | aborter (any local rank, any thread)        | waiter (in wait_for_peer)
//   -----+---------------------------------------------+------------------------------------------------
//    1   | abort_state CAS 0 -> 1 (seq_cst); lost: done | before each futex_wait and after each wake-up:
//    2   | writes aborted_rank, abort_reason (plain)    |   abort_state.load() == 2 (seq_cst)?
//    3   | abort_state.store(2)  (seq_cst, publishes 2) |   yes: reads aborted_rank, abort_reason; fails
//    4   | futex_wake on every peer's seq word          |   with kAborted
//
// The wake of step 4 ends any futex_wait at once (the waiter then sees state 2, published before the
// wake); a waiter between its check and its futex_wait sleeps at most its 100 ms slice. The record is never
// cleared: the communicator is done, as after any failure. Across hosts, the Python face carries the
// abort (lightning_haiscale/hfreduce/abort.py) and calls abort() on each host's communicators.
//
// [Note: agreement check]
// Ranks that call different collectives (sizes, dtypes, ops, roots, kinds) must fail, never read each
// other's data as if it were theirs. Each collective's first barrier carries a Fingerprint of the call
// (what, dtype, count, op, root or offset; 24 bytes, in the rank's own header line beside `seq`, so
// the waiter's cache miss on `seq` brings it too). After passing that barrier, before reading any
// peer's data, each rank compares every peer's fingerprint with its own; on any difference every rank
// raises (each sees at least one fingerprint unlike its own), naming every rank's call. Collective c
// uses slot c % 2: a rank writes slot c % 2 again only for collective c + 2, after passing collective
// c + 1's first barrier, which every peer reaches only after it compared collective c's fingerprints.
// No sequence number is stored: while every earlier collective agreed, all ranks made the same
// calls and so passed the same barriers, so collective c's first barrier is generation g on every rank.
// A collective with nothing to move still takes that one barrier, so `count=0` against `count=5` fails.
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
constexpr size_t kAbortReasonBytes = 512;
constexpr int32_t kAbortWriting = 1;
constexpr int32_t kAbortPublished = 2;

struct alignas(64) PeerState {
  std::atomic<uint32_t> seq;
  std::atomic<uint32_t> sleepers;
  std::atomic<int32_t> pid;
  Fingerprint calls[2];  // published by `seq`; see [Note: agreement check]
};
static_assert(sizeof(PeerState) == 64, "a rank's barrier state and fingerprints share one cache line");

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

// Whether `pid` runs. kill(pid, 0) also succeeds on a zombie (exited, not yet reaped by its parent, e.g.
// under a launcher whose main thread is busy), so the state letter in /proc/<pid>/stat is read too.
bool process_alive(int32_t pid) {
  if (pid <= 0) return true;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  const std::string path = "/proc/" + std::to_string(pid) + "/stat";
  const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno != ENOENT;
  char text[512];
  const ssize_t n = read(fd, text, sizeof(text) - 1);
  close(fd);
  if (n <= 0) return true;
  text[n] = '\0';
  const char* end_of_name = std::strrchr(text, ')');  // "pid (comm) S ...": comm may hold spaces and ')'
  if (end_of_name == nullptr || end_of_name[1] == '\0' || end_of_name[2] == '\0') return true;
  const char state = end_of_name[2];
  return state != 'Z' && state != 'X';
}

const char* collective_name(Collective collective) {
  switch (collective) {
    case Collective::kAllReduce:
      return "all_reduce";
    case Collective::kAllReduceBuffer:
      return "all_reduce";
    case Collective::kReduceScatter:
      return "reduce_scatter";
    case Collective::kAllGather:
      return "all_gather";
    case Collective::kBroadcast:
      return "broadcast";
    case Collective::kBarrier:
      return "barrier";
    case Collective::kDisagreedElsewhere:
      return "a collective that ranks on other hosts called differently";
    case Collective::kNone:
      break;
  }
  return "nothing";
}

Fingerprint fingerprint(Collective collective, DType dtype, size_t count, uint64_t arg, double divisor) {
  Fingerprint call;
  call.collective = collective;
  call.dtype = static_cast<uint8_t>(dtype);
  call.divisor = static_cast<float>(divisor);
  call.count = count;
  call.arg = arg;
  return call;
}

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

// [Note: waiting on a shared core]
// An asynchronous collective runs on the worker thread while its caller keeps computing (hai_ddp's
// backward), so the rank has two busy threads. The worker spins only when every local rank has two cores;
// otherwise it sleeps at once and leaves the core to that computation. (hai_ddp, 2 ranks on 2 cores,
// GPT 85M: spinning cost about 27 ms of CPU a step, benchmarks/RESULTS.md.) A blocking collective runs on
// the caller's thread, which has nothing else to do meanwhile: it spins `spin_iters` times.
int worker_spin_iters(const Config& config) {
  cpu_set_t cores;
  CPU_ZERO(&cores);
  const int count = sched_getaffinity(0, sizeof(cores), &cores) == 0 ? CPU_COUNT(&cores) : 1;
  return 2 * config.local_size <= count ? config.spin_iters : 0;
}

}  // namespace

struct Header {
  uint64_t magic;
  int32_t local_size;
  uint64_t slot_bytes;
  std::atomic<int32_t> attached;
  std::atomic<int32_t> abort_state;  // see [Note: abort]
  int32_t aborted_rank;
  char abort_reason[kAbortReasonBytes];
  PeerState peers[kMaxLocalRanks];
};

std::string Fingerprint::describe() const {
  std::string text = collective_name(collective);
  if (collective == Collective::kBarrier || collective == Collective::kDisagreedElsewhere ||
      collective == Collective::kNone) {
    return text + (collective == Collective::kBarrier ? "()" : "");
  }
  const bool per_rank = collective == Collective::kReduceScatter || collective == Collective::kAllGather;
  text += "(" + std::to_string(count) + " x " + dtype_name(static_cast<DType>(dtype)) + (per_rank ? " per rank" : "");
  if (collective == Collective::kBroadcast) text += ", root=rank " + std::to_string(arg);
  if (collective == Collective::kAllReduceBuffer) text += " in a shared buffer at byte " + std::to_string(arg);
  if (collective != Collective::kBroadcast && collective != Collective::kAllGather) {
    text += divisor == 1 ? ", op=sum" : ", op=avg over " + std::to_string(static_cast<int64_t>(divisor));
  }
  return text + ")";
}

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
  worker_spin_iters_ = worker_spin_iters(config_);
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
  work_cv_.notify_all();
  if (worker_.joinable() && worker_.get_id() != std::this_thread::get_id()) worker_.join();
}

std::shared_ptr<Work> Communicator::submit(Fingerprint call, std::function<void()> body, bool blocking) {
  Job job{call, std::move(body), std::make_shared<Work>()};
  auto work = job.work;
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) {
    work->finish(ErrorKind::kOther, "hfreduce: the communicator was stopped", {});
    return work;
  }
  if (!blocking) {
    queue_.push_back(std::move(job));
    lock.unlock();
    work_cv_.notify_one();
    return work;
  }
  idle_cv_.wait(lock, [this] { return queue_.empty() && !busy_; });  // earlier collectives go first
  busy_ = true;
  lock.unlock();
  execute(job);
  lock.lock();
  busy_ = false;
  const bool wake_worker = !queue_.empty() || stopping_;  // queued or stopped while this one ran
  lock.unlock();
  if (wake_worker) work_cv_.notify_one();
  idle_cv_.notify_all();  // another thread's inline call; no system call when nobody waits
  return work;
}

void Communicator::execute(const Job& job) {
  if (!broken_.empty()) {
    job.work->finish(ErrorKind::kOther, "hfreduce: communicator unusable after an earlier failure: " + broken_, {});
    return;
  }
  try {
    call_ = job.call;
    announced_ = false;
    job.body();
    if (!announced_) arrive_and_wait();  // nothing to move: the agreement check still runs
    job.work->finish(ErrorKind::kNone, "", {});
  } catch (const PeerFailure& failure) {
    broken_ = failure.message;
    job.work->finish(failure.kind, failure.message, failure.ranks);
  } catch (const std::exception& e) {
    broken_ = e.what();
    job.work->finish(ErrorKind::kOther, e.what(), {});
  }
}

void Communicator::worker_loop() {
  // A name tools can find (top -H, perf, /proc/<pid>/task/*/comm): benchmarks/strategy_ddp.py reads this
  // thread's CPU time, the cost of the asynchronous collectives, from /proc/self/task/<tid>/schedstat.
  pthread_setname_np(pthread_self(), kWorkerThreadName);
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    work_cv_.wait(lock, [this] { return (stopping_ && !busy_) || (!queue_.empty() && !busy_); });
    if (queue_.empty()) return;
    Job job = std::move(queue_.front());
    queue_.pop_front();
    busy_ = true;
    lock.unlock();
    execute(job);
    lock.lock();
    busy_ = false;
    idle_cv_.notify_all();
  }
}

// ---------------------------------------------------------------------------------- synchronization

void Communicator::arrive_and_wait() {
  const uint32_t generation = ++generation_;
  PeerState& me = header_->peers[config_.local_rank];
  const bool first = !announced_;
  if (first) me.calls[calls_ % 2] = call_;
  me.seq.store(generation);
  if (me.sleepers.load() != 0) futex(&me.seq, FUTEX_WAKE, INT_MAX, nullptr);
  for (int peer = 0; peer < config_.local_size; ++peer) {
    if (peer != config_.local_rank) wait_for_peer(peer, generation);
  }
  if (first) {
    announced_ = true;
    check_agreement();
    ++calls_;
  }
}

void Communicator::check_agreement() const {
  const int slot = static_cast<int>(calls_ % 2);
  bool agree = true;
  for (int peer = 0; peer < config_.local_size; ++peer) agree = agree && header_->peers[peer].calls[slot] == call_;
  if (agree) return;
  std::vector<int> ranks;
  std::string calls;
  for (int peer = 0; peer < config_.local_size; ++peer) {
    const Fingerprint& theirs = header_->peers[peer].calls[slot];
    if (!(theirs == call_)) ranks.push_back(peer);
    calls += (peer == 0 ? "" : "; ") + std::string("local rank ") + std::to_string(peer) + " called " +
             theirs.describe();
  }
  throw PeerFailure{ErrorKind::kMismatch,
                    "hfreduce: ranks called different collectives (call " + std::to_string(calls_ + 1) +
                        " of this communicator): " + calls +
                        ". Is there a distributed collective mismatch in your code? Every rank must make the "
                        "same calls, with the same sizes, dtypes, ops and roots, in the same order",
                    std::move(ranks)};
}

void Communicator::wait_for_peer(int peer, uint32_t generation) {
  PeerState& state = header_->peers[peer];
  const int spins = std::this_thread::get_id() == worker_.get_id() ? worker_spin_iters_ : config_.spin_iters;
  for (int i = 0; i < spins; ++i) {
    if (reached(state.seq.load(std::memory_order_acquire), generation)) return;
    cpu_relax();
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(config_.timeout_s);
  const struct timespec slice_timeout = {0, 100 * 1000 * 1000};
  for (;;) {
    fail_if_aborted();
    state.sleepers.fetch_add(1);
    const uint32_t seen = state.seq.load();
    if (!reached(seen, generation)) futex(&state.seq, FUTEX_WAIT, seen, &slice_timeout);
    state.sleepers.fetch_sub(1);
    if (reached(state.seq.load(std::memory_order_acquire), generation)) return;
    fail_if_aborted();
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

bool Communicator::abort(int32_t rank, const std::string& reason) {
  int32_t idle = 0;
  if (!header_->abort_state.compare_exchange_strong(idle, kAbortWriting)) return false;
  header_->aborted_rank = rank;
  const size_t n = std::min(reason.size(), kAbortReasonBytes - 1);
  std::memcpy(header_->abort_reason, reason.data(), n);
  header_->abort_reason[n] = '\0';
  header_->abort_state.store(kAbortPublished);
  for (int peer = 0; peer < config_.local_size; ++peer) futex(&header_->peers[peer].seq, FUTEX_WAKE, INT_MAX, nullptr);
  return true;
}

bool Communicator::aborted(int32_t* rank, std::string* reason) const {
  if (header_->abort_state.load() != kAbortPublished) return false;
  *rank = header_->aborted_rank;
  *reason = header_->abort_reason;
  return true;
}

void Communicator::fail_if_aborted() const {
  int32_t rank = -1;
  std::string reason;
  if (!aborted(&rank, &reason)) return;
  throw PeerFailure{ErrorKind::kAborted, "hfreduce: " + reason, {rank}};
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
  return submit(fingerprint(Collective::kAllReduce, dtype, count, 0, divisor),
                [=] { run_all_reduce(static_cast<const char*>(src), static_cast<char*>(dst), count, dtype, divisor); },
                blocking);
}

std::shared_ptr<Work> Communicator::all_reduce_buffer(std::shared_ptr<SharedBuffer> buffer, size_t offset_bytes,
                                                      size_t count, DType dtype, double divisor, bool blocking) {
  if (offset_bytes + count * element_size(dtype) > buffer->region_bytes()) {
    throw std::invalid_argument("hfreduce: all_reduce_buffer range exceeds the buffer");
  }
  return submit(fingerprint(Collective::kAllReduceBuffer, dtype, count, offset_bytes, divisor),
                [=] { run_all_reduce_buffer(*buffer, offset_bytes, count, dtype, divisor); }, blocking);
}

std::shared_ptr<Work> Communicator::reduce_scatter(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                                   double divisor, bool blocking) {
  return submit(
      fingerprint(Collective::kReduceScatter, dtype, count_per_rank, 0, divisor),
      [=] { run_reduce_scatter(static_cast<const char*>(src), static_cast<char*>(dst), count_per_rank, dtype, divisor); },
      blocking);
}

std::shared_ptr<Work> Communicator::all_gather(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                               bool blocking) {
  return submit(fingerprint(Collective::kAllGather, dtype, count_per_rank, 0, 1.0),
                [=] { run_all_gather(static_cast<const char*>(src), static_cast<char*>(dst), count_per_rank, dtype); },
                blocking);
}

std::shared_ptr<Work> Communicator::broadcast(void* buffer, size_t count, DType dtype, int root, bool blocking) {
  if (root < 0 || root >= config_.local_size) throw std::invalid_argument("hfreduce: broadcast root out of range");
  return submit(fingerprint(Collective::kBroadcast, dtype, count, static_cast<uint64_t>(root), 1.0),
                [=] { run_broadcast(static_cast<char*>(buffer), count, dtype, root); }, blocking);
}

std::shared_ptr<Work> Communicator::barrier(bool blocking) {
  return submit(fingerprint(Collective::kBarrier, DType::kFloat32, 0, 0, 1.0), [this] { arrive_and_wait(); }, blocking);
}

std::shared_ptr<Work> Communicator::agree(Fingerprint call, bool blocking) {
  return submit(call, [this] { arrive_and_wait(); }, blocking);
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
      void* dsts[2] = {out + b * es, staging(set, me) + b * es};  // the tensor, and the peers' copy
      reduce(dtype, dsts, 2, srcs.data(), ranks, len, divisor);
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
  std::vector<void*> dsts(ranks);
  for (size_t b = begin; b < end; b += block) {
    const size_t n = std::min(block, end - b);
    const size_t at = offset + b * es;
    for (int k = 0; k < ranks; ++k) srcs[k] = dsts[k] = buffer.region(k) + at;
    reduce(dtype, dsts.data(), ranks, srcs.data(), ranks, n, divisor);  // into every rank's region at once
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
