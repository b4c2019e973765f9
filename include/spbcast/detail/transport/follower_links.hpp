// The link between a root (or a host leader) and each follower of its host, at both ends: the
// follower's follower_link, shared by every mapping that reports to it, and the mappings that
// report through it; the root's root_link per follower, with the segments that follower holds.
//
// Answers never block a deleter (follower_link): what a socket has no room for waits in a
// backlog; the root reads them at every broadcast (same_host_registry.hpp).
#pragma once

#include "descriptor_socket.hpp"
#include "fork_safety.hpp"
#include "shm_pool.hpp"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

namespace spbcast::detail {

// ---------------------------------------------------------------------------------------------
// Follower side: the connection to the root, shared by every mapping that reports to it.

class follower_link {
public:
    explicit follower_link(owned_fd sock) : sock_(std::move(sock)) {}

    int socket() const { return sock_.get(); }

    // Called from a storage deleter, on any thread, at any moment: it never waits. What the
    // socket has no room for now stays in a local backlog, sent with the next report or
    // broadcast. A forked child's copy of a batch reports nothing: it has no socket
    // (fork_safety.hpp), and the parent still maps the segment.
    void report(std::uint64_t segment, bool forked) {
        if (::getpid() != owner_) return;  // before the lock: another thread may have held it at the fork
        std::lock_guard<std::mutex> lock(mutex_);
        if (!sock_) return;  // a root that is gone needs no answer
        (forked ? forked_ : released_).push_back(segment);
        flush_locked();
    }

    // At every broadcast: what the backlog holds.
    void flush() {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        flush_locked();
    }

    // At the start of broadcast `sequence`: what the backlog holds, then a report with no ids
    // that names the broadcast - so the root, which may wait for it before it places the batch
    // (same_host_state::await_followers), knows every segment this rank let go of by then. It
    // never waits either: what has no room now goes with the next report or broadcast.
    void arrive(std::uint64_t sequence) {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        arrival_ = sequence;
        flush_locked();
    }

    // After a transport failure or when the same-host path ends: no more reports; the socket
    // closes now, not when the last storage of this group's batches goes.
    void close() {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        sock_.reset();
        released_.clear();
        forked_.clear();
        arrival_ = 0;
    }

private:
    void flush_locked() {
        for (auto* ids : {&forked_, &released_}) {
            while (!ids->empty()) {
                shm_message m;
                m.kind = ids == &forked_ ? shm_message_kind::forked : shm_message_kind::released;
                m.count = static_cast<std::uint32_t>(std::min(ids->size(), max_batch_segments));
                std::copy(ids->end() - m.count, ids->end(), m.ids);
                const auto status = send_message(sock_.get(), m, {}, std::chrono::milliseconds(-1));
                if (status == send_status::would_block) return;  // the root reads at its next broadcast
                if (status == send_status::failed) {  // the root is gone
                    forked_.clear();
                    released_.clear();
                    arrival_ = 0;
                    return;
                }
                ids->resize(ids->size() - m.count);
            }
        }
        if (arrival_ == 0) return;  // after every id: the root takes it as "all reported"
        shm_message m;
        m.kind = shm_message_kind::released;
        m.sequence = arrival_;
        if (send_message(sock_.get(), m, {}, std::chrono::milliseconds(-1)) != send_status::would_block) arrival_ = 0;
    }

    std::mutex mutex_;
    owned_fd sock_;
    std::vector<std::uint64_t> released_, forked_;
    std::uint64_t arrival_ = 0;  // a start of a broadcast not yet told (arrive)
    const pid_t owner_ = ::getpid();
};

// A follower's private mapping of one segment; unmapped, and reported to the root, when the
// last storage over it goes - as forked when a child forked since may still map it. A host
// leader's mapping of its own pool's segment (`local`) reports to that pool directly.
struct shm_mapping {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::uint64_t segment = 0;
    std::shared_ptr<follower_link> link;
    bool local = false;
    std::uint64_t forks_at_birth = fork_generation();  // read before the segment is mapped

    ~shm_mapping() {
        if (data) ::munmap(data, bytes);
        const bool forked = fork_generation() != forks_at_birth;
        if (link) link->report(segment, forked);
        if (local && forked) shm_pool::instance().forget(segment);
        if (local && !forked) shm_pool::instance().release_follower(segment);
    }
};

// ---------------------------------------------------------------------------------------------
// Root side: one connection per follower, and the segments each one holds.

struct root_link {
    int rank = -1;
    owned_fd sock;
    std::multiset<std::uint64_t> held;  // segments this follower maps (or has not yet answered)
    bool alive = true;
    std::uint64_t arrived = 0;  // the latest broadcast this follower said it started
};

}  // namespace spbcast::detail
