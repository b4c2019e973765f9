// SP leader-only loading: the RNG predicate's truth table, the mirror, configuration errors
// before any collective, batch parity with BASE on DP x SP layouts, and leader failures.
// (RNG parity to the bit and restarts need separate processes: test_loader_processes.cpp.)
#include "support/counting_group.hpp"
#include "support/media_loader.hpp"
#include "support/ranks.hpp"

#include <spbcast/spbcast.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <map>
#include <thread>

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
        {{.sp_media_dedup = true, .total_step = 5, .root_wait = std::chrono::seconds(-1)},
         1, "root_wait must not be negative"},
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
            INFO(message);
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

run_record run_layout(int world, int sp, bool dedup, int workers, bool persistent, int64_t total_epoch,
                      std::size_t prefetch = 1) {
    run_record record;
    record.digests.resize(world);
    record.epochs.resize(world);
    std::atomic<int> built{0};
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto errors = spbcast_test::run_threads(world, [&](int rank) {
        auto layout = spbcast::dist::make_sp_layout(store, rank, world, sp, std::chrono::seconds(30));
        wait_for_set_up(*store, rank, world, std::chrono::seconds(30));
        spbcast::loader_config cfg{.sp_media_dedup = dedup, .total_epoch = total_epoch, .prefetch = prefetch};
        auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [&] {
            ++built;
            return std::make_unique<demo::MediaLoader>(
                small_pipeline(workers, persistent, layout.dp_rank, layout.dp_size));
        });
        CHECK(loader.dedup() == (dedup && sp > 1));
        CHECK(loader.prefetch_depth() == (dedup && sp > 1 ? prefetch : 0));
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
    });
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

TEST_CASE("DP2xSP2: prefetching 0, 1 (the default) or 2 batches ahead gives the same batches and epochs") {
    const run_record synchronous = run_layout(4, 2, true, 2, true, 2, 0);
    const run_record ahead = run_layout(4, 2, true, 2, true, 2, 1);
    const run_record further = run_layout(4, 2, true, 2, true, 2, 2);
    for (int rank = 0; rank < 4; ++rank) {
        CAPTURE(rank);
        CHECK(!synchronous.digests[rank].empty());
        CHECK(ahead.digests[rank] == synchronous.digests[rank]);
        CHECK(further.digests[rank] == synchronous.digests[rank]);
        CHECK(ahead.epochs[rank] == synchronous.epochs[rank]);
        CHECK(further.epochs[rank] == synchronous.epochs[rank]);
    }
}

namespace {

struct failing_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
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

namespace {

// A loader whose pass throws `thrower()` at its `fail_at`-th batch and sleeps `slow_ms` before
// its `slow_at`-th.
template <class Thrower>
struct scripted_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
    int fail_at, slow_at;
    std::chrono::milliseconds slow;
    Thrower thrower;
    int produced = 0;
    struct pass_t {
        scripted_loader* self;
        std::optional<std::vector<int64_t>> next() {
            ++self->produced;
            if (self->produced == self->slow_at) std::this_thread::sleep_for(self->slow);
            if (self->produced == self->fail_at) self->thrower();
            return std::vector<int64_t>{self->produced};
        }
    };
    pass_t begin() { return {this}; }
};

template <class Thrower>
std::vector<std::exception_ptr> run_scripted(Thrower thrower) {
    return run_ranks_collect(3, [&](int, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = spbcast::make_leader_loader(
            spbcast::loader_config{.sp_media_dedup = true, .total_step = 10}, sp, 1, [&] {
                return std::make_unique<scripted_loader<Thrower>>(scripted_loader<Thrower>{2, 0, {}, thrower});
            });
        REQUIRE(loader.next());
        loader.next();
        FAIL("the second step returned although the leader's loader threw");
    });
}

}  // namespace

TEST_CASE("every exception of the leader's loader reaches every SP rank as errc::loader, never as the end of data") {
    struct Case {
        const char* name;
        std::function<void()> thrower;
        const char* expect;
    };
    const std::vector<Case> cases{
        {"empty message", [] { throw std::runtime_error(""); }, "an exception with an empty message"},
        {"not a std::exception", [] { throw 42; }, "an exception that is not a std::exception"},
        {"c10 error", [] { TORCH_CHECK(false, "bad sample 17"); }, "bad sample 17"},
    };
    for (const auto& c : cases) {
        CAPTURE(c.name);
        const auto errors = run_scripted(c.thrower);
        for (int rank = 0; rank < 3; ++rank) {
            CAPTURE(rank);
            REQUIRE(errors[rank]);
            const std::string message = message_of(errors[rank]);
            CHECK_MESSAGE(message.find("the SP leader (SP rank 0) failed fetching step 2") != std::string::npos, message);
            CHECK_MESSAGE(message.find(c.expect) != std::string::npos, message);
            CHECK(message.find("Exception raised from") == std::string::npos);  // no c10 backtrace
            try {
                std::rethrow_exception(errors[rank]);
            } catch (const spbcast::error& e) {
                CHECK(e.code() == spbcast::errc::loader);
            } catch (...) {
                FAIL("not a spbcast::error");
            }
        }
    }
}

