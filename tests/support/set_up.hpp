// The test kits' invariant: no rank runs its case before every rank has set up its groups.
// Gloo connects a group's pairs while constructing it, and a rank can finish before a peer has
// finished connecting to it; if that rank then throws (a case that expects an error before any
// collective) and destroys its group or exits, the slower peer's construction fails with
// "Connection closed by peer" instead of the case's own error. On a loaded machine that
// happens. Each kit calls wait_for_set_up once its groups exist, on the store they were built on.
// The same holds at the end, the other way round: leave_together below.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

namespace spbcast_test {

// How many ranks the counter `key` holds once it holds `count`, or at `deadline`.
inline std::int64_t count_until(c10d::Store& store, const std::string& key, std::int64_t count,
                                std::chrono::steady_clock::time_point deadline) {
    std::int64_t counted = store.add(key, 0);
    while (counted < count && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        counted = store.add(key, 0);
    }
    return counted;
}

// Counts this rank in under `key` and waits until all `world` ranks are, for at most `bound`.
// A rank whose set-up failed should still call it before raising its own error, so its peers
// go on (and fail on their own) instead of waiting out the bound.
inline void wait_for_set_up(c10d::Store& store, int rank, int world, std::chrono::milliseconds bound,
                            const std::string& key = "spbcast_test/set_up") {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    std::int64_t arrived = store.add(key, 1);
    if (arrived < world) arrived = count_until(store, key, world, deadline);
    if (arrived < world)
        throw std::runtime_error(
            "test kit: rank " + std::to_string(rank) + ": only " + std::to_string(arrived) + " of " +
            std::to_string(world) + " ranks set up their groups within " + std::to_string(bound.count()) +
            " ms; a rank failed or hung while setting up - see its own error");
}

// Counts this rank as done with the job's collectives (see leave_together), without waiting: a
// rank about to die on purpose, so that its peers wait for it no longer.
inline void count_as_done(c10d::Store& store) {
    store.add("spbcast_test/finished", 1);
}

// Leaves only when every rank of the job is done with its collectives, rank 0 last (it serves
// the store unless a launcher does). A rank that exits at once after its last collective can
// fail a peer whose part of that collective is still in flight: Gloo fails the peer's operation
// with "Connection closed by peer" where the exit closes a connection it still uses, and
// spbcast's peer watch takes the exit for a death where its status is lost (docs/errors.md).
// Only a rank whose part went well calls it: one that failed leaves at once, touching no store
// (it may be unreachable: a link cut), and a job where one failed is failing anyway. A store
// that is gone (its rank failed or died) leaves nobody to wait for.
inline void leave_together(c10d::Store& store, int rank, int world,
                           std::chrono::milliseconds bound = std::chrono::seconds(60)) {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    try {
        count_as_done(store);
        count_until(store, "spbcast_test/finished", world, deadline);
        if (rank != 0) store.add("spbcast_test/left", 1);
        else count_until(store, "spbcast_test/left", world - 1, deadline);
    } catch (const std::exception&) {
    }
}

}  // namespace spbcast_test
