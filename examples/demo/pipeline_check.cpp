// Proof that the demo's data pipeline works (this is not the demo). It generates a small media
// cache, runs demo::MediaLoader for two epochs with 0 and 2 workers, persistent or not, and
// checks that the batches are identical and deterministic, shaped as shared/batches.md says,
// resumable from a saved state (mid-epoch and across an epoch boundary), and that the default
// CPU generator moved by exactly one draw per underlying iterator creation. Prints a summary
// with timings and exits non-zero if any check failed.
//
//   pipeline_check [--cache DIR] [--samples N] [--image-size PX] [--pack-length L] [--max-text-tokens N]
//   pipeline_check --digest [same options]   prints the digest of the two-epoch stream
//                                            (the check runs itself this way to compare runs)
#include "dataset.hpp"
#include "loader.hpp"
#include "media.hpp"
#include "packing.hpp"
#include "pss.hpp"
#include "sampler.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <boost/hana.hpp>

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <iomanip>
#include <iostream>
#include <optional>
#include <set>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
namespace hana = boost::hana;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
    return std::chrono::duration<double>(Clock::now() - start).count();
}

struct Options {
    fs::path cache = fs::temp_directory_path() / "spbcast-pipeline-check";
    int64_t samples = 96;
    int image_size = 224;
    int64_t pack_length = 2048;
    int max_text_tokens = 512;
    bool digest = false;
};

Options parse_options(int argc, char** argv) {
    Options o;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw std::invalid_argument(arg + " needs a value");
            return argv[++i];
        };
        if (arg == "--cache") o.cache = value();
        else if (arg == "--samples") o.samples = std::stoll(value());
        else if (arg == "--image-size") o.image_size = std::stoi(value());
        else if (arg == "--pack-length") o.pack_length = std::stoll(value());
        else if (arg == "--max-text-tokens") o.max_text_tokens = std::stoi(value());
        else if (arg == "--digest") o.digest = true;
        else throw std::invalid_argument("unknown option " + arg +
                                         " (--cache DIR, --samples N, --image-size PX, --pack-length L, --max-text-tokens N, --digest)");
    }
    return o;
}

demo::PipelineConfig config_for(const Options& o, int num_workers, bool persistent) {
    demo::PipelineConfig c;
    c.cache_dir = o.cache;
    c.num_samples = o.samples;
    c.image_size = o.image_size;
    c.max_text_tokens = o.max_text_tokens;
    c.pack_length = o.pack_length;
    c.videos_ratio = 0.3;  // more videos than the default, so that the small dataset has some
    c.micro_batches = 2;
    c.num_workers = num_workers;
    c.persistent_workers = persistent;
    c.seed = 1234;
    return c;
}

// ---- comparing and hashing batches, field by field ----

std::span<const uint8_t> bytes_of(const at::Tensor& contiguous) {
    return {static_cast<const uint8_t*>(contiguous.data_ptr()), contiguous.nbytes()};
}

std::string describe(const at::Tensor& t) {
    if (!t.defined()) return "undefined";
    std::string s = std::string(c10::toString(t.scalar_type())) + " (";
    for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
    return s + ")";
}

// Bit-for-bit equality of two batches; every difference is reported with its field path.
struct Differ {
    std::vector<std::string> differences;

