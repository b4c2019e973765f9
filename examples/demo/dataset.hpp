// A synthetic multimodal dataset in Qwen3-VL's input format. Every sample is text plus 0..k
// media items (images, and short videos of a few frames). The media are generated once, as real
// JPEG files, into a cache folder; loading a sample reads and decodes them and cuts them into
// Qwen3-VL's patch rows, so the loader does the work a real multimodal loader does.
//
// Everything about sample i (its text length, media sizes, pixels and token ids) is a pure
// function of (seed, i): samples can be loaded in any order, by any thread, with the same result.
#pragma once

#include "config.hpp"
#include "media.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <span>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

namespace demo {

// Qwen3-VL's vision input: 16x16-pixel patches, two frames per temporal patch, 2x2 patches
// merged into one token. A patch row holds (channel, temporal, y, x) = 3 * 2 * 16 * 16 values.
inline constexpr int kPatchSize = 16;
inline constexpr int kTemporalPatch = 2;
inline constexpr int kMergeSize = 2;
inline constexpr int64_t kPatchRowSize = 3 * kTemporalPatch * kPatchSize * kPatchSize;  // 1536
inline constexpr float kImageMean = 0.5f;  // Qwen3-VL's processor normalises every channel
inline constexpr float kImageStd = 0.5f;   // with mean 0.5 and std 0.5

// Qwen's tokenizer ids for the tokens the packer and the model care about.
inline constexpr int64_t kPadTokenId = 151643;     // <|endoftext|>
inline constexpr int64_t kVisionStartId = 151652;  // <|vision_start|>
inline constexpr int64_t kVisionEndId = 151653;    // <|vision_end|>
inline constexpr int64_t kImagePadId = 151655;     // <|image_pad|>, one per merged image patch
inline constexpr int64_t kVideoPadId = 151656;     // <|video_pad|>
inline constexpr int64_t kTextVocab = 151643;      // ordinary text ids are below the specials
inline constexpr int64_t kIgnoreLabel = -100;

struct MediaInfo {
    bool video = false;
    int width = 0, height = 0;  // pixels, multiples of 32
    int frames = 1;             // 1 for an image

    // An image, or a video's odd last frame, is repeated to fill its temporal patch.
    int64_t grid_t() const { return (frames + kTemporalPatch - 1) / kTemporalPatch; }
    int64_t grid_h() const { return height / kPatchSize; }
    int64_t grid_w() const { return width / kPatchSize; }
    int64_t patches() const { return grid_t() * grid_h() * grid_w(); }
    int64_t tokens() const { return patches() / (kMergeSize * kMergeSize); }
};

struct SampleInfo {
    int64_t index = 0;
    int64_t text_tokens = 0;
    std::vector<MediaInfo> media;

