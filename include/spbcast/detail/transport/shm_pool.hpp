// The root's pool of shared-memory segments: the ones it copies batches into, and the ones its
// loader allocates tensors in (shm_allocator.hpp).
//
// Filling fresh shared pages costs a fault and a kernel clear per page on top of the copy, so a
// segment that nobody can map any more is filled again for a later batch instead of being
// freed (copying into resident pages). Who may still map a segment is its segment_holders: the
// recycling invariant (docs/transports.md, "The same-host path") lives there.
//
// Bounded three ways (shared_memory_limits): free bytes, free segments, and every segment the
// pool tracks - each costs a descriptor and a mapping on the root. The free-bytes bound follows
// the batch size by default: at least free_batches (2) times the largest batch placed so far, so
// a batch of any size is placed in recycled pages from the second one on. Past the last bound
// the pool forgets the oldest segments that only followers hold: it closes its descriptor and
// mapping, the followers keep their pages, and the kernel frees them when the last mapping goes.
#pragma once

#include "fork_safety.hpp"
#include "shm_segment.hpp"

#include <algorithm>
#include <cassert>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>

#include <unistd.h>

namespace spbcast::detail {

struct shm_pool_stats {
    std::size_t limit_bytes = 0;      // bound on free (cached) segment bytes, as it stands now
    std::size_t cached_bytes = 0;     // free segments kept for reuse
    std::size_t held_bytes = 0;       // segments some follower still maps, or a root's tensor lives in
    std::size_t segments_reused = 0;  // batches filled into a recycled segment
    std::size_t segments_created = 0; // batches that needed a new segment
    std::size_t network_fallbacks = 0;  // batches sent over the network: no segment available
    std::size_t tensors_allocated = 0;  // tensors the root allocated in segments (shm_allocator.hpp)
    std::size_t tensors_shared = 0;     // of those, sent without a copy (their segment handed over)
    std::size_t segments = 0;           // segments tracked now: one descriptor and one mapping each
    std::size_t segments_forgotten = 0; // left to their mappers (a fork, a bound, a lost link)
    std::size_t largest_batch_bytes = 0;  // the most segment bytes one batch lay in, so far
};

// The pool's bounds (spbcast::set_shared_memory_limits). Free segment bytes are kept up to
// max(free_bytes, free_batches x the largest batch placed so far): with free_batches = 0,
// free_bytes is the bound as given. Limits a caller fills in start at free_batches = 0 - the
// bytes they set are the bound; the pool itself starts at default_limits (2 GiB, following the
// batch size at 2 batches).
struct shm_pool_limits {
    std::size_t free_bytes = std::size_t{2} << 30;
    std::size_t free_segments = 16;
    std::size_t segments = 256;
    std::size_t free_batches = 0;
};

// Who may still map a segment. The recycling invariant: a segment is refilled only when
// may_refill() - no follower maps it or owes an answer for it, and no tensor of the root's own
// lives in it. A segment that a forked child may map is never refilled: it is forgotten
// (shm_pool::forget), so it has no holders entry at all.
struct segment_holders {
    int followers = 0;         // mappings not yet reported released, one per follower and batch
    bool root_tensor = false;  // a root tensor allocated in it (shm_allocator.hpp) is alive
    bool may_refill() const { return followers == 0 && !root_tensor; }
};

class shm_pool {
public:
    static constexpr std::size_t rounding = std::size_t{64} << 10;
    // A free segment the next two batches did not reuse is freed (sizes that stopped coming).
    static constexpr std::uint64_t max_idle_batches = 2;
    // The pool's bounds until set_limits: 2 GiB of free segments, or twice the largest batch.
    static constexpr shm_pool_limits default_limits{std::size_t{2} << 30, 16, 256, 2};

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
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        ++clock_;
        for (auto it = segments_.begin(); it != segments_.end();) {
            entry& e = it->second;
            if (e.holders.may_refill() && clock_ - e.returned_at > max_idle_batches) {
                cached_ -= e.segment.capacity();
                it = segments_.erase(it);
            } else {
                ++it;
            }
        }
    }

    // A segment of at least `bytes` for a batch that `followers` followers will map.
    lease acquire_for_batch(std::size_t bytes, int followers, std::string& why_not) {
        return acquire(bytes, {followers, false}, why_not);
    }
    // A segment for one tensor of the root's own.
    lease acquire_for_tensor(std::size_t bytes, std::string& why_not) {
        return acquire(bytes, {0, true}, why_not);
    }

