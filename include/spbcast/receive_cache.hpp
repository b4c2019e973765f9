// The receive cache: where followers put the bytes of large tensors.
//
// A follower receives every storage of 2 MiB and more into memory recycled from batches the
// application has dropped, because writing fresh pages costs a page fault and a kernel clear
// per 4 KiB - on loopback about as much as receiving the bytes. The cache holds what dropped
// batches gave back, per process: about one batch beyond the one in use (a block the next
// batch did not reuse is freed when the one after starts), never more than its limit (2 GiB
// by default). The peak memory of a training loop does not change (the previous batch is
// usually alive while the next one arrives), but between batches that much stays resident.
#pragma once

#include "detail/transport/receive_cache.hpp"

#include <cstddef>

namespace spbcast {

inline constexpr std::size_t default_receive_cache_limit = detail::receive_cache::default_limit;

struct receive_cache_stats {
    std::size_t limit_bytes;       // set_receive_cache_limit
    std::size_t cached_bytes;      // held now, ready for the next batch
    std::size_t blocks_reused;     // large storages received into cached memory, since start
    std::size_t blocks_allocated;  // large storages that needed new memory, since start
};

// Caps the memory kept between batches; 0 turns the cache off (every batch gets fresh memory)
// and frees what it holds. Thread-safe; takes effect at once.
inline void set_receive_cache_limit(std::size_t bytes) {
    detail::receive_cache::instance().set_limit(bytes);
}

inline receive_cache_stats receive_cache_statistics() {
    const auto s = detail::receive_cache::instance().statistics();
    return {s.limit_bytes, s.cached_bytes, s.blocks_reused, s.blocks_allocated};
}

}  // namespace spbcast
