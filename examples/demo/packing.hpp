// Soft packing, as XTuner does it: the samples of one micro-batch are laid end to end in a
// sequence of pack_length tokens, separated by cu_seq_lens for varlen attention, and the rest is
// padding. The result is one xtuner::Item in the layout of shared/batches.md.
#pragma once

#include "../common/xtuner_batch.hpp"
#include "dataset.hpp"

#include <ATen/ATen.h>
#include <spbcast/shared_memory.hpp>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace demo {

// Padding is cut into sequences of at most this many tokens, so that it never becomes the
// longest sequence the attention kernel has to handle.
inline constexpr int64_t kPaddingSegment = 256;

// Greedy in sample order: a pack closes when the next sample does not fit. The plan needs only
// the sample lengths, not the media, so it is made once up front and the loader knows its
// length before it loads anything (XTuner plans its packs up front for the same reason).
inline std::vector<std::vector<int64_t>> plan_packs(const Dataset& dataset, int64_t pack_length) {
    std::vector<std::vector<int64_t>> packs;
    int64_t used = 0;
    for (int64_t i = 0; i < dataset.size(); ++i) {
        const int64_t n = dataset.info(i).num_tokens();
        if (n > pack_length)
            throw std::invalid_argument(
                "sample " + std::to_string(i) + " has " + std::to_string(n) +
                " tokens, more than pack_length " + std::to_string(pack_length) +
                "; raise pack_length or lower image_size, images_per_sample, video_frames or max_text_tokens");
        if (packs.empty() || used + n > pack_length) {
            packs.emplace_back();
            used = 0;
        }
        packs.back().push_back(i);
        used += n;
    }
    return packs;
}

// Loads the samples (decoding their media into one pixel_values tensor) and packs them.
// pixel_values, image_grid_thw and num_img_tokens are absent when no sample has media. With
// `in_shared_memory` the output tensors are allocated in spbcast's shared memory (only they:
// the decoded media are temporaries).
inline xtuner::Item pack_samples(const Dataset& dataset, std::span<const int64_t> samples, int64_t pack_length,
                                 bool in_shared_memory = false) {
    const int64_t L = pack_length;
    int64_t tokens = 0, rows = 0;
    for (int64_t s : samples) {
        tokens += dataset.info(s).num_tokens();
        rows += dataset.info(s).num_patches();
    }
    if (tokens > L)
        throw std::invalid_argument("pack_samples: the samples hold " + std::to_string(tokens) +
                                    " tokens, more than pack_length " + std::to_string(L));

    const auto i64 = at::TensorOptions().dtype(at::kLong);
    std::optional<spbcast::shared_memory_scope> shared;
    if (in_shared_memory) shared.emplace();
    at::Tensor input_ids = at::full({1, L}, kPadTokenId, i64);
    at::Tensor labels = at::full({1, L}, kIgnoreLabel, i64);
    at::Tensor positions = at::empty({3, 1, L}, i64);
    at::Tensor pixels = at::empty({rows, kPatchRowSize}, at::TensorOptions().dtype(at::kFloat));
    shared.reset();
    int64_t* ids = input_ids.data_ptr<int64_t>();
    int64_t* label = labels.data_ptr<int64_t>();
    int64_t* pos = positions.data_ptr<int64_t>();

    std::vector<int32_t> cu{0};
    std::vector<int64_t> grid;
    std::vector<std::vector<int64_t>> img_tokens;
    int64_t cursor = 0, row = 0;
    for (int64_t s : samples) {
        const SampleInfo& info = dataset.info(s);
        const int64_t n = info.num_tokens(), patches = info.num_patches();
        const Sample sample =
            dataset.load(s, std::span(pixels.data_ptr<float>() + row * kPatchRowSize,
                                      static_cast<size_t>(patches * kPatchRowSize)));
        std::copy(sample.input_ids.begin(), sample.input_ids.end(), ids + cursor);
        std::copy(sample.shifted_labels.begin(), sample.shifted_labels.end(), label + cursor);
        for (int64_t axis = 0; axis < 3; ++axis)
            std::copy(sample.position_ids[axis].begin(), sample.position_ids[axis].end(), pos + axis * L + cursor);
        cursor += n;
        row += patches;
        cu.push_back(static_cast<int32_t>(cursor));

        std::vector<int64_t> per_media;
        for (const MediaInfo& m : info.media) {
            grid.insert(grid.end(), {m.grid_t(), m.grid_h(), m.grid_w()});
            per_media.push_back(m.patches());
        }
        img_tokens.push_back(per_media.empty() ? std::vector<int64_t>{0} : per_media);
    }

    xtuner::Item item;
    xtuner::SequenceContext& ctx = item.seq_ctx;
    ctx.num_padding = L - cursor;
    while (cursor < L) {
        const int64_t segment = std::min(kPaddingSegment, L - cursor);
        for (int64_t axis = 0; axis < 3; ++axis)
            for (int64_t k = 0; k < segment; ++k) pos[axis * L + cursor + k] = k;
        cursor += segment;
        cu.push_back(static_cast<int32_t>(cursor));
    }
    int64_t longest = 0;
    for (size_t k = 1; k < cu.size(); ++k) longest = std::max<int64_t>(longest, cu[k] - cu[k - 1]);

    ctx.input_ids = input_ids;
    ctx.cu_seq_lens_q = at::tensor(cu, at::kInt);
    ctx.cu_seq_lens_k = ctx.cu_seq_lens_q;  // one tensor, two names, as XTuner's collator has it
    ctx.max_length_q = at::scalar_tensor(longest, i64);
    ctx.max_length_k = at::scalar_tensor(longest, i64);
    ctx.position_ids = positions;
    if (rows > 0) {
        ctx.pixel_values = pixels;
        ctx.image_grid_thw = at::tensor(grid, i64).view({-1, 3});
        ctx.num_img_tokens = std::move(img_tokens);
    }
    ctx.device = "cpu";
    item.shifted_labels = labels;
    return item;
}

}  // namespace demo
