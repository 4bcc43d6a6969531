// RAII POSIX shared-memory segment: created 0600 under an unguessable name, unlinked early.
#pragma once

#include <cstddef>
#include <stdexcept>
#include <string>

namespace hfreduce {

// [Note: segment lifetime]
// The creator makes the segment with O_EXCL and mode 0600; peers open it by name. As soon as every
// local peer has mapped it, the creator unlinks the name, so the memory is freed by the kernel when the
// last mapping goes away, even after SIGKILL. A segment whose peers never arrive is unlinked by the
// creator's destructor. Nothing is left in /dev/shm after close, an exception, or a crash after attach.
// /dev/shm could not hold a new segment; the segment was not created (nothing is left behind).
class ShmFullError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class ShmSegment {
 public:
  // create=true makes a new segment of `bytes` (zero-filled, every page reserved: ShmFullError if /dev/shm
  // cannot hold it); create=false maps an existing one.
  ShmSegment(const std::string& name, size_t bytes, bool create);
  ~ShmSegment();
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  void* data() const { return data_; }
  // Removes the name from /dev/shm; the mappings stay valid. Idempotent.
  void unlink();

 private:
  void reserve(int fd, size_t bytes);

  std::string name_;
  size_t bytes_ = 0;
  void* data_ = nullptr;
  bool owner_ = false;
  bool linked_ = false;
};

}  // namespace hfreduce