namespace {

// Its 2nd fetch throws and its 3rd yields a sparse tensor, which spbcast refuses to send.
struct refusing_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
    int produced = 0;
    struct pass_t {
        refusing_loader* self;
        std::optional<at::Tensor> next() {
            ++self->produced;
            if (self->produced == 2) throw std::runtime_error("decoder crashed on sample 2");
            if (self->produced == 3) return at::arange(4).to_sparse();
            return at::full({2}, self->produced, at::kLong);
        }
    };
    pass_t begin() { return {this}; }
};

}  // namespace

TEST_CASE("a trainer that skips a failed fetch and a refused batch goes on at the same step on every SP rank") {
    // The generator mirror across these errors needs a generator per rank: test_loader_processes.cpp.
    std::vector<std::vector<std::string>> calls(3);
    run_ranks(3, [&](int rank, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = spbcast::make_leader_loader(spbcast::loader_config{.sp_media_dedup = true, .total_step = 4},
                                                  sp, 1, [] { return std::make_unique<refusing_loader>(); });
        for (bool more = true; more;) {
            std::string outcome;
            try {
                auto batch = loader.next();
                more = batch.has_value();
                outcome = batch ? std::to_string(batch->sum().template item<int64_t>()) : "end";
            } catch (const spbcast::error& e) {
                CHECK(e.code() == spbcast::errc::loader);
                outcome = e.what();
            }
            calls[rank].push_back("step " + std::to_string(loader.step()) + " epoch " +
                                  std::to_string(loader.epoch()) + ": " + outcome);
        }
    });
    for (int rank = 0; rank < 3; ++rank) {
        CAPTURE(rank);
        REQUIRE(calls[rank].size() == 6);
        CHECK(calls[rank][0] == "step 1 epoch 0: 2");
        // A fetch that threw is no step; a refused batch is one, and names what was refused.
        CHECK(calls[rank][1].find("step 1 epoch 0: spbcast: SP rank " + std::to_string(rank) +
                                  " (leader_loader): the SP leader (SP rank 0) failed fetching step 2: "
                                  "decoder crashed on sample 2") == 0);
        CHECK(calls[rank][2].find("step 2 epoch 0: spbcast: SP rank " + std::to_string(rank) +
                                  " (leader_loader): the SP leader (SP rank 0) failed sending step 2: ") == 0);
        CHECK(calls[rank][2].find("layout is not strided") != std::string::npos);
        CHECK(calls[rank][3] == "step 3 epoch 0: 8");
        CHECK(calls[rank][4] == "step 4 epoch 0: 10");
        CHECK(calls[rank][5] == "step 4 epoch 0: end");
    }
}

TEST_CASE("a leader slower than the transport timeout is waited for, as a BASE rank waits for its own loader") {
    using namespace std::chrono_literals;
    std::vector<std::vector<int64_t>> seen(3);
    run_ranks(3, [&](int rank, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto nothing = [] {};
        using L = scripted_loader<decltype(nothing)>;
        auto loader = spbcast::make_leader_loader(
            spbcast::loader_config{.sp_media_dedup = true, .total_step = 3, .timeout = 1s}, sp, 1,
            [&] { return std::make_unique<L>(L{0, 2, 2500ms, nothing}); });
        while (auto batch = loader.next()) seen[rank].push_back(batch->at(0));
    }, 2s);  // the groups' own timeout too (LibTorch 1.13's Gloo applies only that one)
    for (const auto& s : seen) CHECK(s == std::vector<int64_t>{1, 2, 3});
}

