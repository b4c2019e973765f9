// SP leader-only loading: the RNG predicate's truth table, the mirror, configuration errors
// before any collective, batch parity with BASE on DP x SP layouts, and leader failures.
// (RNG parity to the bit and restarts need separate processes: test_loader_processes.cpp.)
#include "support/counting_group.hpp"
#include "support/media_loader.hpp"
#include "support/ranks.hpp"

#include <spbcast/spbcast.hpp>

#include <doctest/doctest.h>

#include <map>

using namespace spbcast_test;

TEST_CASE("will_consume_base_seed truth table: persistent x first iteration / next epoch") {
    // Expected (the reference review): first iteration always true; next epoch true when the
    // loader rebuilds its iterator (non-persistent), false when it reuses it (persistent).
    struct Row { int workers; bool persistent; bool first, next_epoch; };
    for (Row row : {Row{0, false, true, true}, Row{4, true, true, false}}) {
        CAPTURE(row.workers);
        demo::MediaLoader loader(small_pipeline(row.workers, row.persistent));
        CHECK(loader.will_consume_base_seed() == row.first);
        auto before = default_generator_state();
        auto pass = loader.begin();
        CHECK((default_generator_state() != before) == row.first);
        while (pass.next()) {
        }
        CHECK(loader.will_consume_base_seed() == row.next_epoch);
        before = default_generator_state();
        auto next_pass = loader.begin();
        CHECK((default_generator_state() != before) == row.next_epoch);
    }
}

TEST_CASE("mirror_base_seed_draw advances the default generator exactly as creating an iterator does") {
    at::manual_seed(42);
    demo::MediaLoader loader(small_pipeline(0, false));
    loader.begin();
    const auto after_begin = default_generator_state();
    at::manual_seed(42);
    spbcast::mirror_base_seed_draw();
    CHECK(default_generator_state() == after_begin);
}

TEST_CASE("a bad configuration is the same clear error on every rank, before any collective") {
    struct Case { spbcast::loader_config cfg; int tp; std::string expect; };
    const std::vector<Case> cases = {
        {{.sp_media_dedup = true}, 1, "set exactly one of total_epoch and total_step (both are unset)"},
        {{.sp_media_dedup = true, .total_epoch = 1, .total_step = 5}, 1, "(both are set)"},
        {{.sp_media_dedup = true, .total_step = 5}, 2, "sp_media_dedup requires TP size 1 (got 2)"},
        {{.sp_media_dedup = false, .total_epoch = 0}, 1, "total_epoch must be positive"},
    };
    for (const Case& c : cases) {
        CAPTURE(c.expect);
        std::vector<int> collectives(2, -1);
        const auto errors = run_ranks_collect(2, [&](int rank, auto& group) {
            counting_group counted{group};
            try {
                auto loader = spbcast::make_leader_loader(c.cfg, &counted, c.tp, [] {
                    return std::make_unique<demo::MediaLoader>(small_pipeline(0, false));
                });
            } catch (...) {
                collectives[rank] = counted.collectives;
                throw;
            }
        });
        for (int rank = 0; rank < 2; ++rank) {
            REQUIRE(errors[rank]);
            const std::string message = message_of(errors[rank]);
            CHECK(message.find(c.expect) != std::string::npos);
            CHECK(message.find("rank " + std::to_string(rank)) != std::string::npos);
            CHECK(collectives[rank] == 0);
        }
    }
}

namespace {

// Runs `steps` steps of a DP x SP layout on `world` thread ranks and returns, per global rank,
// the digest of every batch it received and the loaders it built.
struct run_record {
    std::vector<std::vector<uint64_t>> digests;
    std::vector<std::vector<int64_t>> epochs;
    int loaders_built = 0;
};

run_record run_layout(int world, int sp, bool dedup, int workers, bool persistent, int64_t total_epoch) {
    run_record record;
    record.digests.resize(world);
    record.epochs.resize(world);
    std::atomic<int> built{0};
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::thread> threads;
    std::vector<std::exception_ptr> errors(world);
    for (int rank = 0; rank < world; ++rank)
        threads.emplace_back([&, rank] {
            try {
                auto layout = spbcast::dist::make_sp_layout(store, rank, world, sp, std::chrono::seconds(30));
                spbcast::loader_config cfg{.sp_media_dedup = dedup, .total_epoch = total_epoch};
                auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [&] {
                    ++built;
                    return std::make_unique<demo::MediaLoader>(
                        small_pipeline(workers, persistent, layout.dp_rank, layout.dp_size));
                });
                CHECK(loader.dedup() == (dedup && sp > 1));
                while (auto batch = loader.next()) {
                    record.digests[rank].push_back(spbcast::digest(*batch));
                    record.epochs[rank].push_back(loader.epoch());
                }
                CHECK(loader.step() == static_cast<int64_t>(record.digests[rank].size()));
                CHECK(loader.total_steps() == loader.length() * total_epoch);
                // Leave together: a rank that destroys its groups while a peer is still
                // connecting them resets that peer's connection (seen with SP 1: DP 4 groups).
                layout.sp_group->barrier()->wait();
                layout.dp_group->barrier()->wait();
            } catch (...) {
                errors[rank] = std::current_exception();
            }
        });
    for (auto& t : threads) t.join();
    for (int rank = 0; rank < world; ++rank)
        if (errors[rank]) FAIL("rank " << rank << ": " << message_of(errors[rank]));
    record.loaders_built = built;
    return record;
}

}  // namespace