    // `count` more followers map segment `id` (a root's tensor in it was handed over).
    void hold(std::uint64_t id, int count) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        if (auto it = segments_.find(id); it != segments_.end()) it->second.holders.followers += count;
    }

    void count_tensor(bool shared) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        ++(shared ? tensors_shared_ : tensors_allocated_);
    }

    void count_network_fallback() {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        ++fallbacks_;
    }

    // A batch lay in segments of `bytes` in all: the free-bytes bound follows the largest.
    void note_batch(std::size_t bytes) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        largest_batch_ = std::max(largest_batch_, bytes);
    }

    // Where a batch of `bytes` would go now: a free segment that fits, none free but one that
    // fits is held only by followers (it may come back as they let go of their batches), or
    // neither (a new segment).
    enum class fit { free, held, none };
    fit fit_for(std::size_t bytes) {
        if (!owner()) return fit::none;
        const std::size_t need = rounded(bytes);
        std::lock_guard<std::mutex> lock(mutex_);
        fit found = fit::none;
        for (auto& [id, e] : segments_) {
            if (!fits(e.segment.capacity(), need)) continue;
            if (e.holders.may_refill()) return fit::free;
            if (!e.holders.root_tensor) found = fit::held;
        }
        return found;
    }

    // A follower let go of segment `id` (it unmapped it, or never mapped it).
    // Without a same-host path left to serve (set_serving), a segment let go of is freed, not
    // kept for reuse: a host leader's own batches may outlive its failed group.
    void release_follower(std::uint64_t id) {
        update(
            id,
            [](segment_holders& h) {
                if (h.followers > 0) --h.followers;
            },
            true);
    }
    // Whether any (group, root) still takes the same-host path here (same_host_registry).
    void set_serving(bool serving) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        serving_ = serving;
    }
    // The root's tensor in segment `id` was freed.
    void release_tensor(std::uint64_t id) {
        update(id, [](segment_holders& h) { h.root_tensor = false; });
    }

    // Segment `id` may be mapped by a process that cannot report (a forked child, a follower
    // whose connection is gone): it is never written again. The pool closes its own descriptor
    // and mapping; the kernel frees the pages with the last mapping elsewhere.
    void forget(std::uint64_t id, bool keep_mapped = false) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = segments_.find(id);
        if (it == segments_.end()) return;
        if (it->second.holders.may_refill()) cached_ -= it->second.segment.capacity();
        if (keep_mapped) it->second.segment.keep_mapped_until_exit();
        segments_.erase(it);
        ++forgotten_;
    }

    // Segment `id` took part in a transfer that failed: it is forgotten, and its mapping is
    // never unmapped (shm_segment::keep_mapped_until_exit).
    void abandon(std::uint64_t id) { forget(id, true); }

    void set_limits(const shm_pool_limits& limits) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        limits_ = limits;
        trim_locked(free_bytes_bound_locked(), limits_.free_segments);
    }
    shm_pool_limits limits() {
        std::lock_guard<std::mutex> lock(mutex_);
        return limits_;
    }

    // Frees every free segment now.
    void release_free() {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        trim_locked(0, 0);
    }

    shm_pool_stats statistics() {
        std::lock_guard<std::mutex> lock(mutex_);
        shm_pool_stats s;
        s.limit_bytes = free_bytes_bound_locked();
        s.cached_bytes = cached_;
        for (auto& [id, e] : segments_)
            if (!e.holders.may_refill()) s.held_bytes += e.segment.capacity();
        s.segments_reused = reused_;
        s.segments_created = created_;
        s.network_fallbacks = fallbacks_;
        s.tensors_allocated = tensors_allocated_;
        s.tensors_shared = tensors_shared_;
        s.segments = segments_.size();
        s.segments_forgotten = forgotten_;
        s.largest_batch_bytes = largest_batch_;
        return s;
    }

