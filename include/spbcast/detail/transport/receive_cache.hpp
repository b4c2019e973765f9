// The receive cache behind ../receive_cache.hpp: the memory a follower receives tensor bytes
// into.
//
// A follower writes every byte of a new batch once, into memory it has just allocated. With
// fresh 4 KiB pages each page costs a fault plus the kernel zeroing it, and on loopback that
// costs about as much as moving the bytes (bench/README.md measures it). So storages of 2 MiB and more come from a process-wide cache of blocks that
// dropped batches gave back - already mapped - and new blocks ask for transparent huge pages.
// Small storages share their coalesced bucket instead of being copied out of it.
//
// The cache's budget follows the batch size: it keeps up to max(limit, batches x the largest
// batch received so far) - by default max(2 GiB, 2 batches) - so a batch of several GiB (single
// storages over 2^31 bytes) is received into recycled memory from the second one on. A batch
// is what arrives between two begin_batch calls.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#define SPBCAST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define SPBCAST_ASAN 1
#endif
#endif
#if defined(SPBCAST_ASAN)
#include <sanitizer/asan_interface.h>
#endif

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>

namespace spbcast::detail {

// Under AddressSanitizer a cached block is poisoned while the cache holds it and beyond the
// bytes in use, so reads past a storage or after its batch was dropped are still reported.
inline void mark_addressable(void* data, std::size_t used, std::size_t capacity) {
#if defined(SPBCAST_ASAN)
    ASAN_UNPOISON_MEMORY_REGION(data, used);
    ASAN_POISON_MEMORY_REGION(static_cast<char*>(data) + used, capacity - used);
#else
    (void)data;
    (void)used;
    (void)capacity;
#endif
}

// Asks the kernel to back the whole 2 MiB pages of [data, data + bytes) with transparent huge
// pages before anything touches them. A hint only: with THP off, or elsewhere, nothing changes.
inline void advise_huge_pages(void* data, std::size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    constexpr std::uintptr_t huge = std::uintptr_t{2} << 20;
    const auto start = reinterpret_cast<std::uintptr_t>(data);
    const std::uintptr_t first = (start + huge - 1) & ~(huge - 1);
    const std::uintptr_t last = (start + bytes) & ~(huge - 1);
    if (last > first) ::madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
#else
    (void)data;
    (void)bytes;
#endif
}

// A uint8 tensor on a storage of `nbytes` whose memory is `data`, freed by `release(context)`.
// The storage stays resizable: c10 moves it to CPU-allocator memory and releases this one.
inline at::Tensor byte_tensor_on(void* data, std::size_t nbytes, void* context,
                                 c10::DeleterFnPtr release) {
    c10::DataPtr ptr(data, context, release, c10::Device(c10::kCPU));
    c10::Storage storage(c10::Storage::use_byte_size_t(), nbytes, std::move(ptr),
                         c10::GetCPUAllocator(), /*resizable=*/true);
    return at::empty({0}, at::kByte).set_(storage, 0, {static_cast<std::int64_t>(nbytes)}, {1});
}

// Thread-safe: the last reference to a storage may die on any thread (Gloo's among them).
class receive_cache {
public:
    static constexpr std::size_t min_cached_bytes = std::size_t{2} << 20;  // smaller: at::empty
    static constexpr std::size_t block_rounding = std::size_t{64} << 10;
    static constexpr std::size_t default_limit = std::size_t{2} << 30;
    // The budget covers at least this many of the largest batch by default (set_limits).
    static constexpr std::size_t default_batches = 2;
    // A cached block that the next batch did not reuse is freed when the one after starts:
    // a training loop drops batch t after receiving t + 1, and t + 2 reuses its blocks, so
    // the cache holds about one batch beyond the one in use - never blocks of sizes that
    // stopped coming (variable-length batches).
    static constexpr std::uint64_t max_idle_batches = 1;

    static receive_cache& instance() {
        static auto* memory = new receive_cache();  // never destroyed: storages may outlive main
        return *memory;
    }

    // A follower starts receiving a batch: frees the blocks that stayed idle too long.
    void begin_batch() {
        std::lock_guard<std::mutex> lock(mutex_);
        ++clock_;
        batch_bytes_ = 0;
        evict_locked([&](const cached_block& c) { return clock_ - c.returned_at > max_idle_batches; });
    }