    void operator()(const at::Tensor& a, const at::Tensor& b, const std::string& path) {
        if (describe(a) != describe(b)) {
            differences.push_back(path + ": " + describe(a) + " vs " + describe(b));
            return;
        }
        if (!a.defined()) return;
        const at::Tensor ca = a.contiguous(), cb = b.contiguous();
        const auto x = bytes_of(ca), y = bytes_of(cb);
        if (x.size() != y.size() || std::memcmp(x.data(), y.data(), x.size()) != 0)
            differences.push_back(path + ": contents differ");
    }
    void operator()(int64_t a, int64_t b, const std::string& path) {
        if (a != b) differences.push_back(path + ": " + std::to_string(a) + " vs " + std::to_string(b));
    }
    void operator()(const std::string& a, const std::string& b, const std::string& path) {
        if (a != b) differences.push_back(path + ": '" + a + "' vs '" + b + "'");
    }
    template <typename T>
    void operator()(const std::optional<T>& a, const std::optional<T>& b, const std::string& path) {
        if (a.has_value() != b.has_value()) differences.push_back(path + ": present in only one");
        else if (a) (*this)(*a, *b, path);
    }
    template <typename T>
    void operator()(const std::vector<T>& a, const std::vector<T>& b, const std::string& path) {
        if (a.size() != b.size()) {
            differences.push_back(path + ": " + std::to_string(a.size()) + " vs " + std::to_string(b.size()) + " entries");
            return;
        }
        for (size_t i = 0; i < a.size(); ++i) (*this)(a[i], b[i], path + "[" + std::to_string(i) + "]");
    }
    template <typename S>
        requires hana::Struct<S>::value
    void operator()(const S& a, const S& b, const std::string& path) {
        hana::for_each(hana::accessors<S>(), [&](auto field) {
            (*this)(hana::second(field)(a), hana::second(field)(b),
                    path + "." + hana::to<const char*>(hana::first(field)));
        });
    }
};

// FNV-1a over every field, to compare the stream of another process with this one.
struct Digest {
    uint64_t value = 1469598103934665603ull;

    void add(const void* data, size_t size) {
        for (size_t i = 0; i < size; ++i) value = (value ^ static_cast<const uint8_t*>(data)[i]) * 1099511628211ull;
    }
    void operator()(const at::Tensor& t) {
        const std::string shape = describe(t);
        add(shape.data(), shape.size());
        if (!t.defined()) return;
        const at::Tensor c = t.contiguous();
        add(c.data_ptr(), c.nbytes());
    }
    void operator()(int64_t v) { add(&v, sizeof v); }
    void operator()(const std::string& s) { add(s.data(), s.size()); }
    template <typename T>
    void operator()(const std::optional<T>& o) {
        (*this)(static_cast<int64_t>(o.has_value()));
        if (o) (*this)(*o);
    }
    template <typename T>
    void operator()(const std::vector<T>& v) {
        (*this)(static_cast<int64_t>(v.size()));
        for (const T& x : v) (*this)(x);
    }
    template <typename S>
        requires hana::Struct<S>::value
    void operator()(const S& s) {
        hana::for_each(hana::accessors<S>(), [&](auto field) { (*this)(hana::second(field)(s)); });
    }
};

std::vector<std::string> differences(const std::vector<xtuner::Batch>& a, const std::vector<xtuner::Batch>& b) {
    Differ d;
    d(a, b, "batches");
    return d.differences;
}

std::string hex_digest(const std::vector<xtuner::Batch>& batches) {
    Digest d;
    d(batches);
    char text[17];
    std::snprintf(text, sizeof text, "%016llx", static_cast<unsigned long long>(d.value));
    return text;
}

// ---- the default CPU generator ----

std::vector<uint8_t> state_bytes(const at::Tensor& state) {
    const auto b = bytes_of(state.contiguous());
    return {b.begin(), b.end()};
}

at::Tensor default_generator_state() {
    return at::detail::getDefaultCPUGenerator().get_state();
}

// The default generator's state after `draws` base-seed draws from `start`, computed on the
// generator itself and then put back as it was.
std::vector<uint8_t> state_after_draws(const at::Tensor& start, int draws) {
    at::Generator generator = at::detail::getDefaultCPUGenerator();
    const at::Tensor now = generator.get_state();
    generator.set_state(start);
    for (int i = 0; i < draws; ++i) at::empty({}, at::kLong).random_();
    std::vector<uint8_t> after = state_bytes(generator.get_state());
    generator.set_state(now);
    return after;
}

// ---- running the loader ----

struct Run {
    std::vector<xtuner::Batch> batches;
    std::vector<bool> predicate;  // will_consume_base_seed() before each begin()
    int begins = 0;
    double seconds = 0;
};

