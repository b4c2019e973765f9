// The leader's tensors in shared memory from the start (README: "The same-host path").
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
#pragma once

#include "shm_pool.hpp"
#include "shm_segment.hpp"
#include "version.hpp"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <sys/mman.h>

#include <cstddef>
#include <cstring>
#include <limits>

namespace spbcast::detail {

// One tensor storage's segment, as its DataPtr's context.
struct shared_allocation {
    std::uint64_t segment = 0;
    int fd = -1;             // the pool's descriptor; used only before the hand-over
    std::size_t capacity = 0;
    void* data = nullptr;    // this storage's own mapping of the segment
    std::size_t bytes = 0;
    bool detached = false;   // the mapping is private: the segment no longer follows the tensor

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

inline void free_shared_allocation(void* context) {
    auto* a = static_cast<shared_allocation*>(context);
    ::munmap(a->data, a->bytes);
    shm_pool::instance().release(a->segment);
    delete a;
}

// The allocation behind a storage, when a shared_memory_scope made it.
inline shared_allocation* shared_allocation_of(const c10::Storage& storage) {
    const c10::DataPtr& p = storage.data_ptr();
    if (p.get_deleter() != &free_shared_allocation) return nullptr;
    return static_cast<shared_allocation*>(p.get_context());
}

// The open shared_memory_scope of this thread: 0 bytes when there is none.
inline thread_local std::size_t shared_scope_min_bytes = 0;

// Wraps the CPU allocator that was installed before it; outside a scope it is that allocator.
class shared_memory_allocator final : public c10::Allocator {
public:
    explicit shared_memory_allocator(c10::Allocator* fallback) : fallback_(fallback) {}

#if SPBCAST_TORCH_AT_LEAST(2, 0)  // allocate is not const, copy_data is pure virtual
    c10::DataPtr allocate(std::size_t n) override { return allocate_here(n); }
    void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
#else
    c10::DataPtr allocate(std::size_t n) const override { return allocate_here(n); }
#endif

    c10::Allocator* fallback() const { return fallback_; }

private:
    c10::DataPtr allocate_here(std::size_t n) const {
        if (shared_scope_min_bytes == 0 || n < shared_scope_min_bytes) return fallback_->allocate(n);
        auto& pool = shm_pool::instance();
        std::string why_not;
        const auto lease = pool.acquire(n, 1, why_not);
        if (!lease) return fallback_->allocate(n);  // no shared memory now: ordinary memory
        const std::size_t bytes = (n + segment_page - 1) / segment_page * segment_page;
        void* data = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, lease.fd, 0);
        if (data == MAP_FAILED) {
            pool.release(lease.id);
            return fallback_->allocate(n);
        }
        pool.count_tensor(false);
        auto* a = new shared_allocation{lease.id, lease.fd, lease.capacity, data, bytes};
        return {data, a, &free_shared_allocation, c10::Device(c10::DeviceType::CPU)};
    }

    c10::Allocator* fallback_;
};

// Installed once, on the first scope, in front of the allocator in use then, which it calls
// for everything outside a scope. At that allocator's own priority, which c10 does not tell:
// the lowest that c10 accepts is it. So an allocator installed later at that priority or above
// (a test's failing allocator, a counting one) still goes in front of this one, as it would
// have gone in front of the one this wraps.
inline void install_shared_memory_allocator() {
    static const bool installed = [] {
        auto* mine = new shared_memory_allocator(c10::GetCPUAllocator());  // never destroyed: storages outlive main
        for (int priority = 0; c10::GetCPUAllocator() != mine && priority <= std::numeric_limits<std::uint8_t>::max(); ++priority)
            c10::SetCPUAllocator(mine, static_cast<std::uint8_t>(priority));
        return true;
    }();
    (void)installed;
}

}  // namespace spbcast::detail