TEST_CASE("the SP group's own timeout is read from every c10d form of a Gloo group, and from none of a user's transport") {
    using namespace std::chrono_literals;
    run_ranks(2, [&](int, auto& group) {
        auto pointer = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        CHECK(spbcast::dist::group_timeout(group) == std::chrono::milliseconds(7s));
        CHECK(spbcast::dist::group_timeout(pointer) == std::chrono::milliseconds(7s));
#if SPBCAST_TORCH_AT_LEAST(2, 0)
        c10d::Backend& backend = group;
        CHECK(spbcast::dist::group_timeout(backend) == std::chrono::milliseconds(7s));
        auto front = c10::make_intrusive<c10d::ProcessGroup>(group.getRank(), group.getSize());
        front->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                          c10::intrusive_ptr<c10d::Backend>::reclaim_copy(&group));
        front->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        CHECK(spbcast::dist::group_timeout(front) == std::chrono::milliseconds(7s));
        auto no_cpu = c10::make_intrusive<c10d::ProcessGroup>(group.getRank(), group.getSize());
        CHECK_FALSE(spbcast::dist::group_timeout(no_cpu));
#else
        c10d::ProcessGroup& base = group;
        CHECK(spbcast::dist::group_timeout(base) == std::chrono::milliseconds(7s));
#endif
        counting_group counted{group};
        CHECK_FALSE(spbcast::dist::group_timeout(counted));
    }, 7s);
}

namespace {

// Yields {1}, {2}, ... at once.
struct counting_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
    int64_t produced = 0;
    struct pass_t {
        counting_loader* self;
        std::optional<std::vector<int64_t>> next() { return std::vector<int64_t>{++self->produced}; }
    };
    pass_t begin() { return {this}; }
};

}  // namespace

TEST_CASE("a rank busy outside the loader for longer than the transport timeout is waited for, as long as the SP group's own timeout") {
    using namespace std::chrono_literals;
    // The leader late (followers wait for its first message), or a follower late (the leader's
    // first message waits for it), each with prefetch off and on.
    for (const int busy : {0, 2}) {
        for (const std::size_t prefetch : {std::size_t{0}, std::size_t{1}}) {
            CAPTURE(busy);
            CAPTURE(prefetch);
            std::vector<std::vector<int64_t>> seen(3);
            run_ranks(3, [&](int rank, auto& group) {
                auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
                auto loader = spbcast::make_leader_loader(
                    spbcast::loader_config{.sp_media_dedup = true, .total_step = 3, .timeout = 1s,
                                           .prefetch = prefetch},
                    sp, 1, [] { return std::make_unique<counting_loader>(); });
                while (auto batch = loader.next()) {
                    seen[rank].push_back(batch->at(0));
                    // Uploading a checkpoint, say: no keep-alive runs, and it outlasts timeout
                    // plus the 2 s grace of spbcast's own wait, but not the group's timeout.
                    if (rank == busy && loader.step() == 1) std::this_thread::sleep_for(3500ms);
                }
            }, 6s);
            for (const auto& s : seen) CHECK(s == std::vector<int64_t>{1, 2, 3});
        }
    }
}