// Takes batches until the loader reaches `end_epoch`, or `limit` batches were taken.
Run take(demo::MediaLoader& loader, int64_t end_epoch, size_t limit = SIZE_MAX) {
    Run run;
    const auto start = Clock::now();
    while (loader.epoch() < end_epoch && run.batches.size() < limit) {
        run.predicate.push_back(loader.will_consume_base_seed());
        demo::MediaLoader::Pass pass = loader.begin();
        ++run.begins;
        while (run.batches.size() < limit) {
            std::optional<xtuner::Batch> batch = pass.next();
            if (!batch) break;
            run.batches.push_back(std::move(*batch));
        }
    }
    run.seconds = seconds_since(start);
    return run;
}

int64_t samples_in(const xtuner::Item& item) {
    const at::Tensor cu = item.seq_ctx.cu_seq_lens_q;
    const int32_t* c = cu.data_ptr<int32_t>();
    const int64_t real_end = item.shifted_labels.size(1) - item.seq_ctx.num_padding;
    int64_t n = 0;
    for (int64_t k = 1; k < cu.numel(); ++k) n += c[k] <= real_end;
    return n;
}

int64_t samples_in(const std::vector<xtuner::Batch>& batches) {
    int64_t n = 0;
    for (const xtuner::Batch& b : batches)
        for (const xtuner::Item& item : b) n += samples_in(item);
    return n;
}

// ---- the layout of shared/batches.md ----

