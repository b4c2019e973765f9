// Shared-memory segments of the same-host path: anonymous memfds sealed against shrinking and
// growing, mapped shared on the root (which fills them) and private on followers.
//
// Why these choices:
// - memfd_create has no name in any file system, so a SIGKILL anywhere leaks nothing: the
//   kernel frees the pages when the last descriptor and mapping go. It does not use /dev/shm,
//   so a container's small /dev/shm does not limit it.
// - F_SEAL_SHRINK|F_SEAL_GROW fix the size for every holder, so a mapping that was checked
//   against fstat can never reach past the end of the file and SIGBUS. F_SEAL_SEAL stops
//   anyone from changing the seals afterwards. Followers check both before mapping.
// - The root reserves the pages with fallocate when it creates a segment: out of memory is
//   then an error the root can answer by using the network path, never a SIGBUS on its first
//   write. A memory cgroup does not fail that fallocate but kills the process at its limit, so
//   the root first checks the headroom of its memory cgroups and takes the network path for a
//   segment that would not fit.
// - Followers map MAP_PRIVATE: reads share the root's pages, a write copies only the page
//   written and stays private to that rank. Never MAP_POPULATE (on a private writable mapping
//   it would copy every page). Nor MADV_POPULATE_READ: a read fault on a file page maps the
//   resident pages around it as well (fault-around), so the first touch of a batch costs no
//   more than populating it up front would, and it is paid by each follower as it reads,
//   instead of by the broadcast on every follower at once.
// - The root's own filling mapping is MADV_DONTFORK: no tensor lives in it, and a forked child
//   that kept it would see (and could write) every later batch filled into the segment.
#pragma once

#include "../../error.hpp"
#include "fork_safety.hpp"

#include <fcntl.h>
#include <linux/falloc.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <optional>
#include <string>
#include <utility>

#ifndef MFD_CLOEXEC
#define MFD_CLOEXEC 0x0001U
#endif
#ifndef MFD_ALLOW_SEALING
#define MFD_ALLOW_SEALING 0x0002U
#endif

namespace spbcast::detail {

inline constexpr int required_seals = F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL;
inline constexpr std::size_t segment_page = 4096;

inline std::string errno_text(int err) { return std::string(std::strerror(err)); }

inline int memfd_create_compat(const char* name, unsigned flags) {
#if defined(SYS_memfd_create)
    return static_cast<int>(::syscall(SYS_memfd_create, name, flags));
#else
    errno = ENOSYS;
    return -1;
#endif
}

// Bytes this process may still charge to its memory cgroups before the tightest limit among
// them and their ancestors (cgroup v1 or v2); nullopt when no limit applies or none is readable.
inline std::optional<std::uint64_t> memory_cgroup_headroom() {
    auto read_number = [](const std::string& path) -> std::optional<std::uint64_t> {
        std::ifstream in(path);
        std::string text;
        if (!(in >> text) || text == "max") return std::nullopt;
        try {
            return std::stoull(text);
        } catch (...) {
            return std::nullopt;
        }
    };
    std::optional<std::uint64_t> headroom;
    // From the process's own cgroup up to the hierarchy's root: a parent's limit binds too.
    auto walk = [&](const std::string& root, std::string path, const char* limit_file, const char* usage_file) {
        for (;;) {
            const std::string dir = root + path;
            const auto limit = read_number(dir + "/" + limit_file), usage = read_number(dir + "/" + usage_file);
            if (limit && usage) headroom = std::min(headroom.value_or(UINT64_MAX), *limit > *usage ? *limit - *usage : 0);
            if (path.empty() || path == "/") return;
            path.resize(path.find_last_of('/'));
        }
    };
    std::ifstream cgroups("/proc/self/cgroup");
    for (std::string line; std::getline(cgroups, line);) {
        const auto first = line.find(':'), second = line.find(':', first + 1);
        if (first == std::string::npos || second == std::string::npos) continue;
        const std::string controllers = line.substr(first + 1, second - first - 1), path = line.substr(second + 1);
        if (controllers == "memory" || controllers.find("memory,") != std::string::npos ||
            controllers.find(",memory") != std::string::npos)
            walk("/sys/fs/cgroup/memory", path, "memory.limit_in_bytes", "memory.usage_in_bytes");
        else if (controllers.empty() && line.rfind("0:", 0) == 0)
            walk("/sys/fs/cgroup", path, "memory.max", "memory.current");
    }
    return headroom;
}

// What a new segment must leave free in the memory cgroup: the rest of the process (its
// allocator, Gloo's buffers) keeps allocating while the segment lives.
inline constexpr std::uint64_t cgroup_reserve = std::uint64_t{32} << 20;

// A root-side segment: a sealed memfd of `capacity` bytes, mapped shared for filling.
class shm_segment {
public:
    shm_segment() = default;
    shm_segment(const shm_segment&) = delete;
    shm_segment& operator=(const shm_segment&) = delete;
    shm_segment(shm_segment&& o) noexcept
        : fd_(std::move(o.fd_)), data_(std::exchange(o.data_, nullptr)),
          capacity_(std::exchange(o.capacity_, 0)), owner_(o.owner_) {}
    shm_segment& operator=(shm_segment&& o) noexcept {
        if (this != &o) {
            unmap();
            fd_ = std::move(o.fd_);
            data_ = std::exchange(o.data_, nullptr);
            capacity_ = std::exchange(o.capacity_, 0);
            owner_ = o.owner_;
        }
        return *this;
    }
    ~shm_segment() { unmap(); }

