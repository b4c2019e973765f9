// Where followers receive: large storages into memory that dropped batches gave back (the
// receive cache), small ones left in their bucket as storages of their own.
#include "support/identical.hpp"
#include "support/ranks.hpp"

#include <spbcast/broadcast.hpp>

#include <chrono>
#include <thread>

using namespace spbcast_test;

namespace {

struct Media {
    at::Tensor pixels;  // 6 MiB: sent in place, received into the cache
    at::Tensor grid;    // small: coalesced into a bucket
    at::Tensor mask;    // small: the same bucket
};

Media make_media(int64_t step) {
    return Media{at::arange(step, step + (3 << 19), at::kFloat).view({-1, 1024}),
                 at::arange(step, step + 12, at::kLong).view({4, 3}),
                 at::arange(step, step + 64, at::kInt).remainder(2).to(at::kBool)};
}

// Broadcasts `steps` batches from rank 0 to rank 1 over the network path (the receive cache is
// its memory; the same-host path maps the root's segments instead); `follower` sees each one
// rank 1 received.
template <class Follower>
void two_ranks(int steps, Follower follower) {
    run_ranks(2, [&](int rank, auto& group) {
        for (int step = 0; step < steps; ++step) {
            Media batch = rank == 0 ? make_media(step) : Media{};
            spbcast::broadcast(batch, group, {.transport = spbcast::transport_mode::network});
            if (rank == 1) follower(step, batch);
        }
    });
}

// Gloo's worker thread drops its reference to a received buffer a moment after the broadcast
// returns (and a destroyed group's threads end only at the next spbcast call): waits up to 10 s
// for the cache to hold `bytes`, then returns what it holds.
std::size_t cached_bytes_once_at_least(std::size_t bytes) {
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    std::size_t cached = spbcast::receive_cache_statistics().cached_bytes;
    while (cached < bytes && std::chrono::steady_clock::now() < deadline) {
        std::this_thread::sleep_for(1ms);
        cached = spbcast::receive_cache_statistics().cached_bytes;
    }
    return cached;
}

}  // namespace

TEST_CASE("a follower receives large storages into memory its dropped batches gave back") {
    Media kept;
    two_ranks(3, [&](int step, Media& batch) {
        require_identical(make_media(step), batch);
        // A batch the application keeps is never received into: step 2 arrives elsewhere.
        if (step == 1) kept = batch;
        if (step == 2) {
            CHECK(batch.pixels.data_ptr() != kept.pixels.data_ptr());
            require_identical(make_media(1), kept);
        }
    });
    kept = Media{};
    // Every batch is dropped now: their 6 MiB blocks are in the cache, and the next batch uses one.
    CHECK(cached_bytes_once_at_least(std::size_t{6} << 20) >= std::size_t{6} << 20);
    const auto before = spbcast::receive_cache_statistics();
    REQUIRE(before.limit_bytes > 0);
    two_ranks(1, [](int, Media& batch) { require_identical(make_media(0), batch); });
    const auto after = spbcast::receive_cache_statistics();
    CHECK(after.blocks_reused - before.blocks_reused == 1);
    CHECK(after.blocks_allocated == before.blocks_allocated);
}

TEST_CASE("set_receive_cache_limit(0) empties the cache and gives every batch fresh memory") {
    spbcast::set_receive_cache_limit(0);
    CHECK(spbcast::receive_cache_statistics().cached_bytes == 0);
    const auto before = spbcast::receive_cache_statistics();
    two_ranks(3, [](int step, Media& batch) { require_identical(make_media(step), batch); });
    const auto after = spbcast::receive_cache_statistics();
    CHECK(after.blocks_reused == before.blocks_reused);
    CHECK(after.blocks_allocated - before.blocks_allocated == 3);
    CHECK(after.cached_bytes == 0);
    spbcast::set_receive_cache_limits(spbcast::default_receive_cache_limits);
}

TEST_CASE("storages received in one bucket are separate storages: writes and resizes stay apart") {
    two_ranks(1, [](int, Media& batch) {
        CHECK_FALSE(batch.grid.storage().is_alias_of(batch.mask.storage()));
        CHECK(batch.grid.storage().nbytes() == 12 * sizeof(int64_t));
        batch.grid.fill_(-1);
        require_identical(make_media(0).mask, batch.mask);
        // A resize moves the storage out of the bucket and keeps its values.
        batch.mask.resize_({1 << 20});
        CHECK(batch.mask.narrow(0, 0, 64).equal(make_media(0).mask));
        batch.pixels.resize_({4096, 1024});
        CHECK(batch.pixels.narrow(0, 0, 1536).equal(make_media(0).pixels));
    });
}

