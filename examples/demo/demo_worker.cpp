// spbcast_demo's rank mode: one rank of one arm (BASE or dedup) of one SP setting. The same code
// runs under the demo's own launcher and under torchrun --no-python; it needs only the launcher
// environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK).
//
// Per step: fetch the batch (leader_loader: with dedup on, only the SP leader runs a
// demo::MediaLoader and broadcasts), run the simulated model step, record the batch digest and
// the step time. A thread samples this process's share of the group memory all along (pss.hpp). At the end every rank sends its
// report through the job's store, and rank 0 writes them all to <run-dir>/arm.result and prints
// a summary of the arm.
#include "demo_worker.hpp"

#include "demo_results.hpp"
#include "loader.hpp"
#include "pss.hpp"

#include <spbcast/detail/base/version.hpp>
#include <spbcast/digest.hpp>
#include <spbcast/dist.hpp>
#include <spbcast/loader.hpp>

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace demo {

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

// The fixed compute of the simulated model step: square float32 matmuls on one thread.
class Matmuls {
public:
    static constexpr int64_t kDim = 256;

    Matmuls() {
        at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(20240601);  // not the default one
        a_ = at::randn({kDim, kDim}, gen, at::TensorOptions().dtype(at::kFloat));
        b_ = at::randn({kDim, kDim}, gen, at::TensorOptions().dtype(at::kFloat));
        c_ = at::empty({kDim, kDim}, at::TensorOptions().dtype(at::kFloat));
    }

    void run(int64_t count) {
        for (int64_t i = 0; i < count; ++i) at::mm_out(c_, a_, b_);
    }

private:
    at::Tensor a_, b_, c_;
};

// One training step of this rank: it reads its SP shard of the batch, draws dropout-like
// randomness from the default CPU generator (so that the generator moves as in a real step and
// BASE and dedup can be compared on it), does `iters` matmuls, and ends with the step's
// collectives: the SP group's exchange (attention all-to-all in a real model) and the DP
// gradient all-reduce. Every rank leaves the step together.
class SimulatedModel {
public:
    explicit SimulatedModel(int64_t iters) : iters_(iters) {}

    void step(const xtuner::Batch& batch, const spbcast::dist::sp_layout& layout) {
        int64_t tokens = 0;
        for (const xtuner::Item& item : batch) {
            const at::Tensor& ids = item.seq_ctx.input_ids;
            const int64_t shard = ids.size(1) / layout.sp_size;
            tokens += (ids.narrow(1, layout.sp_rank * shard, shard) != kPadTokenId).sum().item<int64_t>();
        }
        at::rand({1024});  // dropout masks and the like
        matmuls_.run(iters_);
        std::vector<at::Tensor> grads{at::full({1}, static_cast<double>(tokens), at::kFloat)};
        layout.sp_group->allreduce(grads)->wait();
        layout.dp_group->allreduce(grads)->wait();
    }

private:
    int64_t iters_;
    Matmuls matmuls_;
};

std::string read_text_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path.string());
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

void write_text_file(const fs::path& path, const std::string& text) {
    fs::create_directories(path.parent_path());
    const fs::path partial = path.string() + ".partial";
    {
        std::ofstream out(partial, std::ios::binary | std::ios::trunc);
        out << text;
        if (!out.flush()) throw std::runtime_error("cannot write " + partial.string());
    }
    fs::rename(partial, path);
}

std::string generator_state() {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor state = gen.get_state();
    return std::string(static_cast<const char*>(state.data_ptr()), static_cast<size_t>(state.numel()));
}

void set_generator_state(const std::string& bytes) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
    gen.set_state(state);
}

// The job's store (spbcast::dist::make_store: under torchrun a client of the agent's store).
// The store's wire protocol changed between PyTorch generations: a LibTorch 1.x client talking
// to a 2.x torchrun's store blocks in its first request, past any timeout. A watchdog turns that
// into a clear error.
c10::intrusive_ptr<c10d::Store> make_job_store(const spbcast::dist::launch_env& env,
                                               std::chrono::milliseconds timeout) {
    const char* agent = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
    if (!agent || std::string(agent) != "True") return spbcast::dist::make_store(env, timeout);
    constexpr auto kConnect = std::chrono::seconds(30);
    std::mutex mutex;
    std::condition_variable done;
    bool connected = false;
    std::thread watchdog([&] {
        std::unique_lock lock(mutex);
        if (done.wait_for(lock, kConnect, [&] { return connected; })) return;
        std::cerr << "spbcast_demo rank " << env.rank << ": error: no answer within " << kConnect.count()
                  << " s from the store that torchrun's agent serves on " << env.master_addr << ":"
                  << env.master_port << " (TORCHELASTIC_USE_AGENT_STORE=True). A torchrun from another "
                  << "PyTorch generation than this program's " << torch_description()
                  << " speaks another store protocol: use the torchrun of a matching PyTorch, or let "
                     "spbcast_demo start its ranks itself (its default launcher)"
                  << std::endl;
        std::_Exit(1);
    });
    c10::intrusive_ptr<c10d::Store> store;
    try {
        store = spbcast::dist::make_store(env, timeout);  // a client of the agent's store
    } catch (...) {
        {
            std::lock_guard lock(mutex);
            connected = true;  // failed, but with an error of its own
        }
        done.notify_all();
        watchdog.join();
        throw;
    }
    {
        std::lock_guard lock(mutex);
        connected = true;
    }
    done.notify_all();
    watchdog.join();
    return store;
}

