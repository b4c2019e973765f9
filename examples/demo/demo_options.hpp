// spbcast_demo's command line: one set of options for both modes. The launcher mode (the
// default) starts the ranks itself and passes them the options they need; the rank mode
// (--worker) is what every rank runs, under that launcher or under torchrun --no-python.
#pragma once

#include "config.hpp"

#include <cstdint>
#include <filesystem>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef SPBCAST_DEMO_PYTHON
#define SPBCAST_DEMO_PYTHON "python3"
#endif
#ifndef SPBCAST_DEMO_SOURCE_DIR
#define SPBCAST_DEMO_SOURCE_DIR "."
#endif

namespace demo {

struct DemoOptions {
    // What to run.
    int world_size = 4;
    std::vector<int> sp_sizes{2, 4};
    int64_t steps = 20;

    // The data pipeline (see config.hpp). Defaults: a pack of 16384 tokens holds about 13
    // samples and 3900 patch rows (23 MiB of pixel_values), 29 packs an epoch - media-heavy,
    // yet four BASE ranks with two workers each stay near 1 GiB of PSS, and SP2/DP2 crosses an
    // epoch boundary within 20 steps.
    std::filesystem::path cache_dir = std::filesystem::temp_directory_path() / "spbcast-demo-media";
    int64_t samples = 384;
    int image_size = 320;
    int max_text_tokens = 2048;
    int64_t pack_length = 16384;
    int micro_batches = 1;
    int workers = 2;
    bool persistent_workers = false;
    int64_t receive_cache_mib = -1;  // followers' spbcast receive cache; -1: the library default
    std::string transport = "auto";  // dedup's broadcasts: auto (same host where possible) or network

    // The simulated model step: model_ms of single-thread matmul work, turned into a fixed
    // number of matmuls (model_iters) that is the same on every rank and in every arm.
    double model_ms = 60;
    int64_t model_iters = 0;  // 0: calibrate (the launcher, or rank 0 in rank mode)

    // Output and launching.
    std::filesystem::path out = "demo-out";
    std::string python = SPBCAST_DEMO_PYTHON;
    std::string launcher = "local";  // local | torchrun
    std::string torchrun;            // empty: next to the Python, then PATH
    int timeout_s = 300;             // deadline of one launch (all its ranks)
    bool quick = false;
    bool help = false;

    // Rank mode.
    bool worker = false;
    std::string arm = "dedup";       // base | dedup
    int64_t save_at = 0;             // save a checkpoint after this step and stop (0: never)
    bool resume = false;             // restore the checkpoint in ckpt_dir first
    std::filesystem::path run_dir;   // where rank 0 writes the arm's results (default out/runs/<arm>-sp<S>)
    std::filesystem::path ckpt_dir;  // default out/ckpt/sp<S>
    std::string label;               // for progress lines; default "SP<S>/DP<D> <arm>"