    // Each media item is <|vision_start|>, its pad tokens, <|vision_end|>.
    int64_t num_tokens() const {
        int64_t n = text_tokens;
        for (const MediaInfo& m : media) n += m.tokens() + 2;
        return n;
    }
    int64_t num_patches() const {
        int64_t n = 0;
        for (const MediaInfo& m : media) n += m.patches();
        return n;
    }
};

// One loaded sample, ready to pack. Its pixels went straight into the caller's buffer.
struct Sample {
    std::vector<int64_t> input_ids;
    std::vector<int64_t> shifted_labels;               // next-token labels, -100 where untrained
    std::array<std::vector<int64_t>, 3> position_ids;  // Qwen-VL's 3-D rope: (t, h, w)
};

namespace detail {

inline uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

// Counter-based randomness: any value of any sample is computed on its own, which is what
// makes samples independent of load order and thread.
enum Stream : uint64_t { kTextLength, kMediaCount, kMediaKind, kWidth, kHeight, kPixels, kTextIds };

inline uint64_t hash(uint64_t seed, Stream stream, uint64_t a, uint64_t b = 0, uint64_t c = 0) {
    return splitmix64(splitmix64(splitmix64(splitmix64(seed ^ stream) ^ a) ^ b) ^ c);
}

}  // namespace detail

inline SampleInfo describe_sample(const PipelineConfig& c, int64_t index) {
    using detail::hash;
    const uint64_t i = static_cast<uint64_t>(index);
    SampleInfo s;
    s.index = index;
    s.text_tokens = 16 + static_cast<int64_t>(hash(c.seed, detail::kTextLength, i) %
                                              static_cast<uint64_t>(c.max_text_tokens - 15));
    const auto count = static_cast<int>(hash(c.seed, detail::kMediaCount, i) %
                                        static_cast<uint64_t>(c.images_per_sample + 1));
    const int smallest = (c.image_size / 2 + 31) / 32, largest = c.image_size / 32;  // in 32 px
    const auto sides = static_cast<uint64_t>(largest - smallest + 1);
    for (int m = 0; m < count; ++m) {
        MediaInfo media;
        const double u = static_cast<double>(hash(c.seed, detail::kMediaKind, i, m) >> 11) * 0x1.0p-53;
        media.video = u < c.videos_ratio;
        media.frames = media.video ? c.video_frames : 1;
        media.width = 32 * (smallest + static_cast<int>(hash(c.seed, detail::kWidth, i, m) % sides));
        media.height = 32 * (smallest + static_cast<int>(hash(c.seed, detail::kHeight, i, m) % sides));
        s.media.push_back(media);
    }
    return s;
}

// Smooth gradients (most of a photo compresses like that), some noise, and a bright square
// that moves from frame to frame, so video frames differ the way real ones do.
inline std::vector<uint8_t> render_frame(uint64_t seed, int64_t index, int media, int frame,
                                         int width, int height) {
    const uint64_t look = detail::hash(seed, detail::kPixels, static_cast<uint64_t>(index), media);
    const int hue = static_cast<int>(look % 256);
    const int side = std::max(8, std::min(width, height) / 4);
    const auto f = static_cast<uint64_t>(frame);
    const auto square_x = static_cast<int>(((look >> 8) + 7 * f) % static_cast<uint64_t>(width - side + 1));
    const auto square_y = static_cast<int>(((look >> 24) + 5 * f) % static_cast<uint64_t>(height - side + 1));
    std::vector<uint8_t> rgb(static_cast<size_t>(width) * height * 3);
    uint8_t* p = rgb.data();
    for (int y = 0; y < height; ++y) {
        for (int x = 0; x < width; ++x, p += 3) {
            const auto noise = static_cast<int>(
                detail::splitmix64(look ^ (f << 40) ^
                                   (static_cast<uint64_t>(y) * width + x)) >> 59);  // 0..31
            const bool in_square = x >= square_x && x < square_x + side && y >= square_y && y < square_y + side;
            p[0] = static_cast<uint8_t>(in_square ? 250 : (x * 255 / width + hue) % 256);
            p[1] = static_cast<uint8_t>(in_square ? 240 : (y * 200 / height + noise) % 256);
            p[2] = static_cast<uint8_t>(in_square ? 40 : ((x + y) * 128 / (width + height) + 2 * noise + hue / 2) % 256);
        }
    }
    return rgb;
}

// The shortest text that reads back as exactly `value`: 0.3 rather than 0.29999999999999999.
inline std::string shortest_text(double value) {
    char text[32];
    for (int digits = 1; digits <= 17; ++digits) {
        std::snprintf(text, sizeof text, "%.*g", digits, value);
        if (std::strtod(text, nullptr) == value) break;
    }
    return text;
}

// Everything that decides the media files, so that a folder is reused only for the same media.
inline std::string cache_key(const PipelineConfig& c) {
    char key[256];
    std::snprintf(key, sizeof key, "qwen3vl-v1_n%lld_img%d_k%d_vf%d_vr%s_seed%llu",
                  static_cast<long long>(c.num_samples), c.image_size, c.images_per_sample,
                  c.video_frames, shortest_text(c.videos_ratio).c_str(),
                  static_cast<unsigned long long>(c.seed));
    return key;
}

inline std::string frame_file_name(int64_t index, int media, int frame) {
    char name[64];
    std::snprintf(name, sizeof name, "s%07lld_m%d_f%03d.jpg", static_cast<long long>(index), media, frame);
    return name;
}

struct CacheFolder {
    std::filesystem::path path;
    bool generated = false;  // false: an earlier run's folder was reused
};

// Idempotent, and safe when several processes (the leaders of several DP replicas) call it at
// once: each generates into its own partial folder and renames it into place, which succeeds
// for one of them; the others find the complete folder and drop their copy.
inline CacheFolder ensure_cache(const PipelineConfig& c) {
    namespace fs = std::filesystem;
    validate(c);
    const std::string key = cache_key(c);
    const fs::path folder = c.cache_dir / key;
    const auto complete = [&] {
        const fs::path marker = folder / "complete";
        if (!fs::exists(marker)) return false;
        const std::vector<uint8_t> text = read_file(marker);
        return std::string(text.begin(), text.end()) == key;
    };
    if (complete()) return {folder, false};
    if (fs::exists(folder))
        throw std::runtime_error("media cache " + folder.string() +
                                 " exists but is not complete; delete it and run again to regenerate it");

    fs::create_directories(c.cache_dir);
    const fs::path partial =
        c.cache_dir / (key + ".partial-" + std::to_string(::getpid()) + "-" +
                       std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id())));
    fs::remove_all(partial);
    fs::create_directory(partial);
    try {
        for (int64_t index = 0; index < c.num_samples; ++index) {
            const SampleInfo s = describe_sample(c, index);
            for (int m = 0; m < static_cast<int>(s.media.size()); ++m) {
                const MediaInfo& media = s.media[static_cast<size_t>(m)];
                for (int f = 0; f < media.frames; ++f) {
                    const std::vector<uint8_t> rgb =
                        render_frame(c.seed, index, m, f, media.width, media.height);
                    write_file(partial / frame_file_name(index, m, f),
                               encode_jpeg(rgb.data(), media.width, media.height, 90));
                }
            }
        }
        write_file(partial / "complete", std::span(reinterpret_cast<const uint8_t*>(key.data()), key.size()));
    } catch (...) {
        std::error_code ignored;
        fs::remove_all(partial, ignored);
        throw;
    }
    std::error_code renamed;
    fs::rename(partial, folder, renamed);
    if (!renamed) return {folder, true};
    fs::remove_all(partial);
    if (complete()) return {folder, false};  // another process finished first
    throw std::runtime_error("cannot move the generated media into " + folder.string() + ": " +
                             renamed.message());
}

