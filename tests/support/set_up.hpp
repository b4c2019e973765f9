// The test kits' invariant: no rank runs its case before every rank has set up its groups.
// Gloo connects a group's pairs while constructing it, and a rank can finish before a peer has
// finished connecting to it; if that rank then throws (a case that expects an error before any
// collective) and destroys its group or exits, the slower peer's construction fails with
// "Connection closed by peer" instead of the case's own error. On a loaded machine that
// happens. Each kit calls wait_for_set_up once its groups exist, on the store they were built on.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>

namespace spbcast_test {

// Counts this rank in under `key` and waits until all `world` ranks are, for at most `bound`.
// A rank whose set-up failed should still call it before raising its own error, so its peers
// go on (and fail on their own) instead of waiting out the bound.
inline void wait_for_set_up(c10d::Store& store, int rank, int world, std::chrono::milliseconds bound,
                            const std::string& key = "spbcast_test/set_up") {
    const auto deadline = std::chrono::steady_clock::now() + bound;
    std::int64_t arrived = store.add(key, 1);
    while (arrived < world) {
        if (std::chrono::steady_clock::now() > deadline)
            throw std::runtime_error(
                "test kit: rank " + std::to_string(rank) + ": only " + std::to_string(arrived) + " of " +
                std::to_string(world) + " ranks set up their groups within " + std::to_string(bound.count()) +
                " ms; a rank failed or hung while setting up - see its own error");
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
        arrived = store.add(key, 0);
    }
}

}  // namespace spbcast_test