private:
    struct entry {
        std::uint64_t id = 0;
        shm_segment segment;
        segment_holders holders;
        std::uint64_t returned_at = 0;
    };

    shm_pool() { fork_safety::instance().hold_across_fork(fork_safety::lock_order::segment_pool, mutex_); }

    // A forked child (a loader worker) holds a copy of this pool whose descriptors and
    // mappings it does not have (fork_safety.hpp): it never uses it. Checked before locking.
    bool owner() const { return ::getpid() == owner_; }

    static std::size_t rounded(std::size_t bytes) {
        return std::max<std::size_t>((bytes + rounding - 1) / rounding * rounding, rounding);
    }
    // A segment of `capacity` takes a batch of `need` (rounded) bytes when it wastes at most a
    // quarter or 2 MiB: followers map only the bytes in use, so the slack costs nobody new memory.
    static bool fits(std::size_t capacity, std::size_t need) {
        return capacity >= need && capacity - need <= std::max(need / 4, std::size_t{2} << 20);
    }

    // The bound on free segment bytes now: free_bytes, or free_batches x the largest batch.
    std::size_t free_bytes_bound_locked() const {
        const std::size_t most = std::numeric_limits<std::size_t>::max();
        const std::size_t following = limits_.free_batches != 0 && largest_batch_ > most / limits_.free_batches
                                          ? most
                                          : limits_.free_batches * largest_batch_;
        return std::max(limits_.free_bytes, following);
    }

    // A free segment of at least `bytes` (reused when one fits), or a new one, held by
    // `holders`. On failure an empty lease and the reason.
    lease acquire(std::size_t bytes, segment_holders holders, std::string& why_not) {
        if (!owner()) {
            why_not = "this process was forked from the one that owns the segment pool";
            return {};
        }
        const std::size_t need = rounded(bytes);
        std::lock_guard<std::mutex> lock(mutex_);
        entry* best = nullptr;
        for (auto& [id, e] : segments_)
            if (e.holders.may_refill() && fits(e.segment.capacity(), need) &&
                (!best || e.segment.capacity() < best->segment.capacity()))
                best = &e;
        if (best) {
            assert(best->holders.may_refill());  // the recycling invariant
            cached_ -= best->segment.capacity();
            best->holders = holders;
            ++reused_;
            return {best->id, best->segment.fd(), best->segment.data(), best->segment.capacity()};
        }
        if (!make_room_locked()) {
            why_not = "the pool tracks limits.segments = " + std::to_string(limits_.segments) +
                      " segments, each held by a tensor of this process";
            return {};
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

    // Applies `change` to segment `id`'s holders; a segment that may be refilled now is kept
    // for reuse - or freed when `free_unserved` and no same-host path is left (set_serving).
    template <class F>
    void update(std::uint64_t id, F change, bool free_unserved = false) {
        if (!owner()) return;
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = segments_.find(id);
        if (it == segments_.end() || it->second.holders.may_refill()) return;
        change(it->second.holders);
        if (!it->second.holders.may_refill()) return;
        if (free_unserved && !serving_) {
            segments_.erase(it);
            return;
        }
        it->second.returned_at = clock_;
        cached_ += it->second.segment.capacity();
        trim_locked(free_bytes_bound_locked(), limits_.free_segments);
    }

    // Room for one more tracked segment: frees free ones, then forgets the oldest segments
    // only followers hold (ids grow with time). A root tensor's segment stays.
    bool make_room_locked() {
        if (segments_.size() < limits_.segments) return true;
        trim_locked(0, 0);
        for (auto it = segments_.begin(); it != segments_.end() && segments_.size() >= limits_.segments;) {
            if (!it->second.holders.root_tensor) {
                it = segments_.erase(it);
                ++forgotten_;
            } else {
                ++it;
            }
        }
        return segments_.size() < limits_.segments;
    }

    void trim_locked(std::size_t max_bytes, std::size_t max_segments) {
        std::size_t free_count = 0;
        for (auto& [id, e] : segments_) free_count += e.holders.may_refill() ? 1 : 0;
        // Largest first: frees the most with the fewest calls.
        while (cached_ > max_bytes || free_count > max_segments) {
            auto victim = segments_.end();
            for (auto it = segments_.begin(); it != segments_.end(); ++it)
                if (it->second.holders.may_refill() &&
                    (victim == segments_.end() || it->second.segment.capacity() > victim->second.segment.capacity()))
                    victim = it;
            if (victim == segments_.end()) break;
            cached_ -= victim->second.segment.capacity();
            segments_.erase(victim);
            --free_count;
        }
    }

    std::mutex mutex_;
    const pid_t owner_ = ::getpid();
    std::map<std::uint64_t, entry> segments_;
    std::uint64_t next_id_ = 0;
    std::uint64_t clock_ = 0;
    std::size_t cached_ = 0;
    bool serving_ = false;
    shm_pool_limits limits_ = default_limits;
    std::size_t largest_batch_ = 0;
    std::size_t reused_ = 0, created_ = 0, fallbacks_ = 0, tensors_allocated_ = 0, tensors_shared_ = 0,
                forgotten_ = 0;
};

}  // namespace spbcast::detail