TEST_CASE("a leader that hangs outside the loader fails its followers after the SP group's own timeout, or loader_config::root_wait, saying what to do") {
    using namespace std::chrono_literals;
    struct Case {
        std::chrono::milliseconds group_timeout, timeout, root_wait;
        const char* expect;
        std::chrono::milliseconds waits;  // what the followers should wait
        std::size_t prefetch = 0;
    };
    // With LibTorch 1.13's Gloo a root_wait shorter than the group's timeout ends in spbcast's
    // own wait, 2 s later (collective.hpp's grace); hence the upper bound.
    // With prefetch the follower's thread waits for the step after the one it prefetched, from
    // the call that took that one.
    // The group's timeout is the patience also where it is shorter than loader_config::timeout.
    for (const Case c : {Case{3s, 1s, 0ms, "within 3000 ms (the SP group's own timeout)", 3s},
                         Case{2s, 20s, 0ms, "within 2000 ms (the SP group's own timeout)", 2s},
                         Case{4s, 500ms, 1s, "within 1000 ms (loader_config::root_wait)", 1s},
                         Case{3s, 1s, 0ms, "within 3000 ms (the SP group's own timeout)", 3s, 1}}) {
        CAPTURE(c.expect);
        CAPTURE(c.prefetch);
        std::atomic<int> gave_up{0};
        std::vector<double> waited(3, 0);
        const auto errors = run_ranks_collect(3, [&](int rank, auto& group) {
            auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
            auto loader = spbcast::make_leader_loader(
                spbcast::loader_config{.sp_media_dedup = true, .total_step = 10, .timeout = c.timeout,
                                       .root_wait = c.root_wait, .prefetch = c.prefetch},
                sp, 1, [] { return std::make_unique<counting_loader>(); });
            REQUIRE(loader.next());
            if (rank == 0) {  // hung outside the loader; back only once the followers gave up
                const auto deadline = std::chrono::steady_clock::now() + 30s;
                while (gave_up < 2 && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(10ms);
                return;
            }
            auto start = std::chrono::steady_clock::now();
            try {
                if (c.prefetch > 0) {
                    start = std::chrono::steady_clock::now();  // taking step 2 makes room for step 3
                    REQUIRE(loader.next());  // step 2, prefetched while the leader's trainer ran step 1
                }
                loader.next();
            } catch (...) {
                waited[rank] = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
                ++gave_up;
                throw;
            }
            FAIL("a follower got a step the leader never sent");
        }, c.group_timeout);
        CHECK_MESSAGE(!errors[0], message_of(errors[0]));
        for (int rank = 1; rank < 3; ++rank) {
            CAPTURE(rank);
            REQUIRE(errors[rank]);
            const std::string message = message_of(errors[rank]);
            INFO(message);
            CHECK(message.find("spbcast: SP rank " + std::to_string(rank) +
                               " (leader_loader): the SP leader (SP rank 0) sent nothing for the next step " +
                               c.expect) == 0);
            CHECK(message.find("raise loader_config::root_wait or the SP group's timeout") != std::string::npos);
            try {
                std::rethrow_exception(errors[rank]);
            } catch (const spbcast::transport_error& e) {
                CHECK(e.code() == spbcast::errc::timeout);
            } catch (...) {
                FAIL("not a spbcast::transport_error");
            }
            const double waits = std::chrono::duration<double>(c.waits).count();
            CHECK(waited[rank] > waits - 0.3);
            CHECK(waited[rank] < waits + 2 + 4);  // the grace, and a loaded machine
        }
    }
}

TEST_CASE("GLOO_SOCKET_IFNAME may name several interfaces, as in PyTorch") {
    ::setenv("GLOO_SOCKET_IFNAME", "lo,lo", 1);
    auto store = c10::make_intrusive<c10d::HashStore>();
    const auto errors = spbcast_test::run_threads(2, [&](int rank) {
        auto group = spbcast::dist::make_gloo_group(store, rank, 2, std::chrono::seconds(10));
        wait_for_set_up(*store, rank, 2, std::chrono::seconds(10));
        at::Tensor t = rank == 0 ? at::arange(10) : at::Tensor();
        spbcast::broadcast(t, group);
        CHECK(t.equal(at::arange(10)));
    });
    ::unsetenv("GLOO_SOCKET_IFNAME");
    for (const auto& e : errors) CHECK_MESSAGE(!e, message_of(e));
}

namespace {

// Epochs of 4 batches: at(2) filled with 1, 2, 3, ... each after `delay`; its own state is the
// count produced, so a resumed pass goes on from there to the end of its epoch.
struct stateful_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
    std::chrono::milliseconds delay{0};
    int64_t produced = 0;
    int64_t size() const { return 4; }
    std::string save_state() const { return std::to_string(produced); }
    void load_state(std::string_view state) { produced = std::stoll(std::string(state)); }
    struct pass_t {
        stateful_loader* self;
        int64_t end;
        std::optional<at::Tensor> next() {
            if (self->produced == end) return std::nullopt;
            std::this_thread::sleep_for(self->delay);
            return at::full({2}, ++self->produced, at::kLong);
        }
    };
    pass_t begin() { return {this, (produced / 4 + 1) * 4}; }
};

template <class GroupArg>
auto make_stateful(spbcast::loader_config cfg, GroupArg group, std::chrono::milliseconds delay) {
    return spbcast::make_leader_loader(cfg, group, 1, [delay] {
        return std::make_unique<stateful_loader>(stateful_loader{delay});
    });
}

}  // namespace

