// The loader's stats: what the loop did on this rank so far, counted on the trainer's thread
// step by step, and the summary leader_loader::stats() returns (loader_stats, as the Python
// LeaderLoader.stats() reports it). Also the clock every part times its work with.
#pragma once

#include "../../options.hpp"
#include "../transport/same_host_registry.hpp"
#include "../wire/send_plan.hpp"
#include "../wire/value_codec.hpp"

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

namespace spbcast {

// What the loop did on this rank so far, as the Python LeaderLoader.stats() reports it.
struct loader_stats {
    std::string path;                   // same_host, hierarchical, network; local: dedup off
    std::int64_t steps = 0;             // batches returned
    std::uint64_t bytes = 0;            // their tensors' distinct storage bytes
    double loader_seconds = 0;          // the leader (or a rank without dedup): in its loader
    double leader_loader_seconds = 0;   // a follower: the leader's loader time for the same steps
    double broadcast_seconds = 0;       // in the steps' broadcasts (a follower's include waiting
                                        // for the leader's loader)
    double wait_seconds = 0;            // in next(): what the trainer waited
    std::int64_t prefetch_hits = 0;     // steps whose batch was already here when next() was called
    std::size_t prefetch = 0;           // the prefetch depth in use
    std::string prefetch_reason;        // why it is 0, when it is
};

namespace detail {

using loader_clock = std::chrono::steady_clock;

inline double seconds_since(loader_clock::time_point start) {
    return std::chrono::duration<double>(loader_clock::now() - start).count();
}

// The distinct storage bytes of a batch's tensors (what the stats report).
template <class T>
std::uint64_t storage_bytes(const T& value) {
    try {
        const limits unbounded{~std::size_t{0}, ~std::size_t{0}, ~std::size_t{0}, ~std::uint64_t{0},
                               ~std::size_t{0}, ~std::size_t{0}, 4096};
        send_plan plan;
        byte_writer out;
        encoder enc(out, plan, unbounded);
        enc.value(value);
        std::unordered_set<const void*> seen;
        std::uint64_t total = 0;
        for (const at::Tensor& t : plan.tensors())
            if (t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
                total += t.storage().nbytes();
        return total;
    } catch (const std::exception&) {
        return 0;  // only counting: a batch that cannot be sent fails elsewhere
    }
}

// The counts of one rank's loop, kept by the trainer's thread alone (a prefetched step brings
// its times with it and is counted when next() takes it).
class loader_counts {
public:
    loader_counts(bool leader, transport_mode transport) : leader_(leader), transport_(transport) {}

    // Adds the time from `started` to the end of the scope to what the trainer waited in next().
    class wait_timer {
    public:
        wait_timer(loader_counts& counts, loader_clock::time_point started) : counts_(counts), started_(started) {}
        wait_timer(const wait_timer&) = delete;
        wait_timer& operator=(const wait_timer&) = delete;
        ~wait_timer() { counts_.counts_.wait_seconds += seconds_since(started_); }

    private:
        loader_counts& counts_;
        loader_clock::time_point started_;
    };
    wait_timer time_wait(loader_clock::time_point started) { return wait_timer(*this, started); }

    // A rank without dedup: the time in its own loader.
    void add_own_loader_time(double seconds) { counts_.loader_seconds += seconds; }

    // A step the leader sent: this rank's time in its broadcast, and the leader's in its loader
    // (the leader's own, on the leader).
    void add_step_times(double broadcast_seconds, double leader_loader_seconds) {
        counts_.broadcast_seconds += broadcast_seconds;
        (leader_ ? counts_.loader_seconds : counts_.leader_loader_seconds) += leader_loader_seconds;
    }

    void count_prefetch_hit() { ++counts_.prefetch_hits; }

    template <class Batch>
    void count_batch(const std::optional<Batch>& batch, std::uint64_t bytes) {
        if (!batch) return;
        ++counts_.steps;
        counts_.bytes += bytes;
    }

    template <class Batch>
    void count_batch(const std::optional<Batch>& batch) {
        count_batch(batch, batch ? storage_bytes(*batch) : 0);
    }

    // `carrier`: what the batches travel over (the prefetch channel when prefetching, else the
    // SP group), null when dedup is off.
    loader_stats summary(const void* carrier, std::size_t prefetch, std::string prefetch_reason) const {
        loader_stats s = counts_;
        s.path = path(carrier);
        s.prefetch = prefetch;
        s.prefetch_reason = std::move(prefetch_reason);
        return s;
    }

private:
    std::string path(const void* carrier) const {
        if (!carrier) return "local";
        if (transport_ == transport_mode::network) return "network";
        const auto state = same_host_registry::instance().find(carrier, 0);
        if (!state || !state->shared) return "network";
        return state->relays() ? "hierarchical" : "same_host";
    }

    bool leader_;
    transport_mode transport_;
    loader_stats counts_;
};

}  // namespace detail
}  // namespace spbcast
