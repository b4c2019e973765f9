// The demo pipeline's settings in one place: the dataset (what is generated into the cache),
// the packing and the loader. validate() runs before anything is generated or loaded, so a bad
// setting fails with its own message instead of somewhere deep in the pipeline.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <stdexcept>
#include <string>

namespace demo {

struct PipelineConfig {
    // Dataset. The media are generated once into a subfolder of cache_dir named after these
    // settings, and reused by every later run with the same settings. With the defaults a pack
    // of 32768 tokens holds about 14 samples and 7700 patch rows (47 MiB), close to the
    // qwen3-vl image profile of shared/batches.md.
    std::filesystem::path cache_dir = std::filesystem::temp_directory_path() / "spbcast-demo-media";
    int64_t num_samples = 512;
    int image_size = 448;         // largest side in pixels; each image's sides are drawn from
                                  // the multiples of 32 in [image_size / 2, image_size]
    int images_per_sample = 2;    // each sample has 0..images_per_sample media items
    int video_frames = 4;         // JPEG frames per video
    double videos_ratio = 0.25;   // share of the media items that are videos
    int max_text_tokens = 4096;   // text tokens per sample are drawn from [16, max_text_tokens]
    uint64_t seed = 0;            // content of the samples and the shuffling order

    // Packing and collation.
    int64_t pack_length = 32768;  // tokens per packed micro-batch (L)
    int micro_batches = 1;        // packs per collated batch

    // Loader, with PyTorch DataLoader's meaning.
    int num_workers = 2;          // 0 loads in the calling thread
    bool persistent_workers = false;
    int prefetch_factor = 2;      // batches in flight per worker
    // The collated tensors of at least 1 MiB are allocated in spbcast's shared memory
    // (spbcast::shared_memory_scope), for an SP leader on the same-host path.
    bool collate_in_shared_memory = false;

    // Data parallelism: each DP replica reads its own share of every epoch, like
    // DistributedSampler. The SP ranks of one replica share a loader, so this is the DP rank.
    int dp_rank = 0;
    int dp_size = 1;
};

inline void validate(const PipelineConfig& c) {
    auto fail = [](const std::string& what) {
        throw std::invalid_argument("demo::PipelineConfig: " + what);
    };
    if (c.cache_dir.empty()) fail("cache_dir is empty; name a folder for the generated media");
    if (c.num_samples < 1) fail("num_samples must be at least 1");
    if (c.image_size < 32 || c.image_size % 32 != 0)
        fail("image_size " + std::to_string(c.image_size) +
             " must be a positive multiple of 32 (16-pixel patches merged 2x2)");
    if (c.images_per_sample < 0) fail("images_per_sample must be 0 or more");
    if (c.video_frames < 1) fail("video_frames must be at least 1");
    if (!(c.videos_ratio >= 0.0 && c.videos_ratio <= 1.0)) fail("videos_ratio must be in [0, 1]");
    if (c.max_text_tokens < 16) fail("max_text_tokens must be at least 16");
    if (c.pack_length < 1 || c.pack_length > std::numeric_limits<int32_t>::max())
        fail("pack_length must be in [1, 2^31): cu_seq_lens are int32");
    if (c.micro_batches < 1) fail("micro_batches must be at least 1");
    if (c.num_workers < 0) fail("num_workers must be 0 or more");
    if (c.persistent_workers && c.num_workers == 0)
        fail("persistent_workers needs num_workers > 0 (as in PyTorch's DataLoader)");
    if (c.prefetch_factor < 1) fail("prefetch_factor must be at least 1");
    if (c.dp_size < 1 || c.dp_rank < 0 || c.dp_rank >= c.dp_size)
        fail("dp_rank " + std::to_string(c.dp_rank) + " is not in [0, dp_size " +
             std::to_string(c.dp_size) + ")");
}

}  // namespace demo