TEST_CASE("prefetching over a channel of the user's: a trainer that all-reduces over the same SP group every step keeps working, and stats() says what happened") {
    auto store = c10::make_intrusive<c10d::HashStore>();
    std::vector<std::vector<int64_t>> seen(3);
    std::vector<spbcast::loader_stats> stats(3);
    const auto errors = spbcast_test::run_threads(3, [&](int rank) {
        auto sp = spbcast::dist::make_gloo_group(c10::make_intrusive<c10d::PrefixStore>("sp", store), rank, 3, 20s,
                                                 "127.0.0.1");
        // docs/loader.md's recipe: a second Gloo group over the same ranks, under a prefix of its own.
        auto channel = spbcast::dist::make_gloo_group(c10::make_intrusive<c10d::PrefixStore>("sp-prefetch", store),
                                                      rank, 3, 20s, "127.0.0.1");
        wait_for_set_up(*store, rank, 3, 20s);
        auto loader = make_stateful({.sp_media_dedup = true, .total_step = 8, .prefetch_channel = channel}, sp, 5ms);
        CHECK(loader.prefetch_depth() == 1);
        while (auto batch = loader.next()) {
            const int64_t value = (*batch)[0].item<int64_t>();
            seen[rank].push_back(value);
            // The step: the leader's thread fetches and sends the next batch meanwhile, over the
            // channel, while every rank all-reduces over the SP group itself.
            std::this_thread::sleep_for(50ms);
            std::vector<at::Tensor> tensors{at::full({4}, rank + value, at::kLong)};
            sp->allreduce(tensors)->wait();
            CHECK(tensors[0][3].item<int64_t>() == 3 * value + 3);
        }
        stats[rank] = loader.stats();
        sp->barrier()->wait();
    });
    for (int rank = 0; rank < 3; ++rank) {
        CAPTURE(rank);
        CHECK_MESSAGE(!errors[rank], message_of(errors[rank]));
        CHECK(seen[rank] == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 8});
        const auto& s = stats[rank];
        CHECK(s.steps == 8);
        CHECK(s.bytes == 8 * 16);
        CHECK(s.prefetch == 1);
        CHECK(s.prefetch_reason.empty());
        CHECK((s.path == "same_host" || s.path == "network"));
        CHECK(s.prefetch_hits >= 1);  // 7 steps could be; a busy machine may miss some
        CHECK(s.prefetch_hits <= 7);  // the first step and each new epoch's first are synchronous
        CHECK(s.broadcast_seconds > 0);
        CHECK(s.wait_seconds > 0);
        if (rank == 0) CHECK(s.loader_seconds >= 0.04);  // 8 fetches of 5 ms
        else CHECK(s.leader_loader_seconds >= 0.04);
    }
    // A transport of the user's has no store to lend a channel from: synchronous, and it says why.
    run_ranks(2, [](int, auto& group) {
        counting_group counted{group};
        auto loader = make_stateful({.sp_media_dedup = true, .total_step = 3}, &counted, 0ms);
        CHECK(loader.prefetch_depth() == 0);
        CHECK(loader.prefetch_reason().find("not a Gloo group") != std::string::npos);
        int steps = 0;
        while (loader.next()) ++steps;
        CHECK(steps == 3);
        CHECK(loader.stats().prefetch == 0);
        CHECK(loader.stats().prefetch_hits == 0);
    });
}

TEST_CASE("prefetching: a state saved after step t resumes at t+1 although t+1 was fetched; load_state mid-run drops it on every rank") {
    std::vector<std::vector<int64_t>> continuous(3), resumed(3), rewound(3);
    std::string leader_state;
    run_ranks(3, [&](int rank, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        const spbcast::loader_config cfg{.sp_media_dedup = true, .total_step = 10};
        auto record = [](auto& loader, std::vector<int64_t>& into) {
            while (auto batch = loader.next()) into.push_back((*batch)[0].template item<int64_t>() * 100 + loader.epoch());
        };
        std::string state;
        {
            auto loader = make_stateful(cfg, sp, 2ms);
            while (auto batch = loader.next()) {
                continuous[rank].push_back((*batch)[0].template item<int64_t>() * 100 + loader.epoch());
                if (loader.step() == 3) {
                    std::this_thread::sleep_for(100ms);  // step 4 is fetched by now
                    state = loader.save_state();
                }
            }
        }
        if (rank == 0) leader_state = state;
        {
            auto loader = make_stateful(cfg, sp, 2ms);  // a new job, resumed (followers: nothing)
            loader.load_state(state);
            record(loader, resumed[rank]);
        }
        {
            auto loader = make_stateful(cfg, sp, 2ms);
            for (int step = 0; step < 6; ++step) REQUIRE(loader.next());
            std::this_thread::sleep_for(100ms);  // step 7 is fetched and sent by now
            loader.load_state(state);            // every rank, mid-run: back to step 3
            CHECK(loader.step() == (rank == 0 ? 3 : 6));  // followers learn it from the next step
            record(loader, rewound[rank]);
        }
    });
    // The consumed position and the loader's own state before step 4's fetch.
    CHECK(leader_state == "spbcast.leader_loader v1 epoch=0 step=3 in_epoch=3\n3");
    for (int rank = 0; rank < 3; ++rank) {
        CAPTURE(rank);
        REQUIRE(continuous[rank].size() == 10);
        CHECK(continuous[rank] == continuous[0]);
        const std::vector<int64_t> tail(continuous[rank].begin() + 3, continuous[rank].end());
        CHECK(resumed[rank] == tail);
        CHECK(rewound[rank] == tail);
    }
    CHECK(continuous[0][4] == 501);  // the second epoch starts at its 5th batch
}