    // Creates and seals a segment; on any failure (no memfd, no sealing, out of memory) the
    // reason, so the caller can use the network path instead.
    static shm_segment create(std::size_t capacity, std::string& why_not) {
        shm_segment s;
        capacity = (capacity + segment_page - 1) / segment_page * segment_page;
        if (const auto headroom = memory_cgroup_headroom(); headroom && capacity + cgroup_reserve > *headroom) {
            why_not = "the memory cgroup has " + std::to_string(*headroom) + " bytes left, a segment of " +
                      std::to_string(capacity) + " would not fit";
            return s;
        }
        owned_fd fd(memfd_create_compat("spbcast", MFD_CLOEXEC | MFD_ALLOW_SEALING));
        if (!fd) {
            why_not = "memfd_create failed: " + errno_text(errno);
            return s;
        }
        if (::ftruncate(fd.get(), static_cast<off_t>(capacity)) != 0) {
            why_not = "ftruncate failed: " + errno_text(errno);
            return s;
        }
        // Reserve every page now: running out of memory is an error here, not a SIGBUS later.
        if (capacity != 0) {
            if (int err = ::posix_fallocate(fd.get(), 0, static_cast<off_t>(capacity)); err != 0) {
                why_not = "cannot reserve " + std::to_string(capacity) + " bytes of shared memory: " +
                          errno_text(err);
                return s;
            }
        }
        if (::fcntl(fd.get(), F_ADD_SEALS, required_seals) != 0) {
            why_not = "sealing the memfd failed: " + errno_text(errno);
            return s;
        }
        void* data = nullptr;
        if (capacity != 0) {
            data = ::mmap(nullptr, capacity, PROT_READ | PROT_WRITE, MAP_SHARED, fd.get(), 0);
            if (data == MAP_FAILED) {
                why_not = "mmap failed: " + errno_text(errno);
                return s;
            }
            ::madvise(data, capacity, MADV_DONTFORK);
        }
        s.fd_ = std::move(fd);
        s.data_ = data;
        s.capacity_ = capacity;
        return s;
    }

    explicit operator bool() const { return static_cast<bool>(fd_); }
    int fd() const { return fd_.get(); }
    // After a failed transfer the backend may still write into (or read from) the mapping: it
    // stays mapped until the process exits (as detail::quarantine keeps buffers), and only the
    // descriptor closes with this object.
    void keep_mapped_until_exit() { data_ = nullptr; }
    std::uint8_t* data() const { return static_cast<std::uint8_t*>(data_); }
    std::size_t capacity() const { return capacity_; }

private:
    // A forked child never had this mapping (MADV_DONTFORK): the address may be its own by now.
    void unmap() {
        if (data_ && ::getpid() == owner_) ::munmap(data_, capacity_);
        data_ = nullptr;
    }

    owned_fd fd_;
    void* data_ = nullptr;
    std::size_t capacity_ = 0;
    pid_t owner_ = ::getpid();
};

// Checks a segment descriptor a follower received: sealed against shrinking and growing, and
// exactly `capacity` bytes. Returns what is wrong, or an empty string.
inline std::string check_received_segment(int fd, std::uint64_t capacity) {
    const int seals = ::fcntl(fd, F_GET_SEALS);
    if (seals < 0) return "the descriptor is not a sealable memfd (" + errno_text(errno) + ")";
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW))
        return "the segment is not sealed against shrinking and growing";
    struct stat st {};
    if (::fstat(fd, &st) != 0) return "fstat failed: " + errno_text(errno);
    if (static_cast<std::uint64_t>(st.st_size) != capacity)
        return "the segment holds " + std::to_string(st.st_size) + " bytes, the frame announced " +
               std::to_string(capacity);
    return {};
}

// A follower's private mapping of the first `bytes` of a checked segment; nullptr and errno
// on failure. The pages stay shared with the root until this rank writes to one.
inline void* map_private(int fd, std::size_t bytes) {
    if (bytes == 0) return nullptr;
    void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
    return data == MAP_FAILED ? nullptr : data;
}

}  // namespace spbcast::detail
