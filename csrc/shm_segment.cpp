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
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    auto err = sys_error("ftruncate", name);
    close(fd);
    shm_unlink(name.c_str());
    throw err;
  }
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
  if (create) {
    // Commit every page at creation (the Python side checked /dev/shm's free space first), not mid-collective.
    std::memset(data_, 0, bytes);
  }
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
