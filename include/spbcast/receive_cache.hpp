// The receive cache: where followers put the bytes of large tensors.
//
// A follower receives every storage of 2 MiB and more into memory recycled from batches the
// application has dropped, because writing fresh pages costs a page fault and a kernel clear
// per 4 KiB - on loopback about as much as receiving the bytes. The cache holds what dropped
// batches gave back, per process: about one batch beyond the one in use (a block the next
// batch did not reuse is freed when the one after starts), never more than its budget. The
// budget follows the batch size: max(2 GiB, 2 x the largest batch received so far) by default,
// so batches of several GiB are received into recycled memory from the second one on. The peak
// memory of a training loop does not change (the previous batch is usually alive while the next
// one arrives), but between batches about one batch stays resident.
#pragma once

#include "detail/transport/receive_cache.hpp"

#include <cstddef>

namespace spbcast {

inline constexpr std::size_t default_receive_cache_limit = detail::receive_cache::default_limit;

// The cache keeps up to max(bytes, batches x the largest batch received so far): a batch is the
// large storages (2 MiB and more) of one broadcast. batches = 0 makes `bytes` a fixed budget.
struct receive_cache_limits {
    std::size_t bytes = default_receive_cache_limit;
    std::size_t batches = 0;
};
// What the cache starts with: 2 GiB, or twice the largest batch, whichever is more.
inline constexpr receive_cache_limits default_receive_cache_limits{default_receive_cache_limit,
                                                                   detail::receive_cache::default_batches};

struct receive_cache_stats {
    std::size_t limit_bytes;       // the budget as it stands now: max(bytes, batches x largest batch)
    std::size_t cached_bytes;      // held now, ready for the next batch
    std::size_t blocks_reused;     // large storages received into cached memory, since start
    std::size_t blocks_allocated;  // large storages that needed new memory, since start
    std::size_t largest_batch_bytes;  // the most one batch received into cache-sized blocks, so far
};

// Caps the memory kept between batches at `bytes`, fixed: the budget no longer follows the
// batch size, so a batch larger than `bytes` gets fresh memory every time. 0 turns the cache off
// (every batch gets fresh memory) and frees what it holds. Thread-safe; takes effect at once.
inline void set_receive_cache_limit(std::size_t bytes) {
    detail::receive_cache::instance().set_limit(bytes);
}

// Sets the budget as given (default_receive_cache_limits to go back to the default); frees what
// it holds beyond it. Thread-safe; takes effect at once.
inline void set_receive_cache_limits(const receive_cache_limits& limits) {
    detail::receive_cache::instance().set_limits(limits.bytes, limits.batches);
}

inline receive_cache_limits receive_cache_limits_in_use() {
    const auto s = detail::receive_cache::instance().statistics();
    return {s.base_limit_bytes, s.batches};
}

inline receive_cache_stats receive_cache_statistics() {
    const auto s = detail::receive_cache::instance().statistics();
    return {s.limit_bytes, s.cached_bytes, s.blocks_reused, s.blocks_allocated, s.largest_batch_bytes};
}

}  // namespace spbcast
