// Leader-only loading in separate processes, where each rank owns its default CPU generator:
// RNG parity with BASE to the bit, and a restart that resumes exactly where it stopped - with
// the prefetch on (the default), which has fetched the step after the checkpoint already.
#include "support/processes.hpp"

#include <doctest/doctest.h>

#include <filesystem>
#include <map>
#include <regex>

using namespace spbcast_test;

namespace {

struct rank_log {
    std::vector<std::string> steps;  // "step S epoch E digest D"
    std::string rng;
    std::vector<std::string> calls;  // "call step S epoch E <outcome> rng R", the faulty loader's
};

std::vector<rank_log> run_job(const std::string& mode, int sp, const std::string& loader, int total_step,
                              int save_at = 0, const std::string& dir = "/tmp", bool resume = false,
                              int prefetch = 1) {
    const auto results = run_processes(binary_dir() / "spbcast_loader_worker", 4, [&](int) {
        return std::vector<std::string>{mode, std::to_string(sp), loader, std::to_string(total_step),
                                        std::to_string(save_at), dir, resume ? "1" : "0"};
    }, std::chrono::seconds(180), {"SPBCAST_LOADER_PREFETCH=" + std::to_string(prefetch)});
    std::vector<rank_log> logs(4);
    for (int r = 0; r < 4; ++r) {
        REQUIRE_MESSAGE(results[r].exit_code == 0, describe(results));
        std::istringstream lines(results[r].output);
        for (std::string line; std::getline(lines, line);) {
            if (line.rfind("step ", 0) == 0) logs[r].steps.push_back(line);
            if (line.rfind("rng ", 0) == 0) logs[r].rng = line;
            if (line.rfind("call ", 0) == 0) logs[r].calls.push_back(line);
        }
    }
    return logs;
}

}  // namespace

TEST_CASE("RNG parity: each follower's default generator ends bit-identical to BASE's, across epochs") {
    for (const std::string loader : {"media", "media-persistent", "torchdata"})
        for (int sp : {2, 4}) {
            CAPTURE(loader);
            CAPTURE(sp);
            const auto base = run_job("base", sp, loader, 24);
            const auto dedup = run_job("dedup", sp, loader, 24);
            for (int r = 0; r < 4; ++r) {
                CAPTURE(r);
                CHECK(base[r].steps.size() == 24);
                CHECK(dedup[r].steps == base[r].steps);
                CHECK(!dedup[r].rng.empty());
                CHECK(dedup[r].rng == base[r].rng);
            }
            // At least two epoch boundaries were crossed.
            CHECK(base[0].steps.back().find("epoch 0 ") == std::string::npos);
            CHECK(base[0].steps.back().find("epoch 1 ") == std::string::npos);
        }
}

TEST_CASE("a trainer that skips a failed fetch and a refused batch has BASE's generator and counters on every rank after every step, prefetching or not") {
    // DP2 x SP2, a randperm at every begin(): the fetch that throws (no step) and the batch
    // spbcast cannot send (a step) both come first in a pass, so their steps carry RNG events.
    // Prefetch on (the default) and off give the same calls, generators included, bit for bit.
    const auto base = run_job("base", 2, "faulty", 14);
    const auto dedup = run_job("dedup", 2, "faulty", 14);
    const auto synchronous = run_job("dedup", 2, "faulty", 14, 0, "/tmp", false, /*prefetch=*/0);
    for (int r = 0; r < 4; ++r) {
        CAPTURE(r);
        REQUIRE(base[r].calls.size() == 16);  // 14 steps, the fetch that threw, the end
        CHECK(base[r].calls[5].find("call step 5 epoch 1 skipped") == 0);
        CHECK(base[r].calls[10].find("call step 10 epoch 2 skipped") == 0);
        CHECK(base[r].calls.back().find("call step 14 epoch 2 end") == 0);
        for (std::size_t i = 0; i < base[r].calls.size(); ++i) {
            CAPTURE(i);
            CHECK(dedup[r].calls.at(i) == base[r].calls[i]);
            CHECK(synchronous[r].calls.at(i) == base[r].calls[i]);
        }
    }
}

TEST_CASE("restart: save at step 20, new processes resume, steps 21-40 equal the continuous run") {
    const auto dir = std::filesystem::temp_directory_path() / ("spbcast-restart-" + std::to_string(::getpid()));
    for (const std::string mode : {"base", "dedup"}) {
        CAPTURE(mode);
        std::filesystem::remove_all(dir);
        std::filesystem::create_directories(dir);
        const auto continuous = run_job(mode, 2, "media", 40);
        run_job(mode, 2, "media", 40, 20, dir.string());
        const auto resumed = run_job(mode, 2, "media", 40, 0, dir.string(), true);
        for (int r = 0; r < 4; ++r) {
            CAPTURE(r);
            REQUIRE(continuous[r].steps.size() == 40);
            const std::vector<std::string> tail(continuous[r].steps.begin() + 20, continuous[r].steps.end());
            CHECK(resumed[r].steps == tail);
        }
        // Resuming mid-epoch creates a fresh iterator, which draws a base seed as PyTorch's does;
        // the dedup followers must make that same draw: compare with BASE's restart.
        static std::vector<std::string> base_resumed_rng;
        if (mode == "base") {
            base_resumed_rng.clear();
            for (const auto& log : resumed) base_resumed_rng.push_back(log.rng);
        } else {
            for (int r = 0; r < 4; ++r) CHECK(resumed[r].rng == base_resumed_rng[r]);
        }
    }
    std::filesystem::remove_all(dir);
}