std::vector<std::string> layout_problems(const xtuner::Batch& batch, const demo::PipelineConfig& config) {
    std::vector<std::string> problems;
    auto need = [&](bool ok, const std::string& what) {
        if (!ok) problems.push_back(what);
    };
    const int64_t L = config.pack_length;
    using Shape = std::vector<int64_t>;
    need(batch.size() == static_cast<size_t>(config.micro_batches), "one item per micro-batch");
    for (const xtuner::Item& item : batch) {
        const xtuner::SequenceContext& ctx = item.seq_ctx;
        need(ctx.input_ids.scalar_type() == at::kLong && ctx.input_ids.sizes().vec() == Shape{1, L}, "input_ids int64 (1, L)");
        need(item.shifted_labels.scalar_type() == at::kLong && item.shifted_labels.sizes().vec() == Shape{1, L},
             "shifted_labels int64 (1, L)");
        need(ctx.position_ids.scalar_type() == at::kLong && ctx.position_ids.sizes().vec() == Shape{3, 1, L},
             "position_ids int64 (3, 1, L)");
        need(ctx.cu_seq_lens_k.is_same(ctx.cu_seq_lens_q), "cu_seq_lens_k is the same tensor as cu_seq_lens_q");
        const at::Tensor cu = ctx.cu_seq_lens_q;
        need(cu.scalar_type() == at::kInt && cu.dim() == 1 && cu.numel() >= 2, "cu_seq_lens int32 (nseq + 1)");
        if (!problems.empty()) return problems;

        const int32_t* c = cu.data_ptr<int32_t>();
        const int64_t n = cu.numel(), real_end = L - ctx.num_padding;
        need(c[0] == 0 && c[n - 1] == L, "cu_seq_lens run from 0 to L");
        int64_t longest = 0, real = 0, padding_segments = 0;
        for (int64_t k = 1; k < n; ++k) {
            need(c[k] > c[k - 1], "cu_seq_lens strictly increase");
            longest = std::max<int64_t>(longest, c[k] - c[k - 1]);
            if (c[k] <= real_end) ++real;
            else {
                ++padding_segments;
                need(c[k] - c[k - 1] <= demo::kPaddingSegment, "padding segments of at most 256 tokens");
            }
        }
        need(c[real] == real_end, "padding starts at a sequence boundary");
        need(padding_segments == (ctx.num_padding + demo::kPaddingSegment - 1) / demo::kPaddingSegment,
             "num_padding split into 256-token segments");
        for (const at::Tensor& m : {ctx.max_length_q, ctx.max_length_k})
            need(m.dim() == 0 && m.scalar_type() == at::kLong && m.item<int64_t>() == longest,
                 "max_length_q/k int64 0-dim, the longest sequence");

        const int64_t* ids = ctx.input_ids.data_ptr<int64_t>();
        const int64_t* labels = item.shifted_labels.data_ptr<int64_t>();
        const int64_t* pos = ctx.position_ids.data_ptr<int64_t>();
        int64_t media_tokens = 0;
        for (int64_t i = 0; i < L; ++i) {
            media_tokens += ids[i] == demo::kImagePadId || ids[i] == demo::kVideoPadId;
            if (i >= real_end) need(labels[i] == -100 && ids[i] == demo::kPadTokenId, "padding: pad ids, labels -100");
        }
        for (int64_t k = 0; k + 1 < n; ++k) {
            need(labels[c[k + 1] - 1] == -100, "the last token of every sequence has label -100");
            for (int64_t axis = 0; axis < 3; ++axis)
                need(pos[axis * L + c[k]] == 0, "positions restart at 0 with every sequence");
        }

        if (ctx.pixel_values) {
            const at::Tensor& pv = *ctx.pixel_values;
            need(pv.scalar_type() == at::kFloat && pv.dim() == 2 && pv.size(1) == 1536, "pixel_values float32 (rows, 1536)");
            need(ctx.image_grid_thw && ctx.image_grid_thw->scalar_type() == at::kLong && ctx.image_grid_thw->dim() == 2 &&
                     ctx.image_grid_thw->size(1) == 3,
                 "image_grid_thw int64 (n, 3)");
            need(ctx.num_img_tokens && static_cast<int64_t>(ctx.num_img_tokens->size()) == real,
                 "num_img_tokens: one list per packed sample");
            if (!problems.empty()) return problems;
            std::vector<int64_t> grid_patches, listed;
            const at::Tensor grid = ctx.image_grid_thw->contiguous();
            for (int64_t r = 0; r < grid.size(0); ++r)
                grid_patches.push_back(grid[r][0].item<int64_t>() * grid[r][1].item<int64_t>() * grid[r][2].item<int64_t>());
            for (const auto& per_sample : *ctx.num_img_tokens)
                for (int64_t v : per_sample)
                    if (v != 0) listed.push_back(v);
            int64_t rows = 0;
            for (int64_t p : grid_patches) rows += p;
            need(rows == pv.size(0), "pixel_values rows = sum of t*h*w over image_grid_thw");
            need(listed == grid_patches, "num_img_tokens lists t*h*w of each image, text-only samples [0]");
            need(media_tokens * 4 == rows, "input_ids hold t*h*w/4 image tokens per image");
        } else {
            need(!ctx.image_grid_thw && !ctx.num_img_tokens && media_tokens == 0,
                 "a pack without media has no image fields and no image tokens");
        }
        need(!ctx.inputs_embeds && !ctx.block_table && !ctx.rollout_routed_experts, "inputs_embeds etc. absent");
        need(ctx.device == "cpu", "device \"cpu\"");
    }
    return problems;
}

// Qwen2VLImageProcessor's patchify in tensor operations, to check demo::patchify against.
at::Tensor reference_patches(const std::vector<demo::DecodedImage>& frames) {
    std::vector<at::Tensor> planes;
    for (const demo::DecodedImage& f : frames)
        planes.push_back(at::from_blob(const_cast<uint8_t*>(f.rgb.data()), {f.height, f.width, 3}, at::kByte));
    if (planes.size() % 2 == 1) planes.push_back(planes.back());
    const at::Tensor x = at::stack(planes).to(at::kFloat).mul(1.0 / 255).sub(0.5).div(0.5).permute({0, 3, 1, 2});
    const int64_t t = x.size(0) / 2, h = x.size(2) / 16, w = x.size(3) / 16;
    return x.reshape({t, 2, 3, h / 2, 2, 16, w / 2, 2, 16})
        .permute({0, 3, 6, 4, 7, 2, 1, 5, 8})
        .reshape({t * h * w, 1536});
}

struct Checks {
    int passed = 0, failed = 0;

