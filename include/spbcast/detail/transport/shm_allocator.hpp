// The leader's tensors in shared memory from the start (docs/transports.md, "The same-host path").
//
// Inside a shared_memory_scope, the CPU allocations of that thread of at least its min_bytes
// come from the root's segment pool, one segment each: a collator that builds its batch there
// has written it into shared pages already, and a broadcast over the same-host path hands those
// segments to the followers instead of copying them, so the group holds one copy of the batch.
//
// Why the root's mapping turns private when its segment is handed over: followers map a
// segment privately, so they would see every later write into the pages they have not written
// themselves. The root's tensor stays an ordinary writable tensor after the broadcast because
// its shared mapping is replaced, at the same address (MAP_FIXED), by a private one of the same
// file: reads still share the pages, a write by the root copies the page and stays the root's.
// So a segment is handed over once; a later broadcast of the same tensor copies it like any
// other memory (its pages may differ from the file by then).
//
// A child forked while such a tensor lives maps its segment too (shared, or private after the
// hand-over): when the tensor goes, the segment is forgotten, never refilled (fork_safety.hpp).
#pragma once

#include "fork_safety.hpp"
#include "shm_pool.hpp"
#include "shm_segment.hpp"
#include "../base/version.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <atomic>
#include <cstddef>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

namespace spbcast::detail {

// One tensor storage's segment. Its DataPtr's context is its data pointer, as c10's raw
// allocation interface requires of every allocation (raw_allocate asserts it); the record is
// found by address in shared_allocations.
struct shared_allocation {
    std::uint64_t segment = 0;
    int fd = -1;             // the pool's descriptor; used only before the hand-over
    std::size_t capacity = 0;
    void* data = nullptr;    // this storage's own mapping of the segment
    std::size_t bytes = 0;
    bool detached = false;   // the mapping is private: the segment no longer follows the tensor
    std::uint64_t forks_at_birth = 0;  // fork_generation() before the mapping: a child forked since may map it

    // Makes this mapping private, same address and contents, before the segment is handed over.
    // On failure the mapping is shared again (the bytes are in the segment) and the caller
    // copies the tensor instead.
    bool detach() {
        if (::mmap(data, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd, 0) != MAP_FAILED)
            return detached = true;
        ::mmap(data, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0);
        return false;
    }
};

// The live shared allocations of this process by data pointer. Its lock is held across fork
// (fork_safety.hpp), so a child freeing an inherited tensor finds it free.
class shared_allocations {
public:
    static shared_allocations& instance() {
        static auto* a = new shared_allocations();  // never destroyed: storages outlive main
        return *a;
    }
    void add(shared_allocation* a) {
        std::lock_guard<std::mutex> lock(mutex_);
        by_data_[a->data] = a;
    }
    shared_allocation* find(const void* data) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = by_data_.find(data);
        return it == by_data_.end() ? nullptr : it->second;
    }
    shared_allocation* take(const void* data) {
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = by_data_.find(data);
        if (it == by_data_.end()) return nullptr;
        shared_allocation* a = it->second;
        by_data_.erase(it);
        return a;
    }

private:
    shared_allocations() { fork_safety::instance().hold_across_fork(fork_safety::lock_order::shared_allocations, mutex_); }
    std::mutex mutex_;
    std::map<const void*, shared_allocation*> by_data_;
};

// The raw deleter of the allocator spbcast's wraps (raw_deleter(): null if it has none).
inline c10::DeleterFnPtr wrapped_raw_deleter = nullptr;

// The deleter of every allocation made through spbcast's allocator, raw ones included: a
// shared allocation is unmapped and its segment given back (forgotten when a child forked since
// may still map it); anything else goes to the wrapped allocator's raw deleter.
inline void free_allocation(void* data) {
    shared_allocation* a = shared_allocations::instance().take(data);
    if (!a) {
        wrapped_raw_deleter(data);
        return;
    }
    ::munmap(a->data, a->bytes);
    if (fork_generation() != a->forks_at_birth)
        shm_pool::instance().forget(a->segment);
    else
        shm_pool::instance().release_tensor(a->segment);
    delete a;
}