    PipelineConfig pipeline(int dp_rank, int dp_size) const {
        PipelineConfig c;
        c.cache_dir = cache_dir;
        c.num_samples = samples;
        c.image_size = image_size;
        c.max_text_tokens = max_text_tokens;
        c.pack_length = pack_length;
        c.micro_batches = micro_batches;
        c.num_workers = workers;
        c.persistent_workers = persistent_workers;
        c.dp_rank = dp_rank;
        c.dp_size = dp_size;
        return c;
    }
};

inline const char* kUsage = R"(spbcast_demo - SP leader-only data loading, end to end.

For each SP setting it runs the same DP x SP data iteration on local processes twice: BASE
(sp_media_dedup off: every rank runs its own multimodal loader) and dedup (only the SP leaders
load; each step they broadcast the collated batch to their SP group). Each step is followed
by a simulated model step of fixed compute. It then checks that every rank saw the same batches
in both arms, stops the dedup run at a checkpoint and resumes it in new processes, and prints
loaders built, median step time and the CPU memory (PSS) of all ranks together.

usage:
  spbcast_demo [options]          run the demo; starts its own ranks (fork/exec of itself)
  spbcast_demo --quick            a CI-sized run (SP2 only, 8 steps, small media)
  torchrun --no-python --nproc-per-node 4 spbcast_demo --worker --sp 2 --arm dedup [options]
                                  one arm, as ranks of your own launcher; rank 0 prints a summary

options:
  --world-size N          ranks (default 4)
  --sp LIST               SP sizes to compare, comma-separated, each dividing N (default 2,4)
  --steps N               steps per arm (default 20); the restart stops at N/2
  --image-size PX         largest media side, a multiple of 32 (default 320)
  --samples N             samples in the generated dataset (default 384)
  --max-text-tokens N     text tokens per sample are drawn from [16, N] (default 2048)
  --pack-length L         tokens per packed micro-batch (default 16384)
  --micro-batches M       packs per collated batch (default 1)
  --workers W             loader worker threads per loader (default 2)
  --persistent-workers    keep a loader's workers across epochs
  --receive-cache-mib N   followers' spbcast receive cache limit (0: off; default: the library's)
  --transport T           with --worker: the dedup arm's broadcasts, auto (the same-host path where
                          possible, default) or network; the launcher runs dedup both ways
  --model-ms MS           simulated model step: MS ms of single-thread matmul (default 60)
  --out DIR               results folder (default ./demo-out)
  --cache DIR             media cache folder (default $TMPDIR/spbcast-demo-media)
  --python PATH           Python with matplotlib for the plot (default: CMake's SPBCAST_PYTHON)
  --launcher local|torchrun
                          start the ranks with fork/exec (default) or with torchrun --no-python
  --torchrun PATH         the torchrun to use (default: next to the Python, else on PATH)
  --timeout S             deadline of one launch in seconds (default 300)
  --quick                 --sp 2 --steps 8 --samples 96 --image-size 192 --max-text-tokens 1024
                          --pack-length 4096 --model-ms 25 (flags given as well win)
  --help                  this text

rank mode (what the launcher runs; usable under torchrun --no-python):
  --worker                read MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK
  --arm base|dedup        sp_media_dedup off or on (default dedup)
  --sp S                  one SP size
  --save-at K             after step K save a checkpoint into --ckpt and stop
  --resume                restore the checkpoint in --ckpt, then continue to --steps
  --ckpt DIR              checkpoint folder (default OUT/ckpt/sp<S>)
  --run-dir DIR           where rank 0 writes this arm's results (default OUT/runs/<arm>-sp<S>)
  --model-iters K         matmuls per model step (default: rank 0 calibrates --model-ms)
  --label TEXT            name in progress lines

exit status: 0 when every check passed, 1 when a check failed, 2 for a usage error, 3 when a
rank failed or ran past the deadline.
)";

struct UsageError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};

namespace detail {

inline int64_t parse_integer(const std::string& flag, const std::string& text, int64_t lowest) {
    try {
        std::size_t used = 0;
        const long long n = std::stoll(text, &used);
        if (used == text.size() && n >= lowest) return n;
    } catch (const std::exception&) {
    }
    throw UsageError(flag + " needs an integer >= " + std::to_string(lowest) + ", got '" + text + "'");
}

inline double parse_number(const std::string& flag, const std::string& text) {
    try {
        std::size_t used = 0;
        const double x = std::stod(text, &used);
        if (used == text.size() && x >= 0) return x;
    } catch (const std::exception&) {
    }
    throw UsageError(flag + " needs a number >= 0, got '" + text + "'");
}

}  // namespace detail