void store_set(c10d::Store& store, const std::string& key, const std::string& value) {
    store.set(key, std::vector<uint8_t>(value.begin(), value.end()));
}

std::string store_get(c10d::Store& store, const std::string& key) {
    const std::vector<uint8_t> value = store.get(key);
    return {value.begin(), value.end()};
}

std::string fixed(double x, int digits) {
    std::ostringstream s;
    s << std::fixed << std::setprecision(digits) << x;
    return s.str();
}

}  // namespace

std::string torch_description() {
    return "LibTorch " + std::to_string(TORCH_VERSION_MAJOR) + "." + std::to_string(TORCH_VERSION_MINOR);
}

int64_t calibrate_model_iters(double model_ms) {
    if (model_ms <= 0) return 0;
    at::set_num_threads(1);
    Matmuls m;
    m.run(10);  // warm up
    constexpr int64_t kCount = 25;
    double best = 1e30;
    for (int round = 0; round < 4; ++round) {
        const auto start = Clock::now();
        m.run(kCount);
        best = std::min(best, std::chrono::duration<double, std::milli>(Clock::now() - start).count() / kCount);
    }
    return std::max<int64_t>(1, std::llround(model_ms / best));
}

int run_worker(const DemoOptions& o) {
    int rank = -1;
    try {
        const auto env = spbcast::dist::launch_env::from_environment();
        PssSampler sampler(std::chrono::milliseconds(50), Clock::time_point{}, env.world_size);  // steady_clock's own origin
        at::set_num_threads(1);  // ranks share the machine's cores; one thread of compute each
        if (o.receive_cache_mib >= 0)
            spbcast::set_receive_cache_limit(static_cast<std::size_t>(o.receive_cache_mib) << 20);
        rank = env.rank;
        const int sp = o.sp_sizes.front();
        const bool dedup = o.arm == "dedup";
        const auto timeout = std::chrono::seconds(std::max(60, o.timeout_s));
        auto store = make_job_store(env, timeout);
        const auto layout = spbcast::dist::make_sp_layout(store, env.rank, env.world_size, sp, timeout);
        const std::string label = !o.label.empty() ? o.label
                                                   : "SP" + std::to_string(sp) + "/DP" + std::to_string(layout.dp_size) +
                                                         " " + (dedup ? "dedup" : "BASE");
        const fs::path run_dir = !o.run_dir.empty() ? o.run_dir : o.out / "runs" / (o.arm + "-sp" + std::to_string(sp));
        const fs::path ckpt = !o.ckpt_dir.empty() ? o.ckpt_dir : o.out / "ckpt" / ("sp" + std::to_string(sp));

        // The same compute on every rank: rank 0 calibrates unless the launcher already did.
        int64_t iters = o.model_iters;
        if (iters == 0 && o.model_ms > 0) {
            if (env.rank == 0) store_set(*store, "demo/model_iters", std::to_string(calibrate_model_iters(o.model_ms)));
            iters = std::stoll(store_get(*store, "demo/model_iters"));
        }

        // Each rank's generator starts in its own state, as in a real job; a follower that
        // skipped or doubled a draw would end in another state than in BASE.
        at::manual_seed(1000 + static_cast<uint64_t>(env.rank));
        if (o.resume) set_generator_state(read_text_file(ckpt / ("rank" + std::to_string(env.rank) + ".rng")));

        RankResult result;
        result.rank = env.rank;
        result.sp = sp;
        result.world = env.world_size;
        result.sp_rank = layout.sp_rank;
        result.dp_rank = layout.dp_rank;
        {
            const spbcast::loader_config cfg{.sp_media_dedup = dedup,
                                             .total_step = o.steps,
                                             .timeout = timeout,
                                             .transport = o.transport == "network"
                                                              ? spbcast::transport_mode::network
                                                              : spbcast::transport_mode::automatic};
            const int64_t build_start = now_ns();
            auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [&] {
                PipelineConfig pipeline = o.pipeline(layout.dp_rank, layout.dp_size);
                // The leader's workers collate straight into shared memory, so the same-host
                // path hands the batch over without copying it.
                pipeline.collate_in_shared_memory = dedup && cfg.transport != spbcast::transport_mode::network;
                return std::make_unique<MediaLoader>(pipeline);
            });
            result.build_s = (now_ns() - build_start) * 1e-9;
            result.has_loader = loader.has_loader();
            if (o.resume) {
                // Only the leader's state is saved; followers hold no loader and skip this.
                const fs::path state = ckpt / ("dp" + std::to_string(layout.dp_rank) + ".loader");
                loader.load_state(loader.has_loader() ? read_text_file(state) : std::string());
            }
            if (env.rank == 0)
                std::cerr << "[demo] " << label << ": " << env.world_size << " ranks ready, "
                          << (dedup ? "only SP leaders load" : "every rank loads")
                          << (o.resume ? ", resumed from " + ckpt.string() : std::string()) << "\n";

            SimulatedModel model(iters);
            const int64_t report_every = std::max<int64_t>(1, o.steps / 4);
            int64_t group_first = o.resume ? -1 : 1;  // resumed: the first step taken
            std::vector<double> group_times;
            while (true) {
                StepRecord s;
                s.start_ns = now_ns();
                std::optional<xtuner::Batch> batch = loader.next();
                if (!batch) break;
                s.fetch_ns = now_ns() - s.start_ns;
                model.step(*batch, layout);
                s.end_ns = now_ns();
                s.step = loader.step();
                s.epoch = loader.epoch();
                s.digest = spbcast::digest(*batch);  // outside the timed step
                result.steps.push_back(s);
                batch.reset();

                if (group_first < 0) group_first = s.step;
                group_times.push_back((s.end_ns - s.start_ns) * 1e-9);
                const bool stopping = s.step == o.save_at;
                if (env.rank == 0 && (s.step % report_every == 0 || s.step == o.steps || stopping)) {
                    std::cerr << "[demo] " << label << ": steps " << group_first << "-" << s.step << " of "
                              << o.steps << ", median " << fixed(median(group_times), 3) << " s/step (rank 0)\n";
                    group_first = s.step + 1;
                    group_times.clear();
                }
                if (stopping) {
                    // A checkpoint as a trainer writes it: the leader's loader state (the same for
                    // its whole SP group) and every rank's generator state. Then the job stops.
                    if (loader.has_loader())
                        write_text_file(ckpt / ("dp" + std::to_string(layout.dp_rank) + ".loader"), loader.save_state());
                    write_text_file(ckpt / ("rank" + std::to_string(env.rank) + ".rng"), generator_state());
                    if (env.rank == 0)
                        std::cerr << "[demo] " << label << ": checkpoint saved after step " << s.step
                                  << " into " << ckpt.string() << "; stopping\n";
                    break;
                }
            }
        }  // the loader and its workers are gone before the last PSS sample
        {
            const std::string state = generator_state();
            result.rng = spbcast::detail::checksum64(state.data(), state.size());
        }
        for (const PssPoint& p : sampler.stop())
            result.pss.push_back({static_cast<int64_t>(p.t_seconds * 1e9), p.bytes});

        store_set(*store, "demo/result/" + std::to_string(env.rank), to_text(result));
        if (env.rank != 0) return 0;

        std::string all;
        for (int r = 0; r < env.world_size; ++r) all += store_get(*store, "demo/result/" + std::to_string(r));
        write_text_file(run_dir / "arm.result", all);
        const std::vector<RankResult> ranks = parse_results(all, (run_dir / "arm.result").string());
        const int64_t last = ranks.front().steps.empty() ? 0 : ranks.front().steps.back().step;
        const int64_t first = std::min(window_first_step(o.steps), last);
        const std::vector<std::string> mismatches = sp_group_mismatches(ranks);
        const PssSummary pss = summarise_pss(ranks, first, last);
        constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
        std::cout << "[demo] " << label << ": " << ranks.front().steps.size() << " steps on " << env.world_size
                  << " ranks; loaders built " << loaders_built(ranks) << "; SP-group digests equal: "
                  << (mismatches.empty() ? "yes" : "NO (" + mismatches.front() + ")") << "; median step (steps "
                  << first << "-" << last << ") " << fixed(median_step_seconds(ranks, first, last), 3)
                  << " s; group memory steady " << fixed(pss.steady_bytes / kGiB, 2) << " GiB, peak "
                  << fixed(pss.peak_bytes / kGiB, 2) << " GiB; results in " << (run_dir / "arm.result").string()
                  << "\n";
        return mismatches.empty() ? 0 : 1;
    } catch (const std::exception& e) {
        std::cerr << "spbcast_demo " << (rank < 0 ? std::string("(rank mode)") : "rank " + std::to_string(rank))
                  << ": error: " << e.what() << "\n";
        return 1;
    }
}

}  // namespace demo