// The allocation behind a storage, when a shared_memory_scope made it.
inline shared_allocation* shared_allocation_of(const c10::Storage& storage) {
    const c10::DataPtr& p = storage.data_ptr();
    if (p.get_deleter() != &free_allocation) return nullptr;
    return shared_allocations::instance().find(p.get());
}

// The shared_memory_scopes open on this thread, innermost last. A scope may be closed on
// another thread (a Python block collected elsewhere): it then only marks its token closed,
// and this thread drops closed tokens the next time it allocates.
struct scope_token {
    std::size_t min_bytes = 0;
    std::atomic<bool> open{true};
};
inline thread_local std::vector<std::shared_ptr<scope_token>> open_scopes;

// The min_bytes of this thread's innermost open scope; 0 when there is none.
inline std::size_t shared_scope_min_bytes() {
    while (!open_scopes.empty() && !open_scopes.back()->open.load(std::memory_order_acquire)) open_scopes.pop_back();
    return open_scopes.empty() ? 0 : open_scopes.back()->min_bytes;
}

// Wraps the CPU allocator that was installed before it; outside a scope it is that allocator.
// It forwards the whole c10::Allocator interface of the generation in use.
class shared_memory_allocator final : public c10::Allocator {
public:
    explicit shared_memory_allocator(c10::Allocator* fallback) : fallback_(fallback) {}

#if SPBCAST_TORCH_AT_LEAST(2, 0)  // allocate is not const; copy_data and is_simple_data_ptr exist
    c10::DataPtr allocate(std::size_t n) override { return allocate_here(n); }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        fallback_->copy_data(dest, src, count);
    }
    bool is_simple_data_ptr(const c10::DataPtr& p) const override {
        return p.get_deleter() == &free_allocation ? p.get() == p.get_context() : fallback_->is_simple_data_ptr(p);
    }
#else
    c10::DataPtr allocate(std::size_t n) const override { return allocate_here(n); }
#endif
    // raw_allocate/raw_deallocate (c10, used by extensions) work exactly when the wrapped
    // allocator's do; a raw allocation inside a scope is an ordinary shared allocation.
    c10::DeleterFnPtr raw_deleter() const override { return wrapped_raw_deleter ? &free_allocation : nullptr; }

    c10::Allocator* fallback() const { return fallback_; }

private:
    c10::DataPtr allocate_here(std::size_t n) const {
        const std::size_t min_bytes = shared_scope_min_bytes();
        if (min_bytes == 0 || n < min_bytes) return fallback_->allocate(n);
        auto& pool = shm_pool::instance();
        std::string why_not;
        const auto lease = pool.acquire_for_tensor(n, why_not);
        if (!lease) return fallback_->allocate(n);  // no shared memory now: ordinary memory
        const std::size_t bytes = (n + segment_page - 1) / segment_page * segment_page;
        const std::uint64_t forks = fork_generation();  // before the mapping exists: a fork in between counts
        void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, lease.fd, 0);
        if (data == MAP_FAILED) {
            pool.release_tensor(lease.id);
            return fallback_->allocate(n);
        }
        pool.count_tensor(false);
        auto* a = new shared_allocation{lease.id, lease.fd, lease.capacity, data, bytes, false, forks};
        shared_allocations::instance().add(a);
        return {data, data, &free_allocation, c10::Device(c10::DeviceType::CPU)};
    }

    c10::Allocator* fallback_;
};

// Installed once, on the first scope, in front of the allocator in use then, which it calls
// for everything outside a scope. At that allocator's own priority, which c10 does not tell:
// the lowest that c10 accepts is it. So an allocator installed later at that priority or above
// (a test's failing allocator, a counting one) still goes in front of this one, as it would
// have gone in front of the one this wraps.
inline shared_memory_allocator* install_shared_memory_allocator() {
    static auto* const mine = [] {
        c10::Allocator* wrapped = c10::GetCPUAllocator();
        wrapped_raw_deleter = wrapped->raw_deleter();
        auto* a = new shared_memory_allocator(wrapped);  // never destroyed: storages outlive main
        for (int priority = 0; c10::GetCPUAllocator() != a && priority <= std::numeric_limits<std::uint8_t>::max(); ++priority)
            c10::SetCPUAllocator(a, static_cast<std::uint8_t>(priority));
        return a;
    }();
    return mine;
}

}  // namespace spbcast::detail
