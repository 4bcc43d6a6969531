// The host-local collective engine: one shared-memory segment per communicator, one worker thread.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "reduce_kernels.h"
#include "shm_segment.h"

namespace hfreduce {

// Why a collective failed; the Python face turns these into HFReduceTimeoutError, HFReducePeerError and
// HFReduceMismatchError.
enum class ErrorKind : int32_t { kNone = 0, kTimeout = 1, kPeerDied = 2, kOther = 3, kMismatch = 4, kAborted = 5 };

// The kinds of call a rank can make. kDisagreedElsewhere is what a rank announces when its peers on other
// hosts disagreed with it (the hierarchical path), so that its local peers fail with it.
enum class Collective : uint8_t {
  kNone = 0,
  kAllReduce = 1,
  kAllReduceBuffer = 2,
  kReduceScatter = 3,
  kAllGather = 4,
  kBroadcast = 5,
  kBarrier = 6,
  kDisagreedElsewhere = 7,
};

// What one rank is calling, with every argument its peers must share; see [Note: agreement check].
// 24 bytes: two of them fit beside a rank's barrier counter in its cache line of the shared header.
struct Fingerprint {
  Collective collective = Collective::kNone;
  uint8_t dtype = 0;    // a DType code
  float divisor = 1;    // 1: sum; otherwise the average over this many ranks
  uint64_t count = 0;   // elements (per rank for reduce_scatter and all_gather)
  uint64_t arg = 0;     // broadcast: the root (local rank; group rank in agree()); all_reduce_buffer: byte offset
  bool operator==(const Fingerprint& other) const {
    return collective == other.collective && dtype == other.dtype && divisor == other.divisor &&
           count == other.count && arg == other.arg;
  }
  // e.g. "all_reduce(1000 x float32, op=sum)"
  std::string describe() const;
};

// Completion handle of one asynchronous collective.
class Work {
 public:
  // Blocks until done or `timeout_s` passes (negative: no limit). Returns whether it is done.
  bool wait(double timeout_s);
  bool is_completed();
  ErrorKind error_kind();
  std::string error_message();
  std::vector<int> error_ranks();  // local ranks that were missing or dead

  void finish(ErrorKind kind, std::string message, std::vector<int> ranks);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  ErrorKind kind_ = ErrorKind::kNone;
  std::string message_;
  std::vector<int> ranks_;
};

// Tensors that live in shared memory: one region per local rank, all mapped by every local rank, so an
// all-reduce of a region reduces in place with no copy in or out.
class SharedBuffer {
 public:
  SharedBuffer(const std::string& name, size_t region_bytes, int local_size, bool create);
  char* region(int local_rank) const { return base_ + static_cast<size_t>(local_rank) * region_bytes_; }
  size_t region_bytes() const { return region_bytes_; }
  int local_size() const { return local_size_; }
  void unlink() { segment_.unlink(); }

 private:
  ShmSegment segment_;
  size_t region_bytes_;
  int local_size_;
  char* base_;
};

struct Config {
  std::string name;           // POSIX shm name of the control segment, e.g. "/lhs-<random>"
  int local_rank = 0;
  int local_size = 1;
  bool create = false;        // the creator (local rank 0) makes and later unlinks the segment
  size_t slot_bytes = 1 << 20;  // staging chunk per rank; three sets of them rotate
  double timeout_s = 300;     // deadline of every wait on a peer
  int spin_iters = 0;         // busy-wait this often before sleeping (0 when ranks share cores)
};

struct Header;

// The OS name of every communicator's worker thread (at most 15 characters, a Linux limit).
inline constexpr char kWorkerThreadName[] = "hfreduce-engine";

class Communicator {
 public:
  explicit Communicator(Config config);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  // Bytes of shared memory a communicator of this shape maps (for the /dev/shm preflight).
  static size_t segment_bytes(int local_size, size_t slot_bytes);

  // Collective: returns once every local rank has mapped the segment; the creator then unlinks it.
  void wait_attached();

