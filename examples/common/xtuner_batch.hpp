// The collated batch of a multimodal trainer, laid out like XTuner v1's collators produce it
// (see shared/batches.md). Tests, the demo and the benchmarks all use these types, so that
// what we measure and check is what real trainers send.
#pragma once

#include <ATen/ATen.h>
#include <boost/hana/define_struct.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace xtuner {

struct SequenceContext {
    BOOST_HANA_DEFINE_STRUCT(SequenceContext,
        (at::Tensor, input_ids),                 // int64 (1, L), padded to the pack length
        (at::Tensor, cu_seq_lens_q),             // int32 (nseq + 1,)
        (at::Tensor, cu_seq_lens_k),             // the same tensor object as cu_seq_lens_q
        (at::Tensor, max_length_q),              // int64, 0-dim
        (at::Tensor, max_length_k),              // int64, 0-dim
        (int64_t, num_padding),                  // trailing pad tokens
        (at::Tensor, position_ids),              // int64 (1, L) or (3, 1, L) (an expand)
        (std::optional<at::Tensor>, pixel_values),     // float32 (patches, 1536) or (tiles, 3, 448, 448)
        (std::optional<at::Tensor>, image_grid_thw),   // int64 (n_images, 3)
        (std::optional<std::vector<std::vector<int64_t>>>, num_img_tokens),
        (std::optional<at::Tensor>, inputs_embeds),
        (std::optional<at::Tensor>, block_table),
        (std::optional<at::Tensor>, rollout_routed_experts),
        (std::string, device));
};

struct Item {
    BOOST_HANA_DEFINE_STRUCT(Item,
        (SequenceContext, seq_ctx),
        (at::Tensor, shifted_labels));           // int64 (1, L), padding is -100
};

using Batch = std::vector<Item>;

}  // namespace xtuner
