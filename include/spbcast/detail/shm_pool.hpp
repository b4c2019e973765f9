// The root's pool of shared-memory segments: the ones it copies batches into, and the ones its
// loader allocates tensors in (shm_allocator.hpp).
//
// Filling fresh shared pages costs a fault and a kernel clear per page on top of the copy, so a
// segment that every follower has let go of is filled again for a later batch instead of being
// freed (copying into resident pages). A segment is "held" while any follower still maps it
// (it said so over its socket) or a tensor of the root's own lives in it; the root never writes
// into a segment a follower holds, because a follower's private mapping shows the root's
// writes to pages that follower has not written itself.
//
// Bounded like the receive cache: free segments that the next batches did not reuse are freed,
// free bytes never exceed the limit, and release() frees every free segment at once.
#pragma once

#include "shm_segment.hpp"

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <unistd.h>

namespace spbcast::detail {

struct shm_pool_stats {
    std::size_t limit_bytes = 0;      // bound on free (cached) segment bytes
    std::size_t cached_bytes = 0;     // free segments kept for reuse
    std::size_t held_bytes = 0;       // segments some follower still maps, or a root's tensor lives in
    std::size_t segments_reused = 0;  // batches filled into a recycled segment
    std::size_t segments_created = 0; // batches that needed a new segment
    std::size_t network_fallbacks = 0;  // batches sent over the network: no segment available
    std::size_t tensors_allocated = 0;  // tensors the root allocated in segments (shm_allocator.hpp)
    std::size_t tensors_shared = 0;     // of those, sent without a copy (their segment handed over)
};

class shm_pool {
public:
    static constexpr std::size_t default_limit = std::size_t{2} << 30;
    static constexpr std::size_t rounding = std::size_t{64} << 10;
    // A free segment the next two batches did not reuse is freed (sizes that stopped coming).
    static constexpr std::uint64_t max_idle_batches = 2;

    static shm_pool& instance() {
        static auto* pool = new shm_pool();  // never destroyed: deleters may run after main
        return *pool;
    }

    struct lease {
        std::uint64_t id = 0;
        int fd = -1;
        std::uint8_t* data = nullptr;
        std::size_t capacity = 0;
        explicit operator bool() const { return fd >= 0; }
    };

    // A batch begins: free segments that the last batches did not reuse are freed.
    void next_batch() {
        std::lock_guard<std::mutex> lock(mutex_);
        ++clock_;
        for (auto it = segments_.begin(); it != segments_.end();) {
            entry& e = it->second;
            if (e.holders == 0 && clock_ - e.returned_at > max_idle_batches) {
                cached_ -= e.segment.capacity();
                it = segments_.erase(it);
            } else {
                ++it;
            }
        }
    }

    // A free segment of at least `bytes` (reused when one fits without wasting more than a
    // quarter or 2 MiB: followers map only the bytes in use, so the slack costs nobody new
    // memory), or a new one; marked held by `holders`. On failure an empty lease and the
    // reason.
    lease acquire(std::size_t bytes, int holders, std::string& why_not) {
        const std::size_t need = std::max<std::size_t>((bytes + rounding - 1) / rounding * rounding, rounding);
        std::lock_guard<std::mutex> lock(mutex_);
        // A forked child (a loader worker) holds a copy of this pool: a segment free here may be
        // filled by the parent at any time, so the child never uses one.
        if (::getpid() != owner_) {
            why_not = "this process was forked from the one that owns the segment pool";
            return {};
        }
        entry* best = nullptr;
        for (auto& [id, e] : segments_)
            if (e.holders == 0 && e.segment.capacity() >= need &&
                e.segment.capacity() - need <= std::max(need / 4, std::size_t{2} << 20) &&
                (!best || e.segment.capacity() < best->segment.capacity()))
                best = &e;
        if (best) {
            cached_ -= best->segment.capacity();
            best->holders = holders;
            ++reused_;
            return {best->id, best->segment.fd(), best->segment.data(), best->segment.capacity()};
        }
        shm_segment segment = shm_segment::create(need, why_not);
        if (!segment) return {};
        ++created_;
        const std::uint64_t id = ++next_id_;
        entry& e = segments_[id];
        e.id = id;
        e.segment = std::move(segment);
        e.holders = holders;
        return {id, e.segment.fd(), e.segment.data(), e.segment.capacity()};
    }

    // `count` more followers hold segment `id` (a root's tensor in it was handed over).
    void hold(std::uint64_t id, int count) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = segments_.find(id); it != segments_.end()) it->second.holders += count;
    }

    void count_tensor(bool shared) {
        std::lock_guard<std::mutex> lock(mutex_);
        ++(shared ? tensors_shared_ : tensors_allocated_);
    }

    void count_network_fallback() {
        std::lock_guard<std::mutex> lock(mutex_);
        ++fallbacks_;
    }

    // One holder let go of segment `id`: a follower unmapped it (or never mapped it), or the
    // root's tensor in it was freed.
    void release(std::uint64_t id) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = segments_.find(id);
        if (it == segments_.end() || it->second.holders <= 0) return;
        if (--it->second.holders != 0) return;
        it->second.returned_at = clock_;
        cached_ += it->second.segment.capacity();
        trim_locked(limit_);
    }

    // A segment whose holders can no longer report (their connection is gone) is never
    // written again: the pool forgets it, and the kernel frees it with the last mapping.
    void orphan(std::uint64_t id) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = segments_.find(id);
        if (it == segments_.end()) return;
        if (it->second.holders == 0) cached_ -= it->second.segment.capacity();
        segments_.erase(it);
    }

    void set_limit(std::size_t bytes) {
        std::lock_guard<std::mutex> lock(mutex_);
        limit_ = bytes;
        trim_locked(limit_);
    }

    // Frees every free segment now.
    void release_free() {
        std::lock_guard<std::mutex> lock(mutex_);
        trim_locked(0);
    }

    shm_pool_stats statistics() {
        std::lock_guard<std::mutex> lock(mutex_);
        shm_pool_stats s;
        s.limit_bytes = limit_;
        s.cached_bytes = cached_;
        for (auto& [id, e] : segments_)
            if (e.holders > 0) s.held_bytes += e.segment.capacity();
        s.segments_reused = reused_;
        s.segments_created = created_;
        s.network_fallbacks = fallbacks_;
        s.tensors_allocated = tensors_allocated_;
        s.tensors_shared = tensors_shared_;
        return s;
    }

private:
    struct entry {
        std::uint64_t id = 0;
        shm_segment segment;
        int holders = 0;
        std::uint64_t returned_at = 0;
    };

    void trim_locked(std::size_t bound) {
        // Largest first: frees the most with the fewest calls.
        while (cached_ > bound) {
            auto victim = segments_.end();
            for (auto it = segments_.begin(); it != segments_.end(); ++it)
                if (it->second.holders == 0 &&
                    (victim == segments_.end() || it->second.segment.capacity() > victim->second.segment.capacity()))
                    victim = it;
            if (victim == segments_.end()) break;
            cached_ -= victim->second.segment.capacity();
            segments_.erase(victim);
        }
    }

    std::mutex mutex_;
    const pid_t owner_ = ::getpid();
    std::map<std::uint64_t, entry> segments_;
    std::uint64_t next_id_ = 0;
    std::uint64_t clock_ = 0;
    std::size_t cached_ = 0;
    std::size_t limit_ = default_limit;
    std::size_t reused_ = 0, created_ = 0, fallbacks_ = 0, tensors_allocated_ = 0, tensors_shared_ = 0;
};

}  // namespace spbcast::detail
