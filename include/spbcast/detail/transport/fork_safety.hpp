// What a fork() does to the same-host path's process-wide state, kept right in one place.
//
// A child forked from a rank (a DataLoader worker, a checkpoint writer, multiprocessing) gets a
// copy of every mapping, descriptor and lock of its parent, and only the forking thread:
// - Descriptors: a child that kept the pool's memfds or the same-host sockets would pin freed
//   segments and hide its parent's death from the peers (a socket closes only with its last
//   copy). So every descriptor spbcast owns is an owned_fd, listed here, and a forked child
//   closes them all at once while it starts; its copies of the objects that own them then
//   forget them without closing (the numbers may name the child's own files by then).
// - Mappings: a child still maps every batch its parent held when it forked. A MAP_PRIVATE or
//   MAP_SHARED mapping shows the file's current contents for every page the child has not
//   written, so such a segment must never be refilled. fork_generation() counts the forks of
//   this process; a mapping that outlives a fork reports its segment as forked, and the root
//   forgets the segment instead of refilling it (shm_pool.hpp).
// - Locks: another thread may hold a lock at the moment of the fork, and it never releases it
//   in the child. Every lock that a child may take is held across fork() by the prepare
//   handler (hold_across_fork), and everything else checks the process id before locking.
#pragma once

#include <pthread.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <set>
#include <utility>

namespace spbcast::detail {

class fork_safety {
public:
    static fork_safety& instance() {
        static auto* f = new fork_safety();  // never destroyed: deleters may run after main
        return *f;
    }

    // Forks of this process since it started (counted in the parent).
    std::uint64_t generation() const { return generation_.load(std::memory_order_acquire); }

    void adopt(int fd) {
        std::lock_guard<std::mutex> lock(fds_mutex_);
        fds_.insert(fd);
    }
    void forget(int fd) {
        std::lock_guard<std::mutex> lock(fds_mutex_);
        fds_.erase(fd);
    }

    // The process-wide locks a forked child may take, in the order the prepare handler takes
    // them: the order in which they may nest (the registry's holder can end a path, which
    // forgets segments in the pool; the pool creates descriptors).
    enum class lock_order { same_host_registry, shared_allocations, segment_pool, count };

    // Held across every fork, so the child's copy is free.
    void hold_across_fork(lock_order which, std::mutex& m) { held_[static_cast<int>(which)] = &m; }

private:
    using lock_list = std::atomic<std::mutex*>[static_cast<int>(lock_order::count)];

    fork_safety() { ::pthread_atfork(&prepare, &in_parent, &in_child); }

    static void prepare() {
        auto& f = instance();
        for (auto& m : f.held_)
            if (std::mutex* p = m.load()) p->lock();
        f.fds_mutex_.lock();
    }
    static void unlock_all(fork_safety& f) {
        f.fds_mutex_.unlock();
        for (int i = static_cast<int>(lock_order::count) - 1; i >= 0; --i)
            if (std::mutex* p = f.held_[i].load()) p->unlock();
    }
    static void in_parent() {
        auto& f = instance();
        f.generation_.fetch_add(1, std::memory_order_acq_rel);
        unlock_all(f);
    }
    static void in_child() {
        auto& f = instance();
        for (int fd : f.fds_) ::close(fd);
        f.fds_.clear();
        unlock_all(f);
    }

    std::atomic<std::uint64_t> generation_{0};
    std::mutex fds_mutex_;
    std::set<int> fds_;
    lock_list held_ = {};
};

inline std::uint64_t fork_generation() { return fork_safety::instance().generation(); }

// An owned file descriptor that no forked child inherits open (see above): closed by its owner
// process only.
class owned_fd {
public:
    owned_fd() = default;
    explicit owned_fd(int fd) : fd_(fd), owner_(::getpid()) {
        if (fd_ >= 0) fork_safety::instance().adopt(fd_);
    }
    owned_fd(owned_fd&& o) noexcept : fd_(std::exchange(o.fd_, -1)), owner_(o.owner_) {}
    owned_fd& operator=(owned_fd&& o) noexcept {
        if (this != &o) {
            reset();
            fd_ = std::exchange(o.fd_, -1);
            owner_ = o.owner_;
        }
        return *this;
    }
    owned_fd(const owned_fd&) = delete;
    owned_fd& operator=(const owned_fd&) = delete;
    ~owned_fd() { reset(); }

    void reset(int fd = -1) {
        if (fd_ >= 0 && ::getpid() == owner_) {
            fork_safety::instance().forget(fd_);
            ::close(fd_);
        }
        fd_ = fd;
        owner_ = ::getpid();
        if (fd_ >= 0) fork_safety::instance().adopt(fd_);
    }
    // -1 in a forked child: its copy was closed when it started.
    int get() const { return fd_ >= 0 && ::getpid() == owner_ ? fd_ : -1; }
    explicit operator bool() const { return get() >= 0; }

private:
    int fd_ = -1;
    pid_t owner_ = 0;
};

}  // namespace spbcast::detail
