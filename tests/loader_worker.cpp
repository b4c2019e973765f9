// One rank of a leader-only-loading job, for the process tests (RNG parity, restart). Each rank
// has its own default CPU generator here, as in a real job.
//
//   spbcast_loader_worker <base|dedup> <sp_size> <media|media-persistent|torchdata|faulty>
//                         <total_step> <save_at_step|0> <state_dir> <resume 0|1>
//
// Prints "step S epoch E digest D" per step and "rng R" (a checksum of the default CPU
// generator's state) at the end. With save_at_step, it saves the leader's loader state and
// this rank's generator state into state_dir after that step and exits, like a job stopped
// at a checkpoint; with resume 1 it restores both and continues. SPBCAST_LOADER_PREFETCH sets
// loader_config::prefetch (default: on). "faulty" runs a loader that
// fails on two steps under a trainer that skips them, printing "call ..." after every call.
#include "support/media_loader.hpp"
#include "support/set_up.hpp"

#include <spbcast/spbcast.hpp>

#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

namespace {

// A map-style dataset for torch::data: sample i is (arange(4i, 4i+4), i).
struct IndexDataset : torch::data::datasets::Dataset<IndexDataset> {
    torch::data::Example<> get(size_t index) override {
        const auto i = static_cast<int64_t>(index);
        return {at::arange(4 * i, 4 * i + 4), at::scalar_tensor(i, at::kLong)};
    }
    torch::optional<size_t> size() const override { return 40; }
};

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) throw std::runtime_error("cannot read " + path);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

void write_file(const std::string& path, const std::string& text) {
    std::ofstream(path, std::ios::binary) << text;
}

std::string generator_state() {
    const auto bytes = spbcast_test::default_generator_state();
    return std::string(bytes.begin(), bytes.end());
}

void set_generator_state(const std::string& bytes) {
    at::Generator gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    at::Tensor state = at::empty({static_cast<int64_t>(bytes.size())}, at::kByte);
    std::memcpy(state.data_ptr(), bytes.data(), bytes.size());
    gen.set_state(state);
}

// Five batches a pass, shuffled by a randperm(5) from the default CPU generator at every
// begin(), as torch::data's RandomSampler does. Its 6th fetch (the first of epoch 1) throws; its
// 11th (the first of epoch 2) yields a sparse batch, which spbcast refuses to send. Both come
// right after a begin(), so the step that fails carries that pass's RNG event.
struct faulty_loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::events;
    static constexpr int64_t batches = 5;
    int64_t fetches = 0;
    std::vector<spbcast::rng_event> construction_rng_events() const { return {}; }
    std::vector<spbcast::rng_event> iterator_rng_events() const {
        return {{.kind = spbcast::rng_event::randperm, .n = batches}};
    }
    int64_t size() const { return batches; }
    struct pass_t {
        faulty_loader* self;
        at::Tensor order;
        int64_t taken = 0;
        std::optional<at::Tensor> next() {
            if (taken == batches) return std::nullopt;
            const int64_t sample = order[taken++].item<int64_t>();
            ++self->fetches;
            if (self->fetches == 6) throw std::runtime_error("decoder crashed on sample " + std::to_string(sample));
            if (self->fetches == 11) return at::arange(4).to_sparse();
            return at::arange(4) + 10 * sample;
        }
    };
    pass_t begin() { return {this, at::randperm(batches)}; }
};

// A trainer that skips a step whose batch failed: it catches the error (in BASE the loader's
// own exception; with dedup spbcast::error, errc::loader) and calls next() again. A sparse
// batch is skipped as well, so BASE skips the steps dedup cannot send. After every call it
// prints the counters and this rank's generator state.
template <class Loader>
int run_skipping_errors(Loader& loader) {
    for (;;) {
        std::string outcome;
        bool more = true;
        try {
            auto batch = loader.next();
            more = batch.has_value();
            if (batch && batch->is_sparse()) outcome = "skipped";
            else if (batch) outcome = "batch " + std::to_string(batch->sum().template item<int64_t>());
            else outcome = "end";
        } catch (const spbcast::error& e) {
            outcome = e.code() == spbcast::errc::loader ? "skipped" : std::string("unexpected ") + e.what();
        } catch (const std::exception&) {
            outcome = "skipped";
        }
        const std::string state = generator_state();
        std::cout << "call step " << loader.step() << " epoch " << loader.epoch() << " " << outcome << " rng "
                  << std::hex << spbcast::detail::checksum64(state.data(), state.size()) << std::dec << "\n";
        if (!more) return 0;
        at::rand({3});  // the training step's own CPU randomness
    }
}

