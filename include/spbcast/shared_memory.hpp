// The same-host path's shared memory: statistics of the root's segment pool, its bound, and
// releasing it on request (README: "The same-host path").
#pragma once

#include "detail/shm_channel.hpp"
#include "detail/shm_pool.hpp"

#include <cstddef>

namespace spbcast {

struct shared_memory_stats {
    std::size_t limit_bytes;        // bound on free segments kept for reuse
    std::size_t cached_bytes;       // free segments kept for reuse
    std::size_t held_bytes;         // segments a follower still maps (a batch it keeps)
    std::size_t segments_reused;    // batches filled into a recycled segment
    std::size_t segments_created;   // batches that needed a new segment
    std::size_t network_fallbacks;  // batches sent over the network because no segment could be had
};

// This process's pool, as a root. Followers hold no pool: their batches map the root's segments.
inline shared_memory_stats shared_memory_statistics() {
    const auto s = detail::shm_pool::instance().statistics();
    return {s.limit_bytes, s.cached_bytes, s.held_bytes, s.segments_reused, s.segments_created,
            s.network_fallbacks};
}

// Bounds the free segments a root keeps for reuse (default 2 GiB); 0 keeps none, so every
// batch fills fresh pages.
inline void set_shared_memory_limit(std::size_t bytes) { detail::shm_pool::instance().set_limit(bytes); }

// Frees every free segment now. Segments a follower still maps are freed by the kernel when
// that follower drops its last tensor over them.
inline void release_shared_memory() { detail::shm_pool::instance().release_free(); }

// Closes every same-host connection of this process and frees the free segments; the next
// broadcast on a group runs the handshake again. Every rank of a group must call it at the same
// point (between broadcasts), like a collective.
inline void close_same_host_channels() { detail::same_host_registry::instance().drop_all(); }

}  // namespace spbcast
