// A small real media pipeline for loader tests: JPEGs generated once into a cache folder and
// decoded per sample (examples/demo), sized so an epoch takes milliseconds.
#pragma once

#include "demo/loader.hpp"

#include <filesystem>

namespace spbcast_test {

inline demo::PipelineConfig small_pipeline(int num_workers, bool persistent, int dp_rank = 0, int dp_size = 1) {
    demo::PipelineConfig cfg;
    cfg.cache_dir = std::filesystem::temp_directory_path() / "spbcast-test-media";
    cfg.num_samples = 48;
    cfg.image_size = 64;
    cfg.images_per_sample = 1;
    cfg.video_frames = 2;
    cfg.max_text_tokens = 256;
    cfg.pack_length = 1024;
    cfg.micro_batches = 1;
    cfg.num_workers = num_workers;
    cfg.persistent_workers = persistent;
    cfg.seed = 7;
    cfg.dp_rank = dp_rank;
    cfg.dp_size = dp_size;
    return cfg;
}

// The default CPU generator's state as bytes, to compare RNG progressions to the bit.
inline std::vector<uint8_t> default_generator_state() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = gen.get_state();
    const auto* p = state.data_ptr<uint8_t>();
    return {p, p + state.numel()};
}

}  // namespace spbcast_test
