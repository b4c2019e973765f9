// One rank of a multi-process test, started by tests through support/processes.hpp with the
// launcher environment. Broadcasts realistic batches over a real Gloo group built from
// MASTER_ADDR/MASTER_PORT and checks each arrival against the batch it should be.
//
//   spbcast_rank_worker <profile> <micro_batches> <steps> <root>
#include "profiles.hpp"
#include "support/processes.hpp"

#include <spbcast/spbcast.hpp>

#include <iostream>

namespace {

int run(int argc, char** argv) {
    if (argc != 5) {
        std::cerr << "usage: spbcast_rank_worker <profile> <micro_batches> <steps> <root>\n";
        return 2;
    }
    const auto profile = xtuner::profile_from_name(argv[1]);
    const int micro_batches = std::stoi(argv[2]), steps = std::stoi(argv[3]), root = std::stoi(argv[4]);
    try {
        auto [env, store, group] = spbcast_test::join_job(std::chrono::seconds(30));
        for (int step = 0; step < steps; ++step) {
            xtuner::Batch batch;
            if (env.rank == root) batch = xtuner::make_batch(profile, micro_batches, step);
            spbcast::broadcast(batch, group, {.root = root, .timeout = std::chrono::seconds(30)});
            const auto got = spbcast::digest(batch);
            const auto want = spbcast::digest(xtuner::make_batch(profile, micro_batches, step));
            std::cout << "rank " << env.rank << " step " << step << " digest " << std::hex << got
                      << std::dec << "\n";
            if (got != want) {
                std::cerr << "rank " << env.rank << ": step " << step << " differs from the root's batch\n";
                return 1;
            }
        }
        return 0;
    } catch (const std::exception& e) {
        std::cerr << "rank worker failed: " << e.what() << "\n";
        return 1;
    }
}

}  // namespace

int main(int argc, char** argv) { return spbcast_test::leave_job(run(argc, argv)); }
