// N ranks as threads of this process, each with its own real Gloo process group on one shared
// in-memory store (a HashStore: no port to find), the ranks talking over loopback TCP on ports
// the kernel gives Gloo. Every rank's exception is collected. A case's body starts on a rank
// only once every rank has its group (set_up.hpp).
#pragma once

#include "set_up.hpp"

#include <spbcast/dist.hpp>

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <chrono>
#include <exception>
#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace spbcast_test {

using namespace std::chrono_literals;

// Runs body(rank) on `world` threads; returns each one's exception (null if none).
template <class Body>
std::vector<std::exception_ptr> run_threads(int world, Body body) {
    std::vector<std::exception_ptr> errors(world);
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
        threads.emplace_back([&, rank] {
            try {
                body(rank);
            } catch (...) {
                errors[rank] = std::current_exception();
            }
        });
    }
    for (auto& t : threads) t.join();
    return errors;
}

// Runs body(rank, group) on `world` threads; returns each rank's exception (null if none).
template <class Body>
std::vector<std::exception_ptr> run_ranks_collect(int world, Body body,
                                                  std::chrono::milliseconds timeout = 20s) {
    auto store = c10::make_intrusive<c10d::HashStore>();
    return run_threads(world, [&](int rank) {
        c10::intrusive_ptr<c10d::ProcessGroupGloo> group;
        std::exception_ptr failed;
        try {
            group = spbcast::dist::make_gloo_group(store, rank, world, timeout, "127.0.0.1");
        } catch (...) {
            failed = std::current_exception();
        }
        wait_for_set_up(*store, rank, world, timeout);
        if (failed) std::rethrow_exception(failed);
        body(rank, *group);
    });
}

inline std::string message_of(const std::exception_ptr& e) {
    try {
        std::rethrow_exception(e);
    } catch (const std::exception& ex) {
        return ex.what();
    } catch (...) {
        return "unknown exception";
    }
}

// Runs body on `world` ranks and fails the test with every rank's message if any rank threw.
template <class Body>
void run_ranks(int world, Body body, std::chrono::milliseconds timeout = 20s) {
    const auto errors = run_ranks_collect(world, body, timeout);
    std::string failures;
    for (int r = 0; r < world; ++r)
        if (errors[r]) failures += "\n  rank " + std::to_string(r) + ": " + message_of(errors[r]);
    if (!failures.empty()) throw std::runtime_error("ranks failed:" + failures);
}

}  // namespace spbcast_test