    void expect(bool ok, const std::string& what, const std::vector<std::string>& details = {}) {
        std::cout << (ok ? "  ok    " : "  FAIL  ") << what << '\n';
        for (size_t i = 0; i < details.size() && i < 5; ++i) std::cout << "          " << details[i] << '\n';
        (ok ? passed : failed) += 1;
    }
};

template <typename F>
std::optional<std::string> error_of(F&& f) {
    try {
        f();
    } catch (const std::exception& e) {
        return std::string(e.what());
    }
    return std::nullopt;
}

int check(const Options& options, const std::string& self) {
    Checks checks;
    const demo::PipelineConfig base = config_for(options, 0, false);
    const std::string pid = std::to_string(::getpid());

    std::cout << "media cache\n";
    auto start = Clock::now();
    const demo::CacheFolder cache = demo::ensure_cache(base);
    const double generate_seconds = seconds_since(start);
    start = Clock::now();
    const demo::CacheFolder again = demo::ensure_cache(base);
    const double reuse_seconds = seconds_since(start);
    checks.expect(!again.generated && again.path == cache.path, "ensure_cache reuses a complete folder");
    int64_t files = 0, jpeg_bytes = 0;
    for (const auto& entry : fs::directory_iterator(cache.path))
        if (entry.path().extension() == ".jpg") ++files, jpeg_bytes += static_cast<int64_t>(entry.file_size());
    {
        demo::PipelineConfig other = base;
        other.cache_dir = options.cache / ("regenerated-" + pid);
        fs::remove_all(other.cache_dir);
        const demo::CacheFolder fresh = demo::ensure_cache(other);
        bool same = fresh.generated;
        for (const auto& entry : fs::directory_iterator(cache.path))
            same = same && demo::read_file(entry.path()) == demo::read_file(fresh.path / entry.path().filename());
        checks.expect(same, "generating again from scratch writes byte-identical files");
        fs::remove_all(other.cache_dir);
    }

    std::cout << "loader, 2 epochs\n";
    auto run_checked = [&](int workers, bool persistent, int expected_draws, const std::vector<bool>& expected_predicate) {
        const demo::PipelineConfig config = config_for(options, workers, persistent);
        const at::Tensor before = default_generator_state();
        Run run;
        {
            demo::MediaLoader loader(config);
            run = take(loader, 2);
        }
        const std::string name = std::to_string(workers) + " workers" + (persistent ? " persistent" : "");
        checks.expect(state_bytes(default_generator_state()) == state_after_draws(before, expected_draws),
                      name + ": default CPU generator moved by exactly " + std::to_string(expected_draws) + " base-seed draw(s)");
        checks.expect(run.predicate == expected_predicate,
                      name + ": will_consume_base_seed() before epoch 0 and 1 = " +
                          (expected_predicate[0] ? "true, " : "false, ") + (expected_predicate[1] ? "true" : "false"));
        return run;
    };
    const Run reference = run_checked(0, false, 2, {true, true});
    const int64_t per_epoch = static_cast<int64_t>(reference.batches.size()) / 2;
    checks.expect(reference.batches.size() % 2 == 0 && per_epoch == demo::MediaLoader(base).size(),
                  "size() batches per epoch (" + std::to_string(per_epoch) + ")");
    std::vector<std::string> layout;
    for (const xtuner::Batch& b : reference.batches)
        for (const std::string& p : layout_problems(b, base)) layout.push_back(p);
    checks.expect(layout.empty(), "every batch has the layout of shared/batches.md", layout);
    const std::vector<xtuner::Batch> epoch0(reference.batches.begin(), reference.batches.begin() + per_epoch);
    const std::vector<xtuner::Batch> epoch1(reference.batches.begin() + per_epoch, reference.batches.end());
    checks.expect(!differences(epoch0, epoch1).empty(), "epoch 1 is shuffled differently from epoch 0");

    // Scoped, so that only the reference batches stay in memory.
    double two_seconds = 0, persistent_seconds = 0;
    {
        const Run two = run_checked(2, false, 2, {true, true});
        const std::vector<std::string> diff = differences(reference.batches, two.batches);
        checks.expect(diff.empty(), "2 workers: bit-equal to 0 workers", diff);
        two_seconds = two.seconds;
    }
    {
        const Run persistent = run_checked(2, true, 1, {true, false});
        const std::vector<std::string> diff = differences(reference.batches, persistent.batches);
        checks.expect(diff.empty(), "2 persistent workers: bit-equal to 0 workers", diff);
        persistent_seconds = persistent.seconds;
    }

    std::cout << "determinism\n";
    {
        demo::MediaLoader loader(base);
        checks.expect(differences(reference.batches, take(loader, 2).batches).empty(), "a second loader in this process: bit-equal");
    }
    const std::string digest = hex_digest(reference.batches);
    {
        std::string command = std::string("'") + self + "' --digest --cache '" + options.cache.string() +
                              "' --samples " + std::to_string(options.samples) + " --image-size " +
                              std::to_string(options.image_size) + " --pack-length " + std::to_string(options.pack_length) +
                              " --max-text-tokens " + std::to_string(options.max_text_tokens);
        std::string output;
        if (FILE* pipe = ::popen(command.c_str(), "r")) {
            char buffer[256];
            while (std::fgets(buffer, sizeof buffer, pipe)) output += buffer;
            ::pclose(pipe);
        }
        while (!output.empty() && (output.back() == '\n' || output.back() == ' ')) output.pop_back();
        checks.expect(output == digest, "another process: the same digest " + digest + " (got '" + output + "')");
    }

    std::cout << "resume from save_state() in a new loader\n";
    for (bool persistent_workers : {false, true}) {
        for (int64_t cut : {int64_t{1}, per_epoch - 1, per_epoch, per_epoch + 1}) {
            const demo::PipelineConfig config = config_for(options, 2, persistent_workers);
            std::string state;
            {
                demo::MediaLoader first(config);
                const Run before = take(first, 2, static_cast<size_t>(cut));
                const std::vector<xtuner::Batch> prefix(reference.batches.begin(), reference.batches.begin() + cut);
                checks.expect(differences(prefix, before.batches).empty() && before.batches.size() == static_cast<size_t>(cut),
                              "  first " + std::to_string(cut) + " batches as in the reference");
                state = first.save_state();
            }
            const at::Tensor generator_before = default_generator_state();
            demo::MediaLoader resumed(config);
            resumed.load_state(state);
            const Run after = take(resumed, 2);
            const std::vector<xtuner::Batch> rest(reference.batches.begin() + cut, reference.batches.end());
            const int draws = persistent_workers ? 1 : after.begins;
            checks.expect(differences(rest, after.batches).empty() && after.predicate.at(0),
                          std::string(persistent_workers ? "persistent" : "non-persistent") + ", saved after " +
                              std::to_string(cut) + " batches (" + std::to_string(per_epoch) + " per epoch) as '" +
                              state + "': the following batches match, first begin() draws",
                          differences(rest, after.batches));
            checks.expect(state_bytes(default_generator_state()) == state_after_draws(generator_before, draws),
                          "  and the resumed loader made " + std::to_string(draws) + " base-seed draw(s)");
        }
    }
    {
        demo::MediaLoader loader(base);
        const auto wrong = error_of([&] { loader.load_state("epoch=0 position=0 size=999 seed=1234"); });
        checks.expect(wrong && wrong->find("restore with the same") != std::string::npos,
                      "a state from another dataset is refused: " + wrong.value_or("(accepted)"));
    }

    std::cout << "sampler\n";
    {
        const at::Tensor generator_before = default_generator_state();
        const demo::ResumableSampler r0(103, 7, 0, 2), r1(103, 7, 1, 2);
        std::vector<int64_t> a = r0.indices(3), b = r1.indices(3);
        std::set<int64_t> all(a.begin(), a.end());
        all.insert(b.begin(), b.end());
        checks.expect(a.size() == 51 && b.size() == 51 && all.size() == 102,
                      "DP shards: 51 indices each, disjoint (one of 103 dropped)");
        checks.expect(r0.indices(3) == a && r0.indices(4) != a, "the order is a function of (seed, epoch)");
        demo::ResumableSampler s(103, 7), t(103, 7);
        s.set_epoch(5);
        s.advance(40);
        t.load_state(s.save_state());
        checks.expect(t.epoch() == 5 && t.position() == 40, "state round trip: '" + s.save_state() + "'");
        checks.expect(state_bytes(default_generator_state()) == state_bytes(generator_before),
                      "the sampler never touches the default CPU generator");
    }

    std::cout << "configuration\n";
    {
        demo::PipelineConfig bad = base;
        bad.persistent_workers = true;
        const auto e1 = error_of([&] { demo::MediaLoader loader(bad); });
        checks.expect(e1.has_value(), "persistent_workers with 0 workers is refused: " + e1.value_or("(accepted)"));
        bad = base;
        bad.image_size = 200;
        const auto e2 = error_of([&] { demo::MediaLoader loader(bad); });
        checks.expect(e2.has_value(), "image_size 200 is refused: " + e2.value_or("(accepted)"));
        bad = base;
        bad.pack_length = 256;
        const auto e3 = error_of([&] { demo::MediaLoader loader(bad); });
        checks.expect(e3.has_value(), "a sample longer than the pack is refused: " + e3.value_or("(accepted)"));
    }

    std::cout << "patches\n";
    const demo::Dataset dataset(base);
    for (bool video : {false, true}) {
        int64_t index = 0;
        while (index < dataset.size() &&
               (dataset.info(index).media.empty() || dataset.info(index).media[0].video != video))
            ++index;
        if (index == dataset.size()) {
            checks.expect(false, std::string("a sample whose first media item is ") + (video ? "a video" : "an image"));
            continue;
        }
        const demo::MediaInfo& m = dataset.info(index).media[0];
        std::vector<demo::DecodedImage> frames;
        for (int f = 0; f < m.frames; ++f) frames.push_back(demo::load_jpeg(dataset.frame_path(index, 0, f)));
        const at::Tensor expected = reference_patches(frames);
        at::Tensor rows = at::empty({dataset.info(index).num_patches(), demo::kPatchRowSize}, at::kFloat);
        dataset.load(index, {rows.data_ptr<float>(), static_cast<size_t>(rows.numel())});
        const at::Tensor mine = rows.narrow(0, 0, m.patches());
        const double error = (mine - expected).abs().max().item<double>();
        checks.expect(mine.sizes() == expected.sizes() && error <= 1e-6,
                      std::string(video ? "video" : "image") + " of sample " + std::to_string(index) + " (" +
                          std::to_string(m.width) + "x" + std::to_string(m.height) + ", " + std::to_string(m.frames) +
                          " frame(s), grid " + std::to_string(m.grid_t()) + "x" + std::to_string(m.grid_h()) + "x" +
                          std::to_string(m.grid_w()) + "): patch rows equal Qwen's reshape/permute, max error " +
                          std::to_string(error));
    }

    std::cout << "a damaged JPEG\n";
    for (int workers : {0, 2}) {
        demo::PipelineConfig config = config_for(options, workers, false);
        config.cache_dir = options.cache / ("damaged-" + pid);
        fs::remove_all(config.cache_dir);
        const demo::CacheFolder folder = demo::ensure_cache(config);
        int64_t victim = config.num_samples / 2;
        while (dataset.info(victim).media.empty()) victim = (victim + 1) % config.num_samples;
        const fs::path file = folder.path / demo::frame_file_name(victim, 0, 0);
        std::vector<uint8_t> bytes = demo::read_file(file);
        bytes.resize(bytes.size() / 2);
        demo::write_file(file, bytes);
        std::optional<std::string> error;
        size_t delivered = 0;
        {
            demo::MediaLoader loader(config);
            error = error_of([&] { delivered = take(loader, 1).batches.size(); });
        }
        const std::string name = "sample " + std::to_string(victim);
        checks.expect(error && error->find(name) != std::string::npos && error->find(file.filename().string()) != std::string::npos,
                      std::to_string(workers) + " workers: the failure reaches next(), names " + name + " and its file, " +
                          "and the loader shuts down cleanly");
        if (error && workers == 2) std::cout << "          message: " << *error << '\n';
        fs::remove_all(config.cache_dir);
    }

    std::cout << "PSS\n";
    std::vector<demo::PssPoint> points;
    double sampled_seconds = 0;
    {
        demo::PssSampler sampler(std::chrono::milliseconds(20), Clock::now(), 1);
        demo::MediaLoader loader(config_for(options, 2, false));
        sampled_seconds = take(loader, 2).seconds;
        points = sampler.stop();
    }
    int64_t low = INT64_MAX, high = 0;
    for (const demo::PssPoint& p : points) low = std::min(low, p.bytes), high = std::max(high, p.bytes);
    checks.expect(points.size() >= 2 && low > 0,
                  std::to_string(points.size()) + " samples over a 2-worker run, PSS " + std::to_string(low >> 20) +
                      " to " + std::to_string(high >> 20) + " MiB");

    // Decoding alone, one thread: what one worker can do at most.
    start = Clock::now();
    int64_t frames = 0, pixels = 0;
    for (const auto& entry : fs::directory_iterator(cache.path)) {
        if (entry.path().extension() != ".jpg") continue;
        const demo::DecodedImage image = demo::load_jpeg(entry.path());
        ++frames;
        pixels += static_cast<int64_t>(image.width) * image.height;
    }
    const double decode_seconds = seconds_since(start);
    const int64_t samples = samples_in(reference.batches);
    int64_t rows = 0;
    for (const xtuner::Batch& b : reference.batches)
        for (const xtuner::Item& item : b) rows += item.seq_ctx.pixel_values ? item.seq_ctx.pixel_values->size(0) : 0;

    const auto per_second = [](int64_t count, double seconds) { return static_cast<double>(count) / seconds; };
    std::cout << std::fixed << std::setprecision(1) << "\nsummary: " << checks.passed << " passed, " << checks.failed
              << " failed\n"
              << "  config: " << options.samples << " samples, image_size " << options.image_size << ", pack_length "
              << options.pack_length << ", max_text_tokens " << options.max_text_tokens << ", micro_batches 2, "
              << per_epoch << " batches per epoch\n"
              << "  cache: " << files << " JPEG files, " << (jpeg_bytes >> 10) << " KiB, "
              << (cache.generated ? "generated in " : "reused (earlier run) in ") << generate_seconds * 1e3
              << " ms; a second ensure_cache " << reuse_seconds * 1e3 << " ms\n"
              << "  read + decode, 1 thread: " << per_second(frames, decode_seconds) << " frames/s, "
              << per_second(pixels, decode_seconds) / 1e6 << " Mpixel/s, " << per_second(jpeg_bytes, decode_seconds) / 1e6
              << " MB/s of JPEG\n"
              << "  loader, 2 epochs = " << samples << " samples, " << rows << " patch rows, "
              << (rows * demo::kPatchRowSize * 4 >> 20) << " MiB of pixel_values:\n"
              << "    0 workers " << per_second(samples, reference.seconds) << " samples/s, 2 workers "
              << per_second(samples, two_seconds) << ", 2 persistent " << per_second(samples, persistent_seconds)
              << ", 2 workers under PSS sampling " << per_second(samples, sampled_seconds) << '\n'
              << "  digest of the 2-epoch stream: " << digest << '\n';
    return checks.failed == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const Options options = parse_options(argc, argv);
        if (options.digest) {
            demo::MediaLoader loader(config_for(options, 0, false));
            std::cout << hex_digest(take(loader, 2).batches) << '\n';
            return 0;
        }
        return check(options, fs::read_symlink("/proc/self/exe").string());
    } catch (const std::exception& e) {
        std::cerr << "pipeline_check: " << e.what() << '\n';
        return 2;
    }
}
