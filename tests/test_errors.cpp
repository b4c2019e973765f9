// Bad input gives a clear spbcast::error on every rank - naming the field, the rank and the
// fix - and never a hang; the group stays usable afterwards.
#include "profiles.hpp"
#include "support/roundtrip.hpp"

#include <spbcast/digest.hpp>

using namespace spbcast_test;

namespace {

template <class E>
E as(const std::exception_ptr& e) {
    try {
        std::rethrow_exception(e);
    } catch (const E& ex) {
        return ex;
    } catch (const std::exception& other) {
        FAIL("unexpected exception type: " << other.what());
    }
    throw std::logic_error("unreachable");
}

struct Different {
    std::vector<at::Tensor> tensors;
    int64_t extra;
};

}  // namespace

TEST_CASE("a follower built with another batch type drains, explains both schemas, and the next step works") {
    const auto errors = run_ranks_collect(3, [](int rank, auto& group) {
        if (rank == 2) {
            Different wrong{};
            CHECK_THROWS_AS(spbcast::broadcast(wrong, group), spbcast::schema_error);
            try {
                spbcast::broadcast(wrong, group);
            } catch (const spbcast::schema_error& e) {
                const std::string message = e.what();
                CHECK(message.find("rank 2") != std::string::npos);
                CHECK(message.find("this rank: ") != std::string::npos);
                CHECK(message.find("list<xtuner::Item{seq_ctx:") != std::string::npos);
                CHECK(e.root_schema() == spbcast::schema_of<xtuner::Batch>);
            }
        } else {
            for (int step = 0; step < 2; ++step) {
                xtuner::Batch batch = rank == 0 ? xtuner::make_batch(xtuner::profile::qwen3_vl_image, 1, 1)
                                                : xtuner::Batch{};
                spbcast::broadcast(batch, group);
            }
        }
        // The group is still in step: every rank now agrees on the type.
        xtuner::Batch batch = rank == 0 ? xtuner::make_batch(xtuner::profile::text, 1, 2) : xtuner::Batch{};
        spbcast::broadcast(batch, group);
        CHECK(spbcast::digest(batch) == spbcast::digest(xtuner::make_batch(xtuner::profile::text, 1, 2)));
    });
    for (const auto& e : errors) CHECK_FALSE(e);
}

TEST_CASE("an unsendable tensor fails on the root with its path, and every follower gets the root's message") {
    const auto errors = run_ranks_collect(3, [](int rank, auto& group) {
        xtuner::Batch batch;
        if (rank == 0) {
            batch = xtuner::make_batch(xtuner::profile::text, 2, 1);
            batch[1].seq_ctx.pixel_values = at::empty({2, 3}, at::TensorOptions().device(at::kMeta));
        }
        spbcast::broadcast(batch, group);
    });
    REQUIRE(errors[0]);
    const auto root = as<spbcast::error>(errors[0]);
    CHECK(root.code() == spbcast::errc::unsupported_value);
    CHECK(std::string(root.what()).find("batch[1].seq_ctx.pixel_values") != std::string::npos);
    CHECK(std::string(root.what()).find("meta") != std::string::npos);
    for (int rank : {1, 2}) {
        REQUIRE(errors[rank]);
        const auto remote = as<spbcast::remote_error>(errors[rank]);
        CHECK(remote.root_rank() == 0);
        CHECK(remote.root_message() == std::string(root.what()));
        CHECK(std::string(remote.what()).find("rank " + std::to_string(rank)) != std::string::npos);
    }
}

TEST_CASE("a bad root is refused on every rank before any collective") {
    const auto errors = run_ranks_collect(2, [](int, auto& group) {
        std::vector<int64_t> value{1};
        spbcast::broadcast(value, group, {.root = 5});
    });
    for (const auto& e : errors) {
        REQUIRE(e);
        CHECK(as<spbcast::error>(e).code() == spbcast::errc::invalid_argument);
        CHECK(message_of(e).find("options.root = 5") != std::string::npos);
    }
}