TEST_CASE("prefetching: destroying the loader mid-epoch joins its thread at once; a follower that goes on alone is told the leader stopped") {
    const auto start = std::chrono::steady_clock::now();
    run_ranks(3, [](int, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        auto loader = make_stateful({.sp_media_dedup = true, .total_step = 100}, sp, 10ms);
        for (int step = 0; step < 3; ++step) REQUIRE(loader.next());
    });  // every rank leaves its loop with step 4 in flight
    // A follower that waited for a leader that never sends would wait root_wait: 5 minutes here.
    CHECK(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < 60);

    const auto errors = run_ranks_collect(3, [](int rank, auto& group) {
        auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
        {
            auto loader = make_stateful({.sp_media_dedup = true, .total_step = 100}, sp, 10ms);
            REQUIRE(loader.next());
            REQUIRE(loader.next());
            if (rank != 0)
                for (int step = 0; step < 3; ++step) loader.next();  // at most the one prefetched, then the error
        }  // the leader's trainer leaves here (as one that raised would)
        if (rank != 0) FAIL("a follower went on although the leader's loader was destroyed");
    });
    CHECK_MESSAGE(!errors[0], message_of(errors[0]));
    for (int rank = 1; rank < 3; ++rank) {
        CAPTURE(rank);
        REQUIRE(errors[rank]);
        CHECK_MESSAGE(message_of(errors[rank]).find("spbcast: SP rank " + std::to_string(rank) +
                                                    " (leader_loader): the SP leader's leader_loader was destroyed") == 0,
                      message_of(errors[rank]));
    }
}

namespace {

// Fetch 3 yields a sparse tensor (spbcast refuses to send it), fetch 5 throws.
struct ahead_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
    int produced = 0;
    struct pass_t {
        ahead_loader* self;
        std::optional<at::Tensor> next() {
            ++self->produced;
            if (self->produced == 3) return at::arange(4).to_sparse();
            if (self->produced == 5) throw std::runtime_error("decoder crashed on sample 5");
            return at::full({2}, self->produced, at::kLong);
        }
    };
    pass_t begin() { return {this}; }
};

}  // namespace

TEST_CASE("prefetching: a refused batch and a failed fetch fetched ahead surface at their own step on every rank, as without prefetch") {
    // Fetch 3 yields a sparse tensor (refused), fetch 5 throws; both happen on the leader's thread
    // while the trainer runs the step before.
    std::map<std::size_t, std::vector<std::vector<std::string>>> calls;
    for (std::size_t prefetch : {0, 1}) {
        calls[prefetch].resize(3);
        run_ranks(3, [&](int rank, auto& group) {
            auto sp = c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&group);
            auto loader = spbcast::make_leader_loader(
                spbcast::loader_config{.sp_media_dedup = true, .total_step = 6, .prefetch = prefetch}, sp, 1,
                [] { return std::make_unique<ahead_loader>(); });
            for (bool more = true; more;) {
                std::string outcome;
                try {
                    auto batch = loader.next();
                    more = batch.has_value();
                    outcome = batch ? std::to_string((*batch)[0].template item<int64_t>()) : "end";
                } catch (const spbcast::error& e) {
                    const std::string what = e.what();
                    outcome = what.substr(what.find("failed"), what.find(':', what.find("failed")) - what.find("failed"));
                }
                calls[prefetch][rank].push_back("step " + std::to_string(loader.step()) + ": " + outcome);
                std::this_thread::sleep_for(20ms);  // the step, while the next fetch runs ahead
            }
        });
    }
    const std::vector<std::string> expected{"step 1: 1", "step 2: 2", "step 3: failed sending step 3",
                                            "step 4: 4", "step 4: failed fetching step 5", "step 5: 6",
                                            "step 6: 7", "step 6: end"};
    for (int rank = 0; rank < 3; ++rank) {
        CAPTURE(rank);
        CHECK(calls[1][rank] == expected);
        CHECK(calls[0][rank] == expected);
    }
}