  // Collectives, run in submission order. Every local rank must submit the same sequence. With
  // blocking=false they are queued for the worker thread and pointers must stay valid until the Work
  // completes; with blocking=true they run on the calling thread once earlier work is done (no thread
  // hand-off: this is what makes a small synchronous all-reduce take microseconds).
  std::shared_ptr<Work> all_reduce(const void* src, void* dst, size_t count, DType dtype, double divisor,
                                   bool blocking);
  std::shared_ptr<Work> all_reduce_buffer(std::shared_ptr<SharedBuffer> buffer, size_t offset_bytes,
                                          size_t count, DType dtype, double divisor, bool blocking);
  std::shared_ptr<Work> reduce_scatter(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                       double divisor, bool blocking);
  std::shared_ptr<Work> all_gather(const void* src, void* dst, size_t count_per_rank, DType dtype,
                                   bool blocking);
  std::shared_ptr<Work> broadcast(void* buffer, size_t count, DType dtype, int root, bool blocking);
  std::shared_ptr<Work> barrier(bool blocking);
  // A barrier that only checks that every local rank announces `call` (HFReduceMismatchError if not): the
  // hierarchical path checks the caller's whole collective with it before splitting it into engine calls.
  std::shared_ptr<Work> agree(Fingerprint call, bool blocking);

  // Finishes queued work, then stops the worker thread. Idempotent; later submissions fail.
  void stop();

  // Marks the whole host's communicator failed because `rank` (a group rank, on any host) failed with
  // `reason`: every wait of every local rank on it ends with kAborted within a futex wake-up (see [Note:
  // abort]). The first abort wins; returns whether this one was it.
  bool abort(int32_t rank, const std::string& reason);
  // Whether the communicator was aborted; if so, by which group rank and why.
  bool aborted(int32_t* rank, std::string* reason) const;

 private:
  struct PeerFailure;

  struct Job {
    Fingerprint call;
    std::function<void()> body;
    std::shared_ptr<Work> work;
  };

  std::shared_ptr<Work> submit(Fingerprint call, std::function<void()> body, bool blocking);
  void execute(const Job& job);
  void worker_loop();
  void arrive_and_wait();
  void check_agreement() const;
  void wait_for_peer(int peer, uint32_t generation);
  [[noreturn]] void fail_waiting(ErrorKind kind, uint32_t generation, int dead_peer);
  void fail_if_aborted() const;
  char* staging(int set, int rank) const;
  int next_set();

  void run_all_reduce(const char* src, char* dst, size_t count, DType dtype, double divisor);
  void run_all_reduce_buffer(const SharedBuffer& buffer, size_t offset, size_t count, DType dtype,
                             double divisor);
  void run_reduce_scatter(const char* src, char* dst, size_t count, DType dtype, double divisor);
  void run_all_gather(const char* src, char* dst, size_t count, DType dtype);
  void run_broadcast(char* buffer, size_t count, DType dtype, int root);

  Config config_;
  ShmSegment segment_;
  Header* header_;
  char* data_;
  uint32_t generation_ = 0;  // barriers this rank has passed
  uint32_t calls_ = 0;       // collectives this rank has announced (see [Note: agreement check])
  Fingerprint call_;         // the running collective, announced at its first barrier
  bool announced_ = true;    // call_ is in the header and was checked (false until its first barrier)
  int set_ = 0;              // staging set the next chunk uses (of kStagingSets)
  int worker_spin_iters_ = 0;  // the worker's spin_iters: see [Note: waiting on a shared core]

  // [Note: two condition variables] The worker sleeps on work_cv_, woken only when work is queued or the
  // communicator stops; a synchronous call waits on idle_cv_ for earlier work to finish. With one shared
  // variable, every synchronous call woke the idle worker thread: a futex system call and a context
  // switch per call, and a thread competing for the caller's core (measured: 1.4 context switches per
  // 4 KiB all-reduce in one process; see RESULTS.md).
  std::mutex mu_;
  std::condition_variable work_cv_;
  std::condition_variable idle_cv_;
  std::deque<Job> queue_;
  bool stopping_ = false;
  bool busy_ = false;   // a collective is running (on the worker or inline); guarded by mu_
  std::string broken_;  // first failure; every later collective fails with it
  std::thread worker_;
};

}  // namespace hfreduce