template <class Loader>
int run(Loader& loader, const spbcast::dist::sp_layout& layout, int save_at, const std::string& dir) {
    while (auto batch = loader.next()) {
        std::cout << "step " << loader.step() << " epoch " << loader.epoch() << " digest " << std::hex
                  << spbcast::digest(*batch) << std::dec << "\n";
        at::rand({3});  // the training step's own CPU randomness (dropout masks and the like)
        if (loader.step() == save_at) {
            if (loader.has_loader() && layout.is_sp_leader())
                write_file(dir + "/dp" + std::to_string(layout.dp_rank) + ".loader", loader.save_state());
            write_file(dir + "/rank" + std::to_string(layout.rank) + ".rng", generator_state());
            std::cout << "saved at step " << save_at << "\n";
            return 0;
        }
    }
    const std::string state = generator_state();
    std::cout << "rng " << std::hex << spbcast::detail::checksum64(state.data(), state.size()) << std::dec << "\n";
    return 0;
}

}  // namespace

int main(int argc, char** argv) {
    if (argc != 8) {
        std::cerr << "usage: spbcast_loader_worker <base|dedup> <sp> <media|media-persistent|torchdata|faulty> "
                     "<total_step> <save_at|0> <state_dir> <resume 0|1>\n";
        return 2;
    }
    const bool dedup = std::string(argv[1]) == "dedup";
    const int sp = std::stoi(argv[2]);
    const std::string kind = argv[3];
    const int64_t total_step = std::stoll(argv[4]);
    const int save_at = std::stoi(argv[5]);
    const std::string dir = argv[6];
    const bool resume = std::string(argv[7]) == "1";
    try {
        const auto env = spbcast::dist::launch_env::from_environment();
        auto store = spbcast::dist::make_store(env, std::chrono::seconds(60));
        const auto layout = spbcast::dist::make_sp_layout(store, env.rank, env.world_size, sp, std::chrono::seconds(60));
        spbcast_test::wait_for_set_up(*store, env.rank, env.world_size, std::chrono::seconds(60));
        // Every rank's generator starts in its own state, so a follower that skipped or
        // doubled a draw could not match BASE by accident. torch::data's RandomSampler shuffles
        // with the default generator, so there the SP ranks of a replica must start equal (as
        // they must in BASE, or they would load different batches); so for the faulty loader.
        at::manual_seed(kind == "torchdata" || kind == "faulty" ? 1000 + layout.dp_rank : 1000 + env.rank);
        spbcast::loader_config cfg{.sp_media_dedup = dedup, .total_step = total_step,
                                   .timeout = std::chrono::seconds(60)};
        // The prefetch depth (on by default); the tests compare it with 0, the synchronous loop.
        if (const char* depth = std::getenv("SPBCAST_LOADER_PREFETCH")) cfg.prefetch = std::stoul(depth);
        if (resume) set_generator_state(read_file(dir + "/rank" + std::to_string(env.rank) + ".rng"));
        if (kind == "faulty") {
            auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [] { return std::make_unique<faulty_loader>(); });
            const int rc = run_skipping_errors(loader);
            if (rc == 0) spbcast_test::leave_together(*store, env.rank, env.world_size);
            return rc;
        }
        if (kind == "torchdata") {
            auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [] {
                auto torch_loader = torch::data::make_data_loader(
                    IndexDataset{}.map(torch::data::transforms::Stack<>()),
                    torch::data::samplers::RandomSampler(40),
                    torch::data::DataLoaderOptions().batch_size(4).workers(2));
                using TorchLoader = decltype(torch_loader)::element_type;
                return std::make_unique<spbcast::torch_data_loader<TorchLoader>>(std::move(torch_loader), 40);
            });
            const int rc = run(loader, layout, save_at, dir);
            if (rc == 0) spbcast_test::leave_together(*store, env.rank, env.world_size);
            return rc;
        }
        const bool persistent = kind == "media-persistent";
        auto loader = spbcast::make_leader_loader(cfg, layout.sp_group, 1, [&] {
            return std::make_unique<demo::MediaLoader>(
                spbcast_test::small_pipeline(2, persistent, layout.dp_rank, layout.dp_size));
        });
        if (resume) {
            const std::string path = dir + "/dp" + std::to_string(layout.dp_rank) + ".loader";
            // Followers skip loader checkpoint work: only the leader reads the state.
            loader.load_state(loader.has_loader() ? read_file(path) : std::string());
        }
        const int rc = run(loader, layout, save_at, dir);
        if (rc == 0) spbcast_test::leave_together(*store, env.rank, env.world_size);
        return rc;
    } catch (const std::exception& e) {
        std::cerr << "loader worker failed: " << e.what() << "\n";
        return 1;
    }
}
