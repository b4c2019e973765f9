// Separate processes, as in a real job: ranks started with the launcher environment, groups
// built from a TCP store, realistic batches broadcast and checked on every rank.
#include "support/processes.hpp"

#include <doctest/doctest.h>

using namespace spbcast_test;

TEST_CASE("separate processes: realistic batches arrive identical on every rank, from any root") {
    const auto worker = binary_dir() / "spbcast_rank_worker";
    for (int root : {0, 2}) {
        CAPTURE(root);
        const auto results = run_processes(worker, 3, [&](int) {
            return std::vector<std::string>{"qwen3-vl-image", "2", "3", std::to_string(root)};
        }, std::chrono::seconds(120));
        for (const auto& r : results) REQUIRE_MESSAGE(r.exit_code == 0, describe(results));
        // Every rank printed the same digest for each step.
        CHECK(results[0].output.find("step 2 digest") != std::string::npos);
    }
}