    // Memory for `bytes` received bytes, as a uint8 tensor on a storage of its own.
    at::Tensor allocate(std::size_t bytes) {
        if (bytes < min_cached_bytes) return at::empty({static_cast<std::int64_t>(bytes)}, at::kByte);
        const std::size_t need = (bytes + block_rounding - 1) / block_rounding * block_rounding;
        c10::DataPtr memory;
        std::size_t capacity = need;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            batch_bytes_ += need;
            largest_batch_ = std::max(largest_batch_, batch_bytes_);
            // The smallest cached block that fits and wastes at most 1/8 of what is needed: packs
            // of media vary in size from batch to batch, and a follower's batch must not take
            // much more memory than its bytes.
            auto it = free_.lower_bound(need);
            if (it != free_.end() && it->first - need <= need / 8) {
                capacity = it->first;
                memory = std::move(it->second.memory);
                cached_ -= capacity;
                free_.erase(it);
                ++reused_;
            } else {
                ++allocated_;
            }
        }
        // From the CPU allocator, so memory accounting that hooks it (c10::SetCPUAllocator)
        // sees the cache too.
        if (!memory) {
            memory = c10::GetCPUAllocator()->allocate(need);
            advise_huge_pages(memory.get(), need);
        }
        void* data = memory.get();
        mark_addressable(data, bytes, capacity);
        return byte_tensor_on(data, bytes, new block{std::move(memory), capacity},
                              &receive_cache::release);
    }

    // Keeps up to max(bytes, batches x the largest batch received so far); batches = 0: `bytes`
    // is the budget, fixed.
    void set_limits(std::size_t bytes, std::size_t batches) {
        std::lock_guard<std::mutex> lock(mutex_);
        limit_ = bytes;
        batches_ = batches;
        // Largest first: they free the most with the fewest calls.
        while (cached_ > budget_locked()) free_locked(std::prev(free_.end()));
    }
    void set_limit(std::size_t bytes) { set_limits(bytes, 0); }

    struct stats {
        std::size_t limit_bytes, cached_bytes, blocks_reused, blocks_allocated, largest_batch_bytes;
        std::size_t base_limit_bytes, batches;  // as set: the budget is max(base, batches x largest)
    };
    stats statistics() {
        std::lock_guard<std::mutex> lock(mutex_);
        return {budget_locked(), cached_, reused_, allocated_, largest_batch_, limit_, batches_};
    }

private:
    struct block {
        c10::DataPtr memory;
        std::size_t capacity;
    };

    static void release(void* context) {
        auto* b = static_cast<block*>(context);
        instance().give_back(*b);
        delete b;  // frees the memory unless the cache took it
    }

    // What the cache may keep now: the limit, or `batches_` times the largest batch so far.
    std::size_t budget_locked() const {
        const std::size_t most = std::numeric_limits<std::size_t>::max();
        const std::size_t following =
            batches_ != 0 && largest_batch_ > most / batches_ ? most : batches_ * largest_batch_;
        return std::max(limit_, following);
    }

    void give_back(block& b) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (cached_ + b.capacity <= budget_locked()) {
            mark_addressable(b.memory.get(), 0, b.capacity);
            cached_ += b.capacity;
            free_.emplace(b.capacity, cached_block{std::move(b.memory), clock_});
        } else {
            mark_addressable(b.memory.get(), b.capacity, b.capacity);
        }
    }

    struct cached_block {
        c10::DataPtr memory;
        std::uint64_t returned_at;  // clock_ when it came back
    };
    using cache_map = std::multimap<std::size_t, cached_block>;  // by capacity

    template <class Predicate>
    void evict_locked(Predicate evict) {
        for (auto it = free_.begin(); it != free_.end();) {
            if (evict(it->second))
                it = free_locked(it);
            else
                ++it;
        }
    }

    cache_map::iterator free_locked(cache_map::iterator it) {
        cached_ -= it->first;
        mark_addressable(it->second.memory.get(), it->first, it->first);
        return free_.erase(it);
    }

    std::mutex mutex_;
    cache_map free_;
    std::uint64_t clock_ = 0;                        // batches received so far
    std::size_t cached_ = 0;
    std::size_t limit_ = default_limit;
    std::size_t batches_ = default_batches;
    std::size_t batch_bytes_ = 0;                    // cached-size blocks of the batch arriving now
    std::size_t largest_batch_ = 0;                  // the most of them one batch took, so far
    std::size_t reused_ = 0;
    std::size_t allocated_ = 0;
};

// A uint8 tensor on a storage of its own that lies inside `bucket` at `offset`: a storage that
// arrived in a coalesced bucket stays where it arrived, with no second copy on the follower.
// Its storage holds a reference to the bucket, so a kept tensor keeps its bucket alive.
inline at::Tensor storage_within(const at::Tensor& bucket, std::uint64_t offset, std::uint64_t nbytes) {
    auto* keep = new c10::Storage(bucket.storage());
    return byte_tensor_on(static_cast<std::uint8_t*>(bucket.data_ptr()) + offset,
                          static_cast<std::size_t>(nbytes), keep,
                          [](void* k) { delete static_cast<c10::Storage*>(k); });
}

}  // namespace spbcast::detail
