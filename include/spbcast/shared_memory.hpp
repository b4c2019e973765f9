// The same-host path's shared memory: a scope in which the leader's tensors are allocated in
// shared memory in the first place, statistics of the root's segment pool, its bound, and
// releasing it on request (docs/transports.md, "The same-host path").
#pragma once

#include "detail/transport/shm_allocator.hpp"
#include "detail/transport/same_host_registry.hpp"
#include "detail/transport/shm_pool.hpp"

#include <algorithm>
#include <cstddef>
#include <memory>

namespace spbcast {

struct shared_memory_stats {
    std::size_t limit_bytes;        // bound on free segment bytes kept for reuse, as it stands now
    std::size_t cached_bytes;       // free segments kept for reuse
    std::size_t held_bytes;         // segments a follower still maps (a batch it keeps), or a tensor of this process lives in
    std::size_t segments_reused;    // batches filled into a recycled segment
    std::size_t segments_created;   // batches that needed a new segment
    std::size_t network_fallbacks;  // batches sent over the network because no segment could be had
    std::size_t tensors_allocated;  // tensors allocated in shared memory by a shared_memory_scope
    std::size_t tensors_shared;     // of those, broadcast without a copy (their segment handed over)
    std::size_t segments;           // segments the pool tracks now: one descriptor and one mapping each
    std::size_t segments_forgotten; // left to the processes that map them (a fork, a bound, a lost link)
    std::size_t largest_batch_bytes; // the most segment bytes one batch lay in so far (what the bound follows)
};

// The bounds of this process's segment pool (a root's): free bytes and free segments kept for
// reuse, and every segment it tracks at all - each one costs the root a descriptor, so this
// bound keeps the root well under the common soft limit of 1024 descriptors. Past it, the
// oldest segments that only followers still map are forgotten (the followers keep them; the
// kernel frees them with their last mapping), and a new tensor allocation inside a scope that
// finds every tracked segment held by the root's own tensors gets ordinary memory.
//
// The free-bytes bound follows the batch size: free segments are kept up to
// max(free_bytes, free_batches x the largest batch placed so far) - the segment bytes one
// batch lay in, its copy and the segments of its tensors born in a shared_memory_scope. The
// pool starts at default_shared_memory_limits: 2 GiB or 2 batches, whichever is more, so a
// batch of any size (several GiB) is placed in recycled pages from the second one on, and the
// free segments it keeps are about one batch (a free segment the next two batches do not reuse
// is freed). Limits you fill in have free_batches = 0: the free_bytes you set is the bound.
using shared_memory_limits = detail::shm_pool_limits;
inline constexpr shared_memory_limits default_shared_memory_limits = detail::shm_pool::default_limits;

// While it lives, CPU tensors of at least `min_bytes` (64 KiB at least) that this thread
// allocates - through ATen, so a collator's torch::cat, stack, empty or clone - live in
// shared-memory segments of this process's pool. A broadcast of such a tensor over the
// same-host path hands its segment to the followers instead of copying it: the group then
// holds one copy of the batch. Open it around the code that builds the batch on the root (the
// collate function, or each loader worker thread); anywhere else the tensors are ordinary
// memory. The first scope puts spbcast's allocator in front of the CPU allocator in use then
// (c10::SetCPUAllocator, at that allocator's priority), which keeps serving every allocation
// outside a scope; a CPU allocator installed later must call the one it replaces for the scope
// to keep working. Scopes nest; each restores the previous one's setting.
class shared_memory_scope {
public:
    explicit shared_memory_scope(std::size_t min_bytes = std::size_t{1} << 20)
        : token_(std::make_shared<detail::scope_token>()) {
        detail::install_shared_memory_allocator();
        token_->min_bytes = std::max(min_bytes, detail::shm_pool::rounding);
        detail::shared_scope_min_bytes();  // drops this thread's closed scopes first
        detail::open_scopes.push_back(token_);
    }
    // May run on another thread than the one that opened it: the opener's thread then stops
    // allocating in shared memory at its next allocation.
    ~shared_memory_scope() { token_->open.store(false, std::memory_order_release); }
    shared_memory_scope(const shared_memory_scope&) = delete;
    shared_memory_scope& operator=(const shared_memory_scope&) = delete;

private:
    std::shared_ptr<detail::scope_token> token_;
};

// This process's pool, as a root. Followers hold no pool: their batches map the root's segments.
inline shared_memory_stats shared_memory_statistics() {
    const auto s = detail::shm_pool::instance().statistics();
    return {s.limit_bytes, s.cached_bytes, s.held_bytes, s.segments_reused, s.segments_created,
            s.network_fallbacks, s.tensors_allocated, s.tensors_shared, s.segments, s.segments_forgotten,
            s.largest_batch_bytes};
}

// Sets the pool's bounds, as given (defaults: default_shared_memory_limits - free segments up to
// 2 GiB or twice the largest batch, whichever is more, and at most 16 of them; 256 segments
// tracked in all). To keep the bound following the batch size, set free_batches (e.g. start
// from shared_memory_limits_in_use() or default_shared_memory_limits); free_batches = 0 makes
// free_bytes a fixed bound.
inline void set_shared_memory_limits(const shared_memory_limits& limits) {
    detail::shm_pool::instance().set_limits(limits);
}
inline shared_memory_limits shared_memory_limits_in_use() { return detail::shm_pool::instance().limits(); }

// Bounds the free segment bytes a root keeps for reuse to `bytes`, fixed: the bound no longer
// follows the batch size (free_batches = 0), so a batch larger than `bytes` fills fresh pages
// every time. 0 keeps none: every batch fills fresh pages. The default follows the batch size
// (default_shared_memory_limits).
inline void set_shared_memory_limit(std::size_t bytes) {
    auto limits = shared_memory_limits_in_use();
    limits.free_bytes = bytes;
    limits.free_batches = 0;
    set_shared_memory_limits(limits);
}

// Frees every free segment now. Segments a follower still maps are freed by the kernel when
// that follower drops its last tensor over them.
inline void release_shared_memory() { detail::shm_pool::instance().release_free(); }

// Closes every same-host connection of this process and frees the free segments; the next
// broadcast on a group runs the handshake again. Every rank of a group must call it at the same
// point (between broadcasts), like a collective.
inline void close_same_host_channels() { detail::same_host_registry::instance().drop_all(); }

}  // namespace spbcast
