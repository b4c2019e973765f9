// Synthetic batches with the shapes of shared/batches.md's measurement profiles. The values
// are random but deterministic in the seed, and drawn from a private generator so that making
// a batch never moves the default CPU generator (the RNG-parity tests depend on that).
#pragma once

#include "xtuner_batch.hpp"

#include <ATen/CPUGeneratorImpl.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace xtuner {

enum class profile { text, qwen3_vl_image, interns1_tiles, qwen3_vl_video_long };

inline constexpr profile all_profiles[] = {profile::text, profile::qwen3_vl_image,
                                           profile::interns1_tiles,
                                           profile::qwen3_vl_video_long};

inline std::string_view profile_name(profile p) {
    switch (p) {
        case profile::text: return "text";
        case profile::qwen3_vl_image: return "qwen3-vl-image";
        case profile::interns1_tiles: return "interns1-tiles";
        case profile::qwen3_vl_video_long: return "qwen3-vl-video-long";
    }
    return "?";
}

inline profile profile_from_name(std::string_view name) {
    for (profile p : all_profiles)
        if (profile_name(p) == name) return p;
    throw std::invalid_argument("unknown profile '" + std::string(name) +
                                "' (text, qwen3-vl-image, interns1-tiles, qwen3-vl-video-long)");
}

struct profile_shape {
    int64_t pack_length;
    int64_t media_rows;     // patches (qwen3-vl) or tiles (interns1); 0 for text
    bool tiles;             // InternS1 (tiles, 3, 448, 448) instead of (patches, 1536)
    bool rope_3d;           // Qwen3-VL's (3, 1, L) position ids
};

inline profile_shape shape_of(profile p) {
    switch (p) {
        case profile::text: return {32768, 0, false, false};
        case profile::qwen3_vl_image: return {32768, 8192, false, true};
        case profile::interns1_tiles: return {16384, 12, true, false};
        case profile::qwen3_vl_video_long: return {131072, 32768, false, true};
    }
    return {};
}

// One packed micro-batch: sequences of random length, padding split into 256-token segments,
// cu_seq_lens_k the same tensor object as cu_seq_lens_q, position ids built with expand.
inline Item make_item(const profile_shape& shape, at::Generator& gen) {
    const int64_t L = shape.pack_length;
    const auto i64 = at::TensorOptions().dtype(at::kLong);
    Item item;
    SequenceContext& ctx = item.seq_ctx;

    std::vector<int32_t> cu{0};
    int64_t used = 0;
    const int64_t min_len = 512, max_len = L / 3;
    while (true) {
        const int64_t len =
            min_len + at::randint(max_len - min_len, {1}, gen, i64).item<int64_t>();
        if (used + len > L - 256) break;
        used += len;
        cu.push_back(static_cast<int32_t>(used));
    }
    const int64_t num_sequences = static_cast<int64_t>(cu.size()) - 1;
    ctx.num_padding = L - used;
    for (int64_t pad = ctx.num_padding; pad > 0; pad -= 256)
        cu.push_back(static_cast<int32_t>(cu.back() + std::min<int64_t>(pad, 256)));

    ctx.input_ids = at::randint(151000, {1, L}, gen, i64);
    ctx.input_ids.narrow(1, used, L - used).fill_(151643);
    ctx.cu_seq_lens_q = at::tensor(cu, at::kInt);
    ctx.cu_seq_lens_k = ctx.cu_seq_lens_q;
    int64_t longest = 0;
    for (size_t i = 1; i < cu.size(); ++i) longest = std::max<int64_t>(longest, cu[i] - cu[i - 1]);
    ctx.max_length_q = at::scalar_tensor(longest, i64);
    ctx.max_length_k = at::scalar_tensor(longest, i64);
    at::Tensor positions = at::arange(L, i64).view({1, 1, L});
    ctx.position_ids = shape.rope_3d ? positions.expand({3, 1, L}) : positions.view({1, L});
    item.shifted_labels = at::randint(151000, {1, L}, gen, i64);
    item.shifted_labels.narrow(1, used, L - used).fill_(-100);
    ctx.device = "cpu";

    if (shape.media_rows > 0) {
        const auto f32 = at::TensorOptions().dtype(at::kFloat);
        if (shape.tiles) {
            ctx.pixel_values = at::randn({shape.media_rows, 3, 448, 448}, gen, f32);
        } else {
            ctx.pixel_values = at::randn({shape.media_rows, 1536}, gen, f32);
            // Images of 16x16 patch grids, one per packed sample until the rows run out.
            const int64_t per_image = 1024;
            const int64_t images = shape.media_rows / per_image;
            ctx.image_grid_thw = at::tensor(std::vector<int64_t>{1, 32, 32}, i64)
                                     .repeat({images, 1});
        }
        std::vector<std::vector<int64_t>> tokens;
        for (int64_t s = 0; s < num_sequences; ++s)
            tokens.push_back(s == 0 ? std::vector<int64_t>{shape.media_rows / 4}
                                    : std::vector<int64_t>{0});
        ctx.num_img_tokens = std::move(tokens);
    }
    return item;
}

inline Batch make_batch(profile p, int micro_batches, uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    Batch batch;
    for (int m = 0; m < micro_batches; ++m) batch.push_back(make_item(shape_of(p), gen));
    return batch;
}

}  // namespace xtuner