TEST_CASE("DP2xSP2 and SP4: every SP rank gets BASE's batches and epochs, and only leaders load") {
    struct Setting { int sp; int workers; bool persistent; };
    for (Setting s : {Setting{2, 0, false}, Setting{2, 2, true}, Setting{4, 2, false}, Setting{1, 0, false}}) {
        CAPTURE(s.sp);
        CAPTURE(s.workers);
        CAPTURE(s.persistent);
        const run_record base = run_layout(4, s.sp, false, s.workers, s.persistent, 2);
        const run_record dedup = run_layout(4, s.sp, true, s.workers, s.persistent, 2);
        CHECK(base.loaders_built == 4);
        CHECK(dedup.loaders_built == (s.sp == 1 ? 4 : 4 / s.sp));
        for (int rank = 0; rank < 4; ++rank) {
            CAPTURE(rank);
            CHECK(!dedup.digests[rank].empty());
            CHECK(dedup.digests[rank] == base.digests[rank]);
            CHECK(dedup.epochs[rank] == base.epochs[rank]);
            const int leader = rank / s.sp * s.sp;
            CHECK(dedup.digests[rank] == dedup.digests[leader]);
        }
        CHECK(dedup.epochs[0].back() == 1);  // two epochs were crossed
    }
}

namespace {

struct failing_loader {
    int fail_at;
    int produced = 0;
    struct pass_t {
        failing_loader* self;
        std::optional<std::vector<int64_t>> next() {
            if (++self->produced == self->fail_at) throw std::runtime_error("decoder crashed on sample 3");
            return std::vector<int64_t>{self->produced};
        }
    };
    pass_t begin() { return {this}; }
};

}  // namespace

TEST_CASE("the leader's loader failing reaches every follower as an error naming the leader, without a hang") {
    const auto errors = run_ranks_collect(3, [](int, auto& group) {
        c10::intrusive_ptr<c10d::ProcessGroupGloo> sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = spbcast::make_leader_loader(
            spbcast::loader_config{.sp_media_dedup = true, .total_step = 10}, sp, 1,
            [] { return std::make_unique<failing_loader>(failing_loader{3}); });
        REQUIRE(loader.next());
        REQUIRE(loader.next());
        loader.next();
    });
    for (int rank = 0; rank < 3; ++rank) {
        REQUIRE(errors[rank]);
        const std::string message = message_of(errors[rank]);
        CHECK(message.find("the SP leader (SP rank 0) failed fetching step 3") != std::string::npos);
        CHECK(message.find("decoder crashed on sample 3") != std::string::npos);
    }
    const auto factory_errors = run_ranks_collect(2, [](int, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = spbcast::make_leader_loader(
            spbcast::loader_config{.sp_media_dedup = true, .total_epoch = 1}, sp, 1,
            []() -> std::unique_ptr<failing_loader> { throw std::runtime_error("dataset index missing"); });
    });
    for (const auto& e : factory_errors) {
        REQUIRE(e);
        CHECK(message_of(e).find("failed building the data loader: dataset index missing") != std::string::npos);
    }
}

TEST_CASE("total_step ends the run on every rank, and the loader length comes from the leader") {
    run_ranks(2, [](int rank, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = spbcast::make_leader_loader(
            spbcast::loader_config{.sp_media_dedup = true, .total_step = 5}, sp, 1,
            [] { return std::make_unique<demo::MediaLoader>(small_pipeline(0, false)); });
        CHECK(loader.has_loader() == (rank == 0));
        CHECK(loader.length() == demo::MediaLoader(small_pipeline(0, false)).size());
        int steps = 0;
        while (loader.next()) ++steps;
        CHECK(steps == 5);
        CHECK_FALSE(loader.next());
    });
}