// Writes one image or video as Qwen3-VL patch rows, as Qwen2VLImageProcessor's
// reshape/transpose orders them: rows by (t, h/2, w/2, 2, 2), so that the four patches the
// merger joins into one token are adjacent, and within a row (channel, temporal, y, x).
inline void patchify(std::span<const std::vector<uint8_t>> frames, int width, int height, float* out) {
    const int grid_h = height / kPatchSize, grid_w = width / kPatchSize;
    const auto grid_t = static_cast<int>((frames.size() + kTemporalPatch - 1) / kTemporalPatch);
    for (int t = 0; t < grid_t; ++t)
        for (int bh = 0; bh < grid_h / kMergeSize; ++bh)
            for (int bw = 0; bw < grid_w / kMergeSize; ++bw)
                for (int mh = 0; mh < kMergeSize; ++mh)
                    for (int mw = 0; mw < kMergeSize; ++mw) {
                        const int y0 = (bh * kMergeSize + mh) * kPatchSize;
                        const int x0 = (bw * kMergeSize + mw) * kPatchSize;
                        for (int c = 0; c < 3; ++c)
                            for (int tp = 0; tp < kTemporalPatch; ++tp) {
                                const size_t f = std::min<size_t>(static_cast<size_t>(t * kTemporalPatch + tp),
                                                                  frames.size() - 1);
                                const uint8_t* frame = frames[f].data();
                                for (int y = y0; y < y0 + kPatchSize; ++y)
                                    for (int x = x0; x < x0 + kPatchSize; ++x)
                                        *out++ = (frame[(static_cast<size_t>(y) * width + x) * 3 + c] *
                                                      (1.0f / 255.0f) - kImageMean) / kImageStd;
                            }
                    }
}

class Dataset {
public:
    // Generates the media on first use (see ensure_cache).
    explicit Dataset(const PipelineConfig& config)
        : seed_(config.seed), folder_(ensure_cache(config).path) {
        samples_.reserve(static_cast<size_t>(config.num_samples));
        for (int64_t i = 0; i < config.num_samples; ++i) samples_.push_back(describe_sample(config, i));
    }

