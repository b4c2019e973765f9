// The batches real multimodal trainers send (shared/batches.md), rebuilt bit-exactly: the
// cu_seq_lens alias, expanded 3-D position ids, media present and absent, nested token lists.
#include "profiles.hpp"
#include "support/roundtrip.hpp"

using namespace spbcast_test;

TEST_CASE("text batches, every world size and root") {
    for (int world : {2, 3, 4})
        for (int root = 0; root < world; ++root)
            roundtrip<xtuner::Batch>(world, root, [] { return xtuner::make_batch(xtuner::profile::text, 2, 11); });
}

TEST_CASE("media batches: qwen3-vl image and interns1 tiles, 1 and 4 micro-batches") {
    for (auto profile : {xtuner::profile::qwen3_vl_image, xtuner::profile::interns1_tiles})
        for (int micro_batches : {1, 4}) {
            CAPTURE(xtuner::profile_name(profile));
            CAPTURE(micro_batches);
            roundtrip<xtuner::Batch>(3, 1, [&] { return xtuner::make_batch(profile, micro_batches, 5); });
        }
}

TEST_CASE("the structure a trainer relies on survives") {
    run_ranks(2, [](int rank, auto& group) {
        xtuner::Batch batch;
        if (rank == 0) {
            batch = xtuner::make_batch(xtuner::profile::qwen3_vl_image, 2, 3);
            batch[1].seq_ctx.pixel_values.reset();  // a text-only micro-batch next to a media one
            batch[1].seq_ctx.num_img_tokens = std::vector<std::vector<int64_t>>{};
            batch[1].seq_ctx.block_table = at::arange(8, at::kInt).view({2, 4});
        }
        spbcast::broadcast(batch, group);
        REQUIRE(batch.size() == 2);
        const auto& ctx = batch[0].seq_ctx;
        CHECK(ctx.cu_seq_lens_k.is_same(ctx.cu_seq_lens_q));
        CHECK(ctx.position_ids.sizes().vec() == std::vector<int64_t>{3, 1, 32768});
        CHECK(ctx.position_ids.stride(0) == 0);
        CHECK(ctx.pixel_values.has_value());
        CHECK_FALSE(ctx.inputs_embeds.has_value());
        CHECK_FALSE(batch[1].seq_ctx.pixel_values.has_value());
        CHECK(batch[1].seq_ctx.num_img_tokens.has_value());
        CHECK(batch[1].seq_ctx.num_img_tokens->empty());
        CHECK(batch[1].seq_ctx.block_table.has_value());
        CHECK(ctx.device == "cpu");
    });
}