TEST_CASE("small broadcasts between big ones do not evict the blocks the next big batch reuses") {
    spbcast::set_receive_cache_limit(0);  // start from an empty cache
    spbcast::set_receive_cache_limits(spbcast::default_receive_cache_limits);
    std::size_t reused = 0, allocated = 0;
    run_ranks(2, [&](int rank, auto& group) {
        for (int step = 0; step < 2; ++step) {
            {
                Media batch = rank == 0 ? make_media(step) : Media{};
                spbcast::broadcast(batch, group, {.transport = spbcast::transport_mode::network});
                if (rank == 1) require_identical(make_media(step), batch);
            }
            if (step == 0 && rank == 1) {
                CHECK(cached_bytes_once_at_least(std::size_t{6} << 20) >= std::size_t{6} << 20);
                const auto s = spbcast::receive_cache_statistics();
                reused = s.blocks_reused;
                allocated = s.blocks_allocated;
            }
            // A loader's envelope, a metrics broadcast: small, between two big batches.
            for (int small = 0; small < 3; ++small) {
                std::pair<int64_t, at::Tensor> metrics{small, at::full({16}, small)};
                spbcast::broadcast(metrics, group, {.transport = spbcast::transport_mode::network});
            }
        }
    });
    const auto after = spbcast::receive_cache_statistics();
    CHECK(after.blocks_reused - reused == 1);
    CHECK(after.blocks_allocated == allocated);
}

TEST_CASE("a small tensor a follower keeps pins memory in proportion to itself, not its bucket") {
    spbcast::set_receive_cache_limit(0);
    spbcast::set_receive_cache_limits(spbcast::default_receive_cache_limits);
    auto make = [] {
        std::vector<at::Tensor> batch;  // 40 x 64 KiB: one bucket of 2.5 MiB, from the cache
        for (int i = 0; i < 40; ++i) batch.push_back(at::full({16384}, i, at::kInt));
        return batch;
    };
    at::Tensor kept;
    run_ranks(2, [&](int rank, auto& group) {
        std::vector<at::Tensor> batch = rank == 0 ? make() : std::vector<at::Tensor>{};
        spbcast::broadcast(batch, group, {.transport = spbcast::transport_mode::network});
        if (rank == 1) kept = batch[3];
    });
    REQUIRE(kept.defined());
    require_identical(make()[3], kept);
    CHECK(kept.storage().nbytes() == 16384 * sizeof(int32_t));
    // The bucket went back to the cache although a tensor that arrived in it is alive.
    CHECK(cached_bytes_once_at_least(std::size_t{40} * 65536) >= std::size_t{40} * 65536);
}

TEST_CASE("the receive cache's budget follows the batch size: batches above the base limit are reused") {
    // A base of 1 MiB with the budget following the batch size (the default does so at 2 GiB):
    // 6 MiB batches are received into the first one's memory from the second on.
    CHECK(spbcast::default_receive_cache_limits.bytes == spbcast::default_receive_cache_limit);
    CHECK(spbcast::default_receive_cache_limits.batches == 2);
    CHECK(spbcast::receive_cache_limits{}.batches == 0);  // limits a user fills in are fixed
    for (const bool follows : {true, false}) {
        CAPTURE(follows);
        spbcast::set_receive_cache_limit(0);  // an empty cache
        if (follows)
            spbcast::set_receive_cache_limits({.bytes = 1 << 20, .batches = 2});
        else
            spbcast::set_receive_cache_limit(1 << 20);  // the user's bound: it rules
        const auto before = spbcast::receive_cache_statistics();
        run_ranks(2, [&](int rank, auto& group) {
            for (int step = 0; step < 3; ++step) {
                {
                    Media batch = rank == 0 ? make_media(step) : Media{};
                    spbcast::broadcast(batch, group, {.transport = spbcast::transport_mode::network});
                    if (rank == 1) require_identical(make_media(step), batch);
                }
                // Dropped: with the budget following the batch, its 6 MiB block is kept.
                if (rank == 1 && follows) CHECK(cached_bytes_once_at_least(std::size_t{6} << 20) >= std::size_t{6} << 20);
            }
        });
        const auto after = spbcast::receive_cache_statistics();
        CHECK(after.largest_batch_bytes >= std::size_t{6} << 20);
        if (follows) {
            CHECK(after.limit_bytes == 2 * after.largest_batch_bytes);
            CHECK(after.blocks_reused - before.blocks_reused == 2);
            CHECK(after.blocks_allocated - before.blocks_allocated == 1);
        } else {
            CHECK(after.limit_bytes == std::size_t{1} << 20);
            CHECK(after.blocks_reused == before.blocks_reused);
            CHECK(after.blocks_allocated - before.blocks_allocated == 3);
            CHECK(after.cached_bytes == 0);
        }
    }
    spbcast::set_receive_cache_limits(spbcast::default_receive_cache_limits);
    const auto in_use = spbcast::receive_cache_limits_in_use();
    CHECK(in_use.bytes == spbcast::default_receive_cache_limit);
    CHECK(in_use.batches == 2);
    CHECK(spbcast::receive_cache_statistics().limit_bytes >= spbcast::default_receive_cache_limit);
}