    int64_t size() const { return static_cast<int64_t>(samples_.size()); }
    const SampleInfo& info(int64_t index) const { return samples_.at(static_cast<size_t>(index)); }
    const std::filesystem::path& folder() const { return folder_; }

    std::filesystem::path frame_path(int64_t index, int media, int frame) const {
        return folder_ / frame_file_name(index, media, frame);
    }

    // Reads and decodes the sample's JPEGs into `pixel_rows`, which must hold exactly
    // info(index).num_patches() rows of kPatchRowSize floats.
    Sample load(int64_t index, std::span<float> pixel_rows) const {
        const SampleInfo& s = info(index);
        if (pixel_rows.size() != static_cast<size_t>(s.num_patches() * kPatchRowSize))
            throw std::invalid_argument("demo::Dataset::load: sample " + std::to_string(index) + " needs " +
                                        std::to_string(s.num_patches()) + " pixel rows, got space for " +
                                        std::to_string(pixel_rows.size() / kPatchRowSize));
        try {
            float* out = pixel_rows.data();
            for (int m = 0; m < static_cast<int>(s.media.size()); ++m) {
                const MediaInfo& media = s.media[static_cast<size_t>(m)];
                std::vector<std::vector<uint8_t>> frames;
                for (int f = 0; f < media.frames; ++f) {
                    const std::filesystem::path path = frame_path(index, m, f);
                    DecodedImage image = load_jpeg(path);
                    if (image.width != media.width || image.height != media.height)
                        throw std::runtime_error(path.string() + " is " + std::to_string(image.width) + "x" +
                                                 std::to_string(image.height) + ", expected " +
                                                 std::to_string(media.width) + "x" + std::to_string(media.height));
                    frames.push_back(std::move(image.rgb));
                }
                patchify(frames, media.width, media.height, out);
                out += media.patches() * kPatchRowSize;
            }
        } catch (const std::exception& e) {
            throw std::runtime_error("sample " + std::to_string(index) + ": " + e.what() +
                                     " (if the media cache is damaged, delete " + folder_.string() +
                                     " to regenerate it)");
        }
        return tokens(s);
    }

private:
    // Qwen-VL's layout: each media item as <|vision_start|> pads <|vision_end|>, then the text.
    // Positions follow Qwen2-VL's get_rope_index: text advances all three axes together; a
    // media item's tokens take (start + t, start + h, start + w) over its merged grid, and the
    // text after it continues from the largest of those plus one. Only text is trained on.
    Sample tokens(const SampleInfo& s) const {
        Sample out;
        std::vector<int64_t> labels;
        int64_t next = 0;
        auto push = [&](int64_t id, int64_t label, int64_t t, int64_t h, int64_t w) {
            out.input_ids.push_back(id);
            labels.push_back(label);
            out.position_ids[0].push_back(t);
            out.position_ids[1].push_back(h);
            out.position_ids[2].push_back(w);
        };
        for (const MediaInfo& m : s.media) {
            push(kVisionStartId, kIgnoreLabel, next, next, next);
            ++next;
            const int64_t gt = m.grid_t(), gh = m.grid_h() / kMergeSize, gw = m.grid_w() / kMergeSize;
            for (int64_t t = 0; t < gt; ++t)
                for (int64_t h = 0; h < gh; ++h)
                    for (int64_t w = 0; w < gw; ++w)
                        push(m.video ? kVideoPadId : kImagePadId, kIgnoreLabel, next + t, next + h, next + w);
            next += std::max({gt, gh, gw});
            push(kVisionEndId, kIgnoreLabel, next, next, next);
            ++next;
        }
        for (int64_t k = 0; k < s.text_tokens; ++k) {
            const auto id = static_cast<int64_t>(
                detail::hash(seed_, detail::kTextIds, static_cast<uint64_t>(s.index), static_cast<uint64_t>(k)) %
                static_cast<uint64_t>(kTextVocab));
            push(id, id, next, next, next);
            ++next;
        }
        out.shifted_labels.assign(labels.begin() + 1, labels.end());
        out.shifted_labels.push_back(kIgnoreLabel);
        return out;
    }

    uint64_t seed_;
    std::filesystem::path folder_;
    std::vector<SampleInfo> samples_;
};

}  // namespace demo