inline DemoOptions parse_options(int argc, char** argv) {
    DemoOptions o;
    for (int i = 1; i < argc; ++i)
        if (std::string(argv[i]) == "--quick") {
            o.quick = true;
            o.sp_sizes = {2};
            o.steps = 8;
            o.samples = 96;
            o.image_size = 192;
            o.max_text_tokens = 1024;
            o.pack_length = 4096;
            o.model_ms = 25;
        }
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) throw UsageError(arg + " needs a value");
            return argv[++i];
        };
        using detail::parse_integer;
        if (arg == "--help" || arg == "-h") o.help = true;
        else if (arg == "--quick") {}
        else if (arg == "--world-size") o.world_size = static_cast<int>(parse_integer(arg, value(), 1));
        else if (arg == "--sp") {
            o.sp_sizes.clear();
            const std::string list = value();
            for (std::size_t begin = 0; begin <= list.size();) {
                const std::size_t end = std::min(list.find(',', begin), list.size());
                o.sp_sizes.push_back(static_cast<int>(parse_integer(arg, list.substr(begin, end - begin), 1)));
                begin = end + 1;
            }
        }
        else if (arg == "--steps") o.steps = parse_integer(arg, value(), 1);
        else if (arg == "--image-size") o.image_size = static_cast<int>(parse_integer(arg, value(), 32));
        else if (arg == "--samples") o.samples = parse_integer(arg, value(), 1);
        else if (arg == "--max-text-tokens") o.max_text_tokens = static_cast<int>(parse_integer(arg, value(), 16));
        else if (arg == "--pack-length") o.pack_length = parse_integer(arg, value(), 1);
        else if (arg == "--micro-batches") o.micro_batches = static_cast<int>(parse_integer(arg, value(), 1));
        else if (arg == "--workers") o.workers = static_cast<int>(parse_integer(arg, value(), 0));
        else if (arg == "--receive-cache-mib") o.receive_cache_mib = parse_integer(arg, value(), 0);
        else if (arg == "--transport") {
            o.transport = value();
            if (o.transport != "auto" && o.transport != "network") throw UsageError("--transport is auto or network, got '" + o.transport + "'");
        }
        else if (arg == "--persistent-workers") o.persistent_workers = true;
        else if (arg == "--model-ms") o.model_ms = detail::parse_number(arg, value());
        else if (arg == "--model-iters") o.model_iters = parse_integer(arg, value(), 0);
        else if (arg == "--out") o.out = value();
        else if (arg == "--cache") o.cache_dir = value();
        else if (arg == "--python") o.python = value();
        else if (arg == "--launcher") o.launcher = value();
        else if (arg == "--torchrun") o.torchrun = value();
        else if (arg == "--timeout") o.timeout_s = static_cast<int>(parse_integer(arg, value(), 1));
        else if (arg == "--worker") o.worker = true;
        else if (arg == "--arm") o.arm = value();
        else if (arg == "--save-at") o.save_at = parse_integer(arg, value(), 0);
        else if (arg == "--resume") o.resume = true;
        else if (arg == "--ckpt") o.ckpt_dir = value();
        else if (arg == "--run-dir") o.run_dir = value();
        else if (arg == "--label") o.label = value();
        else throw UsageError("unknown option '" + arg + "'; see --help");
    }
    if (o.help) return o;
    if (o.launcher != "local" && o.launcher != "torchrun")
        throw UsageError("--launcher must be local or torchrun, got '" + o.launcher + "'");
    if (o.arm != "base" && o.arm != "dedup") throw UsageError("--arm must be base or dedup, got '" + o.arm + "'");
    if (o.sp_sizes.empty()) throw UsageError("--sp needs at least one SP size");
    if (o.worker && o.sp_sizes.size() != 1) throw UsageError("--worker runs one SP size; pass --sp S");
    if (o.save_at > 0 && o.resume) throw UsageError("--save-at and --resume are two separate runs");
    if (o.save_at >= o.steps) throw UsageError("--save-at must be below --steps");
    if (!o.worker) {
        for (int sp : o.sp_sizes)
            if (o.world_size % sp != 0)
                throw UsageError("SP size " + std::to_string(sp) + " does not divide --world-size " +
                                 std::to_string(o.world_size));
        if (o.steps < 2) throw UsageError("--steps must be at least 2 (the restart stops half-way)");
    }
    try {
        validate(o.pipeline(0, 1));
    } catch (const std::invalid_argument& e) {
        throw UsageError(e.what());
    }
    return o;
}

}  // namespace demo
