#include "shm_segment.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <stdexcept>

namespace hfreduce {

namespace {
std::runtime_error sys_error(const std::string& what, const std::string& name) {
  return std::runtime_error("hfreduce: " + what + " of shared-memory segment '" + name +
                            "' failed: " + std::strerror(errno));
}
}  // namespace

ShmSegment::ShmSegment(const std::string& name, size_t bytes, bool create)
    : name_(name), bytes_(bytes), owner_(create) {
  int flags = create ? (O_CREAT | O_EXCL | O_RDWR) : O_RDWR;
  int fd = shm_open(name.c_str(), flags, 0600);
  if (fd < 0) throw sys_error("shm_open", name);
  linked_ = create;
  if (create) reserve(fd, bytes);
  if (!create) {
    struct stat st {};
    if (fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) < bytes) {
      close(fd);
      throw std::runtime_error("hfreduce: shared-memory segment '" + name + "' is smaller than expected");
    }
  }
  data_ = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (data_ == MAP_FAILED) {
    data_ = nullptr;
    auto err = sys_error("mmap", name);
    if (create) shm_unlink(name.c_str());
    throw err;
  }
}

// [Note: reserving shared memory]
// ftruncate only sets a tmpfs file's size; its pages are allocated when first touched, and a touch that
// finds /dev/shm full kills the process with SIGBUS (mid-collective, leaving the segment behind).
// posix_fallocate allocates (and zero-fills) every page now, or fails with ENOSPC while nothing but
// this name exists, which is then unlinked.
void ShmSegment::reserve(int fd, size_t bytes) {
  int err = 0;
  do {
    err = posix_fallocate(fd, 0, static_cast<off_t>(bytes));
  } while (err == EINTR);
  if (err == 0) return;
  close(fd);
  shm_unlink(name_.c_str());
  linked_ = false;
  const std::string what = "hfreduce: cannot reserve " + std::to_string(bytes) + " bytes for shared-memory segment '" +
                           name_ + "': " + std::strerror(err);
  if (err == ENOSPC || err == ENOMEM) throw ShmFullError(what);
  throw std::runtime_error(what);
}

ShmSegment::~ShmSegment() {
  if (owner_) unlink();
  if (data_ != nullptr) munmap(data_, bytes_);
}

void ShmSegment::unlink() {
  if (linked_) {
    shm_unlink(name_.c_str());
    linked_ = false;
  }
}

}  // namespace hfreduce
