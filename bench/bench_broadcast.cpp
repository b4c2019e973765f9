// spbcast_bench: spbcast::broadcast against the transport's own limit and against the C++
// alternatives, on realistic batches (examples/common/profiles.hpp) over loopback Gloo.
//
// Two modes, one program:
//
//   launcher  spbcast_bench --world-sizes 2,4,8 [--profiles ...] [--micro-batches 1,4] ...
//             For every cell (profile x micro-batches x world size) starts world-size copies of
//             itself with the launcher environment (MASTER_ADDR, MASTER_PORT, RANK,
//             WORLD_SIZE) and a store it serves on a port the kernel picked, bounded by
//             --cell-timeout and --deadline, collects the root's rows and writes one JSON
//             document (--json).
//   rank      spbcast_bench [--profiles ...] [--micro-batches ...] --rows FILE
//             One rank, under the launcher above or torchrun --no-python: builds the Gloo
//             group from the environment (spbcast::dist) and measures every cell it is given
//             on that group; rank 0 appends one JSON line per method to FILE.
//
// Methods, all on the same group and the same batch, in this order:
//   raw        one broadcast of a single uint8 buffer of the payload size, allocated once
//              (the transport's limit);
//   raw_fresh  the same, but followers allocate the buffer each step, as a receiver of a new
//              batch must (shows what page faults cost on this machine);
//   spbcast    spbcast::broadcast(batch, group) over the network path (transport_mode::network);
//   spbcast_shm  the same over the same-host path (transport_mode::shared_memory): the payload
//              in a shared segment the followers map, no payload collective;
//   spbcast_shm_alloc  the same, with the root's batch allocated in shared memory in the first
//              place (spbcast::shared_memory_scope, as a collator would): its large storages
//              are handed over without a copy. The root's batch is rebuilt in the scope before
//              each step, outside the timed region;
//   naive      the metadata serialized into one buffer (its size broadcast, then its bytes),
//              then one broadcast per distinct tensor;
//   coalesced  c10d::broadcast_coalesced (LibTorch's own, bucketed per dtype), the shapes given
//              in advance: followers allocate from known shapes and only the bytes travel.
//
// A third mode measures one seed-scale batch (issue 30): several GiB, one tensor over 2^31 bytes:
//   seed      spbcast_bench --seed-scale --world-sizes 4 [--seed-gib 2.25] [--repeats 5]
//             [--seed-network] [--seed-work-ms 500] - see seed_scale_rank below.
//
// Per method: one untimed step whose result is checked (spbcast::digest of what a follower
// rebuilt equals the root's) and whose collectives are counted, then --warmup untimed steps
// inside a memory window. Then --repeats timed rounds, every method once per round (order
// rotated), so that a slow spell on a shared machine hits all methods alike. Every step starts
// with a barrier; its time is the slowest rank's (allreduce MAX, outside the timed region).
// Collectives are counted by a forwarding group (spbcast's process_group concept) or, for
// broadcast_coalesced, a forwarding c10d backend. Extra memory, per rank, over the warm-up
// steps: the peak RSS (VmHWM, reset through /proc/self/clear_refs after malloc_trim) minus the
// RSS before them, and the peak of live tensor bytes (a counting CPU allocator) minus the live
// bytes before them.
#include "profiles.hpp"
#include "support/processes.hpp"

#include <spbcast/spbcast.hpp>

#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>

#include <ATen/Parallel.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <iostream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

extern char** environ;

namespace {

using clock_type = std::chrono::steady_clock;
using gloo_ptr = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

const std::vector<std::string> all_methods = {"raw", "raw_fresh", "spbcast", "spbcast_shm", "spbcast_shm_alloc", "naive", "coalesced"};

// ---------------------------------------------------------------------------------------------
// Command line

struct config {
    std::vector<std::string> profiles = {"text", "qwen3-vl-image", "interns1-tiles",
                                         "qwen3-vl-video-long"};
    std::vector<int> micro_batches = {1, 4};
    std::vector<int> world_sizes;  // launcher mode when set
    std::vector<std::string> methods = all_methods;
    int repeats = 7, warmup = 2;
    int big_repeats = -1;                        // repeats for cells of >= big_bytes (-1: same)
    std::uint64_t big_bytes = std::uint64_t{256} << 20;
    std::uint64_t seed = 0;
    std::size_t bucket_bytes = spbcast::options{}.bucket_bytes;
    int threads = 1;
    double pg_timeout = 300, cell_timeout = 1200, deadline = 4 * 3600;
    double mem_limit_gib = -1;  // -1: 85% of MemAvailable; 0: no check
    std::string json = "spbcast_bench.json", rows;
    // --seed-scale: one batch of seed_gib GiB (seed_scale_rank).
    bool seed_scale = false, seed_network = false;
    double seed_gib = 2.25;
    int seed_work_ms = 500;
    double seed_fixed_limit_gib = -1;  // >= 0: the pool's and the receive cache's bounds fixed (as before issue 30)
};

std::vector<std::string> split(const std::string& text) {
    std::vector<std::string> out;
    std::stringstream in(text);
    for (std::string item; std::getline(in, item, ',');)
        if (!item.empty()) out.push_back(item);
    return out;
}

std::vector<int> split_ints(const std::string& text) {
    std::vector<int> out;
    for (const auto& s : split(text)) out.push_back(std::stoi(s));
    return out;
}

std::string join(const std::vector<std::string>& items) {
    std::string out;
    for (const auto& s : items) out += (out.empty() ? "" : ",") + s;
    return out;
}

// Appends `item` to a `separator`-separated list (written so that GCC 12 sees no overflow in
// the string concatenation it would otherwise inline).
void append_item(std::string& list, const char* separator, const std::string& item) {
    if (!list.empty()) list += separator;
    list += item;
}

std::string join_ints(const std::vector<int>& items) {
    std::string out;
    for (int s : items) {
        if (!out.empty()) out += ',';
        out += std::to_string(s);
    }
    return out;
}

[[noreturn]] void usage(const std::string& error) {
    std::cerr
        << "spbcast_bench: " << error << "\n"
        << "usage: spbcast_bench [--world-sizes 2,4,8] [--profiles text,qwen3-vl-image,...]\n"
           "         [--micro-batches 1,4] [--methods raw,raw_fresh,spbcast,spbcast_shm,spbcast_shm_alloc,naive,coalesced]\n"
           "         [--repeats 7] [--warmup 2] [--big-repeats N --big-mib 256] [--seed 0]\n"
           "         [--bucket-mib 16] [--threads 1] [--pg-timeout 300] [--cell-timeout 1200]\n"
           "         [--deadline 14400] [--mem-limit-gib G] [--json out.json] [--rows rows.jsonl]\n"
           "       spbcast_bench --seed-scale --world-sizes 4 [--seed-gib 2.25] [--repeats 5]\n"
           "         [--seed-network] [--seed-work-ms 500] [--seed-fixed-limit-gib G]\n"
           "         [--pg-timeout 300] [--cell-timeout 1200]\n"
           "  with --world-sizes: launcher (runs every cell, writes --json);\n"
           "  without: one rank under MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE (writes --rows).\n";
    std::exit(2);
}

config parse(int argc, char** argv) {
    config cfg;
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        auto value = [&]() -> std::string {
            if (i + 1 >= argc) usage("missing value after " + arg);
            return argv[++i];
        };
        if (arg == "--profiles") cfg.profiles = split(value());
        else if (arg == "--micro-batches") cfg.micro_batches = split_ints(value());
        else if (arg == "--world-sizes") cfg.world_sizes = split_ints(value());
        else if (arg == "--methods") cfg.methods = split(value());
        else if (arg == "--repeats") cfg.repeats = std::stoi(value());
        else if (arg == "--warmup") cfg.warmup = std::stoi(value());
        else if (arg == "--big-repeats") cfg.big_repeats = std::stoi(value());
        else if (arg == "--big-mib") cfg.big_bytes = std::stoull(value()) << 20;
        else if (arg == "--seed") cfg.seed = std::stoull(value());
        else if (arg == "--bucket-mib") cfg.bucket_bytes = std::stoull(value()) << 20;
        else if (arg == "--threads") cfg.threads = std::stoi(value());
        else if (arg == "--pg-timeout") cfg.pg_timeout = std::stod(value());
        else if (arg == "--cell-timeout") cfg.cell_timeout = std::stod(value());
        else if (arg == "--deadline") cfg.deadline = std::stod(value());
        else if (arg == "--mem-limit-gib") cfg.mem_limit_gib = std::stod(value());
        else if (arg == "--json") cfg.json = value();
        else if (arg == "--rows") cfg.rows = value();
        else if (arg == "--seed-scale") cfg.seed_scale = true;
        else if (arg == "--seed-gib") cfg.seed_gib = std::stod(value());
        else if (arg == "--seed-network") cfg.seed_network = true;
        else if (arg == "--seed-work-ms") cfg.seed_work_ms = std::stoi(value());
        else if (arg == "--seed-fixed-limit-gib") cfg.seed_fixed_limit_gib = std::stod(value());
        else if (arg == "--help" || arg == "-h") usage("help");
        else usage("unknown argument " + arg);
    }
    for (const auto& p : cfg.profiles) xtuner::profile_from_name(p);  // throws on a bad name
    for (const auto& m : cfg.methods)
        if (std::find(all_methods.begin(), all_methods.end(), m) == all_methods.end())
            usage("unknown method " + m);
    for (int w : cfg.world_sizes)
        if (w < 2) usage("every world size must be at least 2");
    if (cfg.repeats < 1 || cfg.warmup < 0) usage("--repeats must be >= 1 and --warmup >= 0");
    return cfg;
}

// ---------------------------------------------------------------------------------------------
// JSON output (flat rows; no library needed)

std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
        switch (c) {
            case '"': out += "\\\""; break;
            case '\\': out += "\\\\"; break;
            case '\n': out += "\\n"; break;
            case '\t': out += "\\t"; break;
            default:
                if (static_cast<unsigned char>(c) < 0x20) {
                    char buf[8];
                    std::snprintf(buf, sizeof buf, "\\u%04x", c);
                    out += buf;
                } else {
                    out += c;
                }
        }
    }
    return out + "\"";
}

std::string number(double v) {
    std::ostringstream out;
    out << std::setprecision(9) << v;
    return out.str();
}

struct json_object {
    std::vector<std::pair<std::string, std::string>> fields;
    json_object& raw(const std::string& key, const std::string& json) {
        fields.emplace_back(key, json);
        return *this;
    }
    json_object& str(const std::string& key, const std::string& v) { return raw(key, quote(v)); }
    json_object& num(const std::string& key, double v) { return raw(key, number(v)); }
    json_object& integer(const std::string& key, std::int64_t v) { return raw(key, std::to_string(v)); }
    json_object& boolean(const std::string& key, bool v) { return raw(key, v ? "true" : "false"); }
    json_object& null(const std::string& key) { return raw(key, "null"); }
    std::string dump() const {
        std::string out = "{";
        for (std::size_t i = 0; i < fields.size(); ++i)
            out += (i ? ", " : "") + quote(fields[i].first) + ": " + fields[i].second;
        return out + "}";
    }
};

// ---------------------------------------------------------------------------------------------
// Memory: RSS and its kernel-kept peak

std::int64_t rss_bytes() {
    std::ifstream in("/proc/self/statm");
    std::int64_t size = 0, resident = 0;
    in >> size >> resident;
    return resident * ::sysconf(_SC_PAGESIZE);
}

std::int64_t status_kib(const std::string& key) {
    std::ifstream in("/proc/self/status");
    for (std::string line; std::getline(in, line);)
        if (line.rfind(key + ":", 0) == 0) return std::stoll(line.substr(key.size() + 1));
    return -1;
}

// Frees what the heap can give back and restarts the kernel's peak-RSS counter; false when the
// counter cannot be reset (then peaks are an upper bound from an earlier high-water mark).
bool open_memory_window() {
    ::malloc_trim(0);
    std::ofstream clear("/proc/self/clear_refs");
    clear << "5";
    clear.flush();
    return static_cast<bool>(clear);
}

std::int64_t peak_rss_bytes() { return status_kib("VmHWM") * 1024; }

std::int64_t mem_available_bytes() {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);)
        if (line.rfind("MemAvailable:", 0) == 0) return std::stoll(line.substr(13)) * 1024;
    return 0;
}

// Tensor memory, exactly: a CPU allocator that forwards to LibTorch's and keeps the live and
// peak bytes of every tensor storage allocated through it (at::empty and friends). RSS tells
// what the process really holds, but at sub-MiB sizes it is mostly the heap's own bookkeeping;
// this tells what the method itself asked for.
class tracking_allocator final : public c10::Allocator {
public:
    explicit tracking_allocator(c10::Allocator* inner) : inner_(inner) {}

#if TORCH_VERSION_MAJOR >= 2
    c10::DataPtr allocate(size_t n) override { return track(inner_->allocate(n), n); }
    void copy_data(void* dest, const void* src, std::size_t count) const override {
        std::memcpy(dest, src, count);
    }
#else
    c10::DataPtr allocate(size_t n) const override { return track(inner_->allocate(n), n); }
#endif

    std::int64_t live() const { return live_.load(); }
    std::int64_t peak() const { return peak_.load(); }
    void reset_peak() { peak_.store(live_.load()); }

private:
    struct record {
        c10::DataPtr inner;
        std::int64_t bytes;
        const tracking_allocator* owner;
    };

    static void release(void* context) {
        auto* r = static_cast<record*>(context);
        r->owner->live_.fetch_sub(r->bytes);
        delete r;  // frees the memory through LibTorch's deleter
    }

    c10::DataPtr track(c10::DataPtr inner, size_t n) const {
        void* data = inner.get();
        const auto device = inner.device();
        auto* r = new record{std::move(inner), static_cast<std::int64_t>(n), this};
        const std::int64_t now = live_.fetch_add(r->bytes) + r->bytes;
        for (std::int64_t seen = peak_.load(); now > seen && !peak_.compare_exchange_weak(seen, now);) {
        }
        return c10::DataPtr(data, r, &tracking_allocator::release, device);
    }

    c10::Allocator* inner_;
    mutable std::atomic<std::int64_t> live_{0}, peak_{0};
};

tracking_allocator& tensor_memory() {
    static auto* tracker = new tracking_allocator(c10::GetDefaultCPUAllocator());  // never destroyed
    return *tracker;
}

// ---------------------------------------------------------------------------------------------
// Counting groups: forward every broadcast to the real group and count it.

// Satisfies spbcast::process_group; used by raw, spbcast and naive.
template <class Group>
struct counting_group {
    Group* inner;
    std::uint64_t* count;
    ~counting_group() { spbcast::forget_group(*this); }  // spbcast knows it by its address
    int getRank() const { return inner->getRank(); }
    int getSize() const { return inner->getSize(); }
    auto broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) {
        ++*count;
        return inner->broadcast(tensors, opts);
    }
};
static_assert(spbcast::process_group<counting_group<c10d::ProcessGroupGloo>>);

// broadcast_coalesced needs a c10d::ProcessGroup. In LibTorch 1.x ProcessGroupGloo is one; in
// 2.x it is a Backend that a ProcessGroup dispatches to. Either way a forwarding subclass
// counts the broadcasts it issues.
#if TORCH_VERSION_MAJOR >= 2
class counting_backend final : public c10d::Backend {
public:
    counting_backend(c10::intrusive_ptr<c10d::Backend> inner, std::uint64_t* count)
        : c10d::Backend(inner->getRank(), inner->getSize()), inner_(std::move(inner)), count_(count) {}
    const std::string getBackendName() const override { return "counting(" + inner_->getBackendName() + ")"; }
    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
        ++*count_;
        return inner_->broadcast(tensors, opts);
    }

private:
    c10::intrusive_ptr<c10d::Backend> inner_;
    std::uint64_t* count_;
};

c10::intrusive_ptr<c10d::ProcessGroup> coalescing_group(const c10::intrusive_ptr<c10d::Store>& store,
                                                        const gloo_ptr& gloo, std::uint64_t* count) {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(store, gloo->getRank(), gloo->getSize());
    c10::intrusive_ptr<c10d::Backend> backend = c10::make_intrusive<counting_backend>(gloo, count);
    pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, backend);
    pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    return pg;
}
#else
class counting_process_group final : public c10d::ProcessGroup {
public:
    counting_process_group(gloo_ptr inner, std::uint64_t* count)
        : c10d::ProcessGroup(inner->getRank(), inner->getSize()), inner_(std::move(inner)), count_(count) {}
    const std::string getBackendName() const override { return "counting(" + inner_->getBackendName() + ")"; }
    c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                             const c10d::BroadcastOptions& opts) override {
        ++*count_;
        return inner_->broadcast(tensors, opts);
    }

private:
    gloo_ptr inner_;
    std::uint64_t* count_;
};

c10::intrusive_ptr<c10d::ProcessGroup> coalescing_group(const c10::intrusive_ptr<c10d::Store>&,
                                                        const gloo_ptr& gloo, std::uint64_t* count) {
    return c10::make_intrusive<counting_process_group>(gloo, count);
}
#endif

// ---------------------------------------------------------------------------------------------
// The batch's tensors, for the hand-written methods

// Every tensor field of the batch, in a fixed order (absent optionals skipped).
std::vector<at::Tensor*> tensor_slots(xtuner::Batch& batch) {
    std::vector<at::Tensor*> out;
    for (auto& item : batch) {
        auto& c = item.seq_ctx;
        for (at::Tensor* t : {&c.input_ids, &c.cu_seq_lens_q, &c.cu_seq_lens_k, &c.max_length_q,
                              &c.max_length_k, &c.position_ids})
            out.push_back(t);
        for (auto* o : {&c.pixel_values, &c.image_grid_thw, &c.inputs_embeds, &c.block_table,
                        &c.rollout_routed_experts})
            if (o->has_value()) out.push_back(&**o);
        out.push_back(&item.shifted_labels);
    }
    return out;
}

// What a receiver needs to rebuild the tensors: per slot its distinct tensor (aliases are one),
// per distinct tensor its dtype, its "core" (stride-0 dimensions narrowed to one element: the
// bytes an expand really holds) and its full sizes (the core is expanded back to them).
struct tensor_layout {
    struct entry {
        c10::ScalarType dtype = at::kByte;
        std::vector<std::int64_t> core, sizes;
    };
    std::vector<std::int32_t> slot_tensor;  // -1: an undefined tensor
    std::vector<entry> tensors;
};

at::Tensor core_of(const at::Tensor& t) {
    std::vector<std::int64_t> core = t.sizes().vec();
    bool expanded = false;
    for (std::size_t d = 0; d < core.size(); ++d)
        if (t.strides()[d] == 0 && core[d] > 1) core[d] = 1, expanded = true;
    at::Tensor c = expanded ? t.as_strided(core, t.strides(), t.storage_offset()) : t;
    return c.is_contiguous() ? c : c.contiguous();
}

// The root's layout and the tensors to send (the core of each distinct tensor, contiguous).
tensor_layout layout_of(xtuner::Batch& batch, std::vector<at::Tensor>& cores) {
    tensor_layout layout;
    std::unordered_map<const c10::TensorImpl*, std::int32_t> seen;
    for (at::Tensor* t : tensor_slots(batch)) {
        if (!t->defined()) {
            layout.slot_tensor.push_back(-1);
            continue;
        }
        auto [it, inserted] = seen.try_emplace(t->unsafeGetTensorImpl(),
                                               static_cast<std::int32_t>(layout.tensors.size()));
        layout.slot_tensor.push_back(it->second);
        if (!inserted) continue;
        at::Tensor core = core_of(*t);
        layout.tensors.push_back({t->scalar_type(), core.sizes().vec(), t->sizes().vec()});
        cores.push_back(core);
    }
    return layout;
}

std::vector<at::Tensor> allocate_cores(const tensor_layout& layout) {
    std::vector<at::Tensor> cores;
    for (const auto& e : layout.tensors) cores.push_back(at::empty(e.core, at::TensorOptions().dtype(e.dtype)));
    return cores;
}

// Puts the received cores into a batch whose non-tensor fields are already set.
void fill_tensors(xtuner::Batch& batch, const tensor_layout& layout, const std::vector<at::Tensor>& cores) {
    auto slots = tensor_slots(batch);
    if (slots.size() != layout.slot_tensor.size()) throw std::runtime_error("layout does not fit the batch");
    for (std::size_t i = 0; i < slots.size(); ++i) {
        const auto k = layout.slot_tensor[i];
        if (k < 0) {
            *slots[i] = at::Tensor();
            continue;
        }
        const auto& e = layout.tensors[k];
        *slots[i] = e.core == e.sizes ? cores[k] : cores[k].expand(e.sizes);
    }
}

// A batch with the root's non-tensor fields and placeholders where its tensors go.
xtuner::Batch skeleton_of(const xtuner::Batch& batch) {
    xtuner::Batch out;
    for (const auto& item : batch) {
        xtuner::Item copy;
        const auto& c = item.seq_ctx;
        auto& d = copy.seq_ctx;
        d.num_padding = c.num_padding;
        d.device = c.device;
        d.num_img_tokens = c.num_img_tokens;
        auto keep = [](const std::optional<at::Tensor>& from, std::optional<at::Tensor>& to) {
            if (from) to = at::Tensor();
        };
        keep(c.pixel_values, d.pixel_values);
        keep(c.image_grid_thw, d.image_grid_thw);
        keep(c.inputs_embeds, d.inputs_embeds);
        keep(c.block_table, d.block_table);
        keep(c.rollout_routed_experts, d.rollout_routed_experts);
        out.push_back(std::move(copy));
    }
    return out;
}

// The naive method's metadata: what a hand-written broadcast would serialize.
struct writer {
    std::vector<std::uint8_t> bytes;
    template <class T>
    void put(T v) {
        const auto* p = reinterpret_cast<const std::uint8_t*>(&v);
        bytes.insert(bytes.end(), p, p + sizeof v);
    }
    void put_string(const std::string& s) {
        put<std::uint64_t>(s.size());
        bytes.insert(bytes.end(), s.begin(), s.end());
    }
    void put_ints(const std::vector<std::int64_t>& v) {
        put<std::uint64_t>(v.size());
        for (auto x : v) put(x);
    }
};

struct reader {
    const std::uint8_t* p;
    const std::uint8_t* end;
    template <class T>
    T get() {
        if (end - p < static_cast<std::ptrdiff_t>(sizeof(T))) throw std::runtime_error("naive: short metadata");
        T v;
        std::memcpy(&v, p, sizeof v);
        p += sizeof v;
        return v;
    }
    std::string get_string() {
        const auto n = get<std::uint64_t>();
        if (static_cast<std::uint64_t>(end - p) < n) throw std::runtime_error("naive: short metadata");
        std::string s(reinterpret_cast<const char*>(p), n);
        p += n;
        return s;
    }
    std::vector<std::int64_t> get_ints() {
        std::vector<std::int64_t> v(get<std::uint64_t>());
        for (auto& x : v) x = get<std::int64_t>();
        return v;
    }
};

std::vector<std::uint8_t> serialize(const xtuner::Batch& batch, const tensor_layout& layout) {
    writer out;
    out.put<std::uint64_t>(batch.size());
    for (const auto& item : batch) {
        const auto& c = item.seq_ctx;
        out.put<std::int64_t>(c.num_padding);
        out.put_string(c.device);
        out.put<std::uint8_t>(c.num_img_tokens.has_value());
        if (c.num_img_tokens) {
            out.put<std::uint64_t>(c.num_img_tokens->size());
            for (const auto& v : *c.num_img_tokens) out.put_ints(v);
        }
        std::uint8_t present = 0;
        int bit = 0;
        for (const auto* o : {&c.pixel_values, &c.image_grid_thw, &c.inputs_embeds, &c.block_table,
                              &c.rollout_routed_experts})
            present |= static_cast<std::uint8_t>(o->has_value() ? 1 << bit++ : (bit++, 0));
        out.put(present);
    }
    out.put<std::uint64_t>(layout.slot_tensor.size());
    for (auto k : layout.slot_tensor) out.put(k);
    out.put<std::uint64_t>(layout.tensors.size());
    for (const auto& e : layout.tensors) {
        out.put<std::int8_t>(static_cast<std::int8_t>(e.dtype));
        out.put_ints(e.core);
        out.put_ints(e.sizes);
    }
    return out.bytes;
}

xtuner::Batch deserialize(const std::uint8_t* data, std::size_t size, tensor_layout& layout) {
    reader in{data, data + size};
    xtuner::Batch batch(in.get<std::uint64_t>());
    for (auto& item : batch) {
        auto& c = item.seq_ctx;
        c.num_padding = in.get<std::int64_t>();
        c.device = in.get_string();
        if (in.get<std::uint8_t>()) {
            std::vector<std::vector<std::int64_t>> tokens(in.get<std::uint64_t>());
            for (auto& v : tokens) v = in.get_ints();
            c.num_img_tokens = std::move(tokens);
        }
        const auto present = in.get<std::uint8_t>();
        int bit = 0;
        for (auto* o : {&c.pixel_values, &c.image_grid_thw, &c.inputs_embeds, &c.block_table,
                        &c.rollout_routed_experts})
            if (present & (1 << bit++)) *o = at::Tensor();
    }
    layout.slot_tensor.resize(in.get<std::uint64_t>());
    for (auto& k : layout.slot_tensor) k = in.get<std::int32_t>();
    layout.tensors.resize(in.get<std::uint64_t>());
    for (auto& e : layout.tensors) {
        e.dtype = static_cast<c10::ScalarType>(in.get<std::int8_t>());
        e.core = in.get_ints();
        e.sizes = in.get_ints();
    }
    return batch;
}

// Bytes of tensor data the batch holds: per distinct storage, the span its views touch (an
// alias or second view counted once, an expand counted as its storage). python_peers.py's
// payload_bytes computes the same number.
std::uint64_t payload_bytes(xtuner::Batch& batch) {
    std::unordered_map<const void*, std::pair<std::uint64_t, std::uint64_t>> spans;
    for (at::Tensor* t : tensor_slots(batch)) {
        if (!t->defined() || t->numel() == 0) continue;
        std::uint64_t extent = 1;
        for (std::int64_t d = 0; d < t->dim(); ++d)
            extent += static_cast<std::uint64_t>((t->size(d) - 1) * t->stride(d));
        const std::uint64_t item = t->element_size();
        const std::uint64_t start = static_cast<std::uint64_t>(t->storage_offset()) * item;
        const std::uint64_t end = start + extent * item;
        auto [it, inserted] = spans.try_emplace(t->storage().unsafeGetStorageImpl(), start, end);
        if (!inserted) {
            it->second.first = std::min(it->second.first, start);
            it->second.second = std::max(it->second.second, end);
        }
    }
    std::uint64_t total = 0;
    for (const auto& [k, span] : spans) total += span.second - span.first;
    return total;
}

// ---------------------------------------------------------------------------------------------
// One rank

struct rank_context {
    const config& cfg;
    c10::intrusive_ptr<c10d::Store> store;
    gloo_ptr gloo;
    int rank = 0, world = 1;
    std::chrono::milliseconds timeout{300000};

    void barrier() { gloo->barrier()->wait(); }

    // Element-wise reduction of a small int64/float64 vector over the ranks.
    at::Tensor allreduce(at::Tensor t, c10d::ReduceOp op) {
        std::vector<at::Tensor> v{t};
        c10d::AllreduceOptions opts;
        opts.reduceOp = op;
        gloo->allreduce(v, opts)->wait();
        return v[0];
    }
    // Every rank's value, on every rank.
    std::vector<std::int64_t> gather(std::int64_t value) {
        at::Tensor t = at::zeros({world}, at::kLong);
        t.data_ptr<std::int64_t>()[rank] = value;
        t = allreduce(t, c10d::ReduceOp::SUM);
        return {t.data_ptr<std::int64_t>(), t.data_ptr<std::int64_t>() + world};
    }
    std::int64_t broadcast_value(std::int64_t v) {
        std::vector<at::Tensor> t{at::full({1}, v, at::kLong)};
        c10d::BroadcastOptions opts;
        opts.rootRank = 0;
        gloo->broadcast(t, opts)->wait();
        return t[0].item<std::int64_t>();
    }
};

// One method on this rank: its state lives as long as the cell, so that the timed steps of all
// methods can be interleaved. prepare() readies a step, untimed; step() runs one broadcast and
// keeps what arrived; digest() says what arrived (followers); drop() releases it, as a trainer
// drops the previous batch before the next one comes.
struct method {
    std::string name;
    std::function<void()> prepare = [] {};
    std::function<void()> step;
    std::function<std::optional<std::uint64_t>()> digest = [] { return std::nullopt; };
    std::function<void()> drop = [] {};
    std::uint64_t wire_bytes = 0;  // bytes the root hands to the collectives (0: not known)

    // State the steps use.
    at::Tensor raw_buffer;
    xtuner::Batch skeleton;  // coalesced: the shapes and non-tensor fields, known in advance
    tensor_layout layout;
    c10::intrusive_ptr<c10d::ProcessGroup> pg;
    std::optional<xtuner::Batch> received;

    // Results.
    std::string status = "ok", reason;
    std::uint64_t per_step = 0;
    std::optional<bool> correct;
    std::int64_t leader_extra = 0, follower_extra = 0;
    std::int64_t leader_tensor_extra = 0, follower_tensor_extra = 0;
    bool exact = false, counts_agree = true;
    std::vector<double> times;
};

struct cell {
    std::string profile;
    int micro_batches;
};

double median_of(std::vector<double> v) {
    std::sort(v.begin(), v.end());
    const auto n = v.size();
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

void run_cell(rank_context& ctx, const cell& c, std::ofstream* rows) {
    const config& cfg = ctx.cfg;
    const bool root = ctx.rank == 0;
    const auto profile = xtuner::profile_from_name(c.profile);

    xtuner::Batch batch;
    std::uint64_t root_digest = 0, payload = 0;
    if (root) {
        batch = xtuner::make_batch(profile, c.micro_batches, cfg.seed);
        root_digest = spbcast::digest(batch);
        payload = payload_bytes(batch);
    }
    root_digest = static_cast<std::uint64_t>(ctx.broadcast_value(static_cast<std::int64_t>(root_digest)));
    payload = static_cast<std::uint64_t>(ctx.broadcast_value(static_cast<std::int64_t>(payload)));
    const int repeats = cfg.big_repeats > 0 && payload >= cfg.big_bytes ? cfg.big_repeats : cfg.repeats;
    const auto payload_elems = static_cast<std::int64_t>(payload);

    spbcast::options opts;
    opts.root = 0;
    opts.timeout = ctx.timeout;
    opts.bucket_bytes = cfg.bucket_bytes;
    opts.transport = spbcast::transport_mode::network;
    spbcast::options shm_opts = opts;
    shm_opts.transport = spbcast::transport_mode::shared_memory;
    c10d::BroadcastOptions bopts;
    bopts.rootRank = 0;
    bopts.rootTensor = 0;
    bopts.timeout = ctx.timeout;

    std::uint64_t count = 0;
    counting_group<c10d::ProcessGroupGloo> counted{ctx.gloo.get(), &count};
    auto bcast = [&](at::Tensor t) {
        std::vector<at::Tensor> v{std::move(t)};
        counted.broadcast(v, bopts)->wait();
    };

    // The root's layout (naive and coalesced): computed once, outside the timed region.
    std::vector<at::Tensor> root_cores;
    tensor_layout root_layout;
    if (root) root_layout = layout_of(batch, root_cores);

    std::vector<std::unique_ptr<method>> methods;
    for (const std::string& name : cfg.methods) {
        auto owned = std::make_unique<method>();
        method& m = *owned;
        m.name = name;
        auto received_digest = [&m, root]() -> std::optional<std::uint64_t> {
            if (root || !m.received) return std::nullopt;
            return spbcast::digest(*m.received);
        };
        if (name != "raw" && name != "raw_fresh") {
            m.digest = received_digest;
            m.drop = [&m] { m.received.reset(); };
        }
        if (name == "raw" || name == "raw_fresh") {
            if (root || name == "raw") m.raw_buffer = at::ones({payload_elems}, at::kByte);
            const bool fresh = name == "raw_fresh" && !root;
            m.step = [&, &m = m, fresh] { bcast(fresh ? at::empty({payload_elems}, at::kByte) : m.raw_buffer); };
            m.wire_bytes = payload;
        } else if (name == "spbcast") {
            m.step = [&, &m = m] {
                if (root) {
                    spbcast::broadcast(batch, counted, opts);
                } else {
                    m.received.emplace();
                    spbcast::broadcast(*m.received, counted, opts);
                }
            };
        } else if (name == "spbcast_shm" || name == "spbcast_shm_alloc") {
            // The handshake runs once per (group, root), before anything is measured.
            std::vector<at::Tensor> nothing;
            spbcast::broadcast(nothing, counted, shm_opts);
            const bool leader_allocates = name == "spbcast_shm_alloc";
            if (leader_allocates && root)
                m.prepare = [&, &m = m] {
                    spbcast::shared_memory_scope in_shared_memory;
                    std::vector<at::Tensor> cores;
                    for (const auto& core : root_cores) cores.push_back(core.clone());
                    m.received = batch;
                    fill_tensors(*m.received, root_layout, cores);
                };
            m.step = [&, &m = m, leader_allocates] {
                if (root) {
                    spbcast::broadcast(leader_allocates ? *m.received : batch, counted, shm_opts);
                } else {
                    m.received.emplace();
                    spbcast::broadcast(*m.received, counted, shm_opts);
                }
            };
        } else if (name == "naive") {
            m.step = [&, &m = m] {
                if (root) {
                    const auto meta = serialize(batch, root_layout);
                    bcast(at::full({1}, static_cast<std::int64_t>(meta.size()), at::kLong));
                    at::Tensor bytes = at::empty({static_cast<std::int64_t>(meta.size())}, at::kByte);
                    std::memcpy(bytes.data_ptr(), meta.data(), meta.size());
                    bcast(bytes);
                    for (const auto& core : root_cores) bcast(core);
                } else {
                    at::Tensor size = at::empty({1}, at::kLong);
                    bcast(size);
                    at::Tensor bytes = at::empty({size.item<std::int64_t>()}, at::kByte);
                    bcast(bytes);
                    tensor_layout got;
                    m.received = deserialize(bytes.data_ptr<std::uint8_t>(), bytes.numel(), got);
                    auto cores = allocate_cores(got);
                    for (auto& core : cores) bcast(core);
                    fill_tensors(*m.received, got, cores);
                }
            };
            if (root) {
                m.wire_bytes = 8 + serialize(batch, root_layout).size();
                for (const auto& core : root_cores) m.wire_bytes += core.nbytes();
            }
        } else if (name == "coalesced") {
            // The shapes in advance: the followers learn the layout once, untimed and uncounted.
            std::vector<std::uint8_t> meta;
            if (root) meta = serialize(batch, root_layout);
            const auto n = ctx.broadcast_value(static_cast<std::int64_t>(meta.size()));
            at::Tensor bytes = at::empty({n}, at::kByte);
            if (root) std::memcpy(bytes.data_ptr(), meta.data(), meta.size());
            std::vector<at::Tensor> v{bytes};
            ctx.gloo->broadcast(v, bopts)->wait();
            if (!root) m.skeleton = deserialize(bytes.data_ptr<std::uint8_t>(), bytes.numel(), m.layout);
            m.pg = coalescing_group(ctx.store, ctx.gloo, &count);
            m.step = [&, &m = m] {
                if (root) {
                    c10d::broadcast_coalesced(m.pg, root_cores, cfg.bucket_bytes, 0);
                } else {
                    auto cores = allocate_cores(m.layout);
                    c10d::broadcast_coalesced(m.pg, cores, cfg.bucket_bytes, 0);
                    m.received = skeleton_of(m.skeleton);
                    fill_tensors(*m.received, m.layout, cores);
                }
            };
            if (root)
                for (const auto& core : root_cores) m.wire_bytes += core.nbytes();
        }
        methods.push_back(std::move(owned));
    }

    // A failed collective leaves the group unusable: the rank reports and stops.
    auto fail = [&](method& m, const std::exception& e) {
        if (rows && root) {
            *rows << json_object{}
                         .str("profile", c.profile).integer("micro_batches", c.micro_batches)
                         .integer("world_size", ctx.world).str("method", m.name)
                         .integer("payload_bytes", payload_elems).str("status", "error")
                         .str("reason", "rank " + std::to_string(ctx.rank) + ": " + e.what())
                         .dump()
                  << "\n";
            rows->flush();
        }
    };

    // 1. Per method: one checked step (its collectives are the method's count per step), then
    //    the warm-up steps inside a memory window of their own.
    for (auto& owned : methods) {
        method& m = *owned;
        try {
            m.prepare();
            ctx.barrier();
            count = 0;
            m.step();
            m.per_step = count;
            const auto got = m.digest();
            m.drop();
            const auto wrong = ctx.gather(got && *got != root_digest ? 1 : 0);
            const auto checked = ctx.gather(got ? 1 : 0);
            std::string bad;
            for (int r = 1; r < ctx.world; ++r)
                if (wrong[r]) append_item(bad, ",", std::to_string(r));
            if (std::any_of(checked.begin() + 1, checked.end(), [](auto v) { return v != 0; }))
                m.correct = bad.empty();
            if (!bad.empty()) {
                m.status = "error";
                m.reason = "wrong data on followers (digest differs from the root's): ranks " + bad;
            }

            // Gloo's worker threads drop their reference to a finished broadcast (and so to its
            // buffer) a moment after the caller's wait returns; let them, so that the baseline
            // does not hold the previous buffer and a step's peak does not hold two.
            auto settle = [&](int ms) {
                std::this_thread::sleep_for(std::chrono::milliseconds(ms));
                ctx.barrier();
                std::this_thread::sleep_for(std::chrono::milliseconds(ms));
            };
            settle(50);
            const bool exact = open_memory_window();
            // What spbcast's receive cache holds between batches is spbcast's extra memory too:
            // it counts from a baseline without it (the cache's blocks are resident, and come
            // from the counted CPU allocator).
            const std::int64_t cached =
                m.name == "spbcast"
                    ? static_cast<std::int64_t>(spbcast::receive_cache_statistics().cached_bytes)
                    : 0;
            const std::int64_t base = rss_bytes() - cached;
            tensor_memory().reset_peak();
            const std::int64_t tensor_base = tensor_memory().live() - cached;
            count = 0;
            const int warmup = std::max(cfg.warmup, 1);
            // SPBCAST_BENCH_DEBUG_MEM=1: each rank prints its memory after every warm-up step.
            static const bool debug_mem = std::getenv("SPBCAST_BENCH_DEBUG_MEM") != nullptr;
            for (int i = 0; i < warmup; ++i) {
                m.prepare();
                ctx.barrier();
                m.step();
                if (debug_mem)
                    std::cerr << "rank " << ctx.rank << " " << m.name << " step " << i << ": RSS +"
                              << (rss_bytes() - base) / 1024 << " KiB, peak RSS +"
                              << (peak_rss_bytes() - base) / 1024 << " KiB, live tensors +"
                              << (tensor_memory().live() - tensor_base) / 1024 << " KiB\n";
                m.drop();
                settle(10);
            }
            const auto tensor_extras = ctx.gather(tensor_memory().peak() - tensor_base);
            const auto extras = ctx.gather(peak_rss_bytes() - base);
            const auto exacts = ctx.gather(exact ? 1 : 0);
            const auto counts = ctx.gather(static_cast<std::int64_t>(count));
            m.leader_extra = extras[0];
            m.leader_tensor_extra = tensor_extras[0];
            for (int r = 1; r < ctx.world; ++r) {
                m.follower_extra = std::max(m.follower_extra, extras[r]);
                m.follower_tensor_extra = std::max(m.follower_tensor_extra, tensor_extras[r]);
            }
            m.exact = std::all_of(exacts.begin(), exacts.end(), [](auto v) { return v != 0; });
            for (int r = 0; r < ctx.world; ++r)
                m.counts_agree &= counts[r] == static_cast<std::int64_t>(m.per_step) * warmup;
        } catch (const std::exception& e) {
            fail(m, e);
            throw;
        }
    }

    // 2. Timed rounds: every method once per round, the order rotated each round, so that a
    //    slow spell on this shared machine hits every method alike.
    const std::size_t k = methods.size();
    for (int round = 0; round < repeats; ++round)
        for (std::size_t j = 0; j < k; ++j) {
            method& m = *methods[(j + static_cast<std::size_t>(round)) % k];
            try {
                m.prepare();
                ctx.barrier();
                count = 0;
                const auto t0 = clock_type::now();
                m.step();
                const double ms = std::chrono::duration<double, std::milli>(clock_type::now() - t0).count();
                m.drop();
                m.counts_agree &= count == m.per_step;
                m.times.push_back(ctx.allreduce(at::full({1}, ms, at::kDouble), c10d::ReduceOp::MAX).item<double>());
            } catch (const std::exception& e) {
                fail(m, e);
                throw;
            }
        }

    if (!root) return;
    for (auto& owned : methods) {
        method& m = *owned;
        const double median = median_of(m.times);
        std::string ms_list = "[";
        for (std::size_t i = 0; i < m.times.size(); ++i) ms_list += (i ? ", " : "") + number(m.times[i]);
        ms_list += "]";
        json_object row;
        row.str("profile", c.profile).integer("micro_batches", c.micro_batches)
            .integer("world_size", ctx.world).str("method", m.name)
            .integer("payload_bytes", payload_elems).str("status", m.status);
        m.reason.empty() ? row.null("reason") : row.str("reason", m.reason);
        m.wire_bytes ? row.integer("wire_bytes", static_cast<std::int64_t>(m.wire_bytes)) : row.null("wire_bytes");
        row.num("ms_median", median)
            .num("ms_min", *std::min_element(m.times.begin(), m.times.end()))
            .num("ms_max", *std::max_element(m.times.begin(), m.times.end()))
            .num("gib_per_s", static_cast<double>(payload) / (1u << 30) / (median / 1e3))
            .integer("collectives", static_cast<std::int64_t>(m.per_step))
            .boolean("collectives_constant", m.counts_agree)
            .integer("follower_extra_bytes", m.follower_extra)
            .integer("leader_extra_bytes", m.leader_extra)
            .integer("follower_tensor_extra_bytes", m.follower_tensor_extra)
            .integer("leader_tensor_extra_bytes", m.leader_tensor_extra)
            .integer("repeats", repeats).integer("warmup", std::max(cfg.warmup, 1))
            .raw("ms_repeats", ms_list)
            .boolean("rss_peak_exact", m.exact);
        m.correct ? row.boolean("correct", *m.correct) : row.null("correct");
        row.integer("bucket_bytes", static_cast<std::int64_t>(cfg.bucket_bytes));
        if (rows) {
            *rows << row.dump() << "\n";
            rows->flush();
        }
        std::cerr << "  " << c.profile << " mb=" << c.micro_batches << " ws=" << ctx.world << " " << m.name
                  << ": " << std::fixed << std::setprecision(2) << median << " ms (" << m.status << ")\n";
    }
}

int rank_main(const config& cfg) {
    c10::SetCPUAllocator(&tensor_memory(), /*priority=*/100);
    at::set_num_threads(cfg.threads);
    const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(cfg.pg_timeout * 1000));
    const auto job = spbcast_test::join_job(timeout);
    const auto& env = job.env;
    rank_context ctx{cfg};
    ctx.store = job.store;
    ctx.gloo = job.group;
    ctx.rank = env.rank;
    ctx.world = env.world_size;
    ctx.timeout = timeout;
    std::optional<std::ofstream> rows;
    if (env.rank == 0 && !cfg.rows.empty()) rows.emplace(cfg.rows, std::ios::app);
    for (const auto& p : cfg.profiles)
        for (int mb : cfg.micro_batches) run_cell(ctx, {p, mb}, rows ? &*rows : nullptr);
    ctx.barrier();
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Seed scale (issue 30): one batch of several GiB whose media tensor alone is over 2^31 bytes,
// on one host. Measured, in one job of --world-sizes ranks (rank 0 the root):
//   raw       one Gloo broadcast of the payload's bytes from rank 0 to one follower (a group of
//             ranks 0 and 1), into a buffer allocated and touched once: the transport's cost
//             of moving those bytes once. --repeats rounds, median.
//   same-host spbcast::broadcast(batch, group) (automatic: the same-host path), 1 + --repeats
//             rounds, each after a barrier, the slowest rank's time; the followers drop each
//             batch before the next comes (as the other cells do). Round 1 fills a new segment;
//             rounds 2+ should refill it: about one memcpy.
//   free-running  --repeats more rounds without barriers: the root broadcasts as fast as it
//             can, each follower keeps batch t while t + 1 arrives and works --seed-work-ms
//             between batches (a training step): the root's pool, and Shmem, must stay at the
//             two batches the loop keeps alive.
//   network   with --seed-network: transport_mode::network, 1 + --repeats rounds (followers drop
//             each batch before the next): rounds 2+ are received into the receive cache.
// --seed-fixed-limit-gib G fixes the segment pool's free bytes and the receive cache at G GiB
// (set_shared_memory_limit, set_receive_cache_limit): G = 2 is the bound before issue 30.
// Rank 0 prints the results; the launcher prints rank 0's output.

// Rows [first, first + n) of the seed batch's pixel_values: a pattern a follower can check.
at::Tensor pattern_rows(std::int64_t first, std::int64_t n) {
    return at::arange(first * 1536, (first + n) * 1536, at::kInt).remainder(65521).to(at::kFloat);
}

long shmem_kib_now() {
    std::ifstream in("/proc/meminfo");
    for (std::string line; std::getline(in, line);)
        if (line.rfind("Shmem:", 0) == 0) return std::stol(line.substr(6));
    return -1;
}

int seed_scale_rank(const config& cfg) {
    at::set_num_threads(cfg.threads);
    const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(cfg.pg_timeout * 1000));
    const auto job = spbcast_test::join_job(timeout);
    const int rank = job.env.rank, world = job.env.world_size;
    rank_context ctx{cfg};
    ctx.store = job.store;
    ctx.gloo = job.group;
    ctx.rank = rank;
    ctx.world = world;
    ctx.timeout = timeout;
    const bool root = rank == 0;
    if (cfg.seed_fixed_limit_gib >= 0) {
        const auto bytes = static_cast<std::size_t>(cfg.seed_fixed_limit_gib * (1u << 30));
        spbcast::set_shared_memory_limit(bytes);
        spbcast::set_receive_cache_limit(bytes);
    }
    auto seconds_since = [](clock_type::time_point t) {
        return std::chrono::duration<double>(clock_type::now() - t).count();
    };
    auto slowest = [&](double s) {
        return ctx.allreduce(at::full({1}, s, at::kDouble), c10d::ReduceOp::MAX).item<double>();
    };
    auto say = [&](const std::string& line) {
        if (root) std::cout << line << std::endl;
    };
    auto f3 = [](double v) {
        std::ostringstream o;
        o << std::fixed << std::setprecision(3) << v;
        return o.str();
    };

    // The batch: a qwen3-vl-image item whose pixel_values carries the payload (float32 rows of
    // 1536), so the largest tensor is nearly the whole batch.
    const std::int64_t rows = static_cast<std::int64_t>(cfg.seed_gib * (1u << 30)) / (1536 * 4);
    xtuner::Batch batch;
    std::uint64_t payload = 0, want = 0;
    if (root) {
        batch = xtuner::make_batch(xtuner::profile::qwen3_vl_image, 1, cfg.seed);
        at::Tensor pixels = at::empty({rows, 1536}, at::kFloat);
        for (std::int64_t row = 0; row < rows; row += 4096) {  // in pieces: no second copy of it
            const std::int64_t n = std::min<std::int64_t>(4096, rows - row);
            pixels.narrow(0, row, n).view(-1).copy_(pattern_rows(row, n));
        }
        batch[0].seq_ctx.pixel_values = pixels;
        payload = payload_bytes(batch);
        want = spbcast::digest(batch);
    }
    payload = static_cast<std::uint64_t>(ctx.broadcast_value(static_cast<std::int64_t>(payload)));
    want = static_cast<std::uint64_t>(ctx.broadcast_value(static_cast<std::int64_t>(want)));
    const double gib = static_cast<double>(payload) / (1u << 30);
    say("seed scale: payload " + f3(gib) + " GiB, pixel_values " + f3(rows * 1536.0 * 4 / (1u << 30)) +
        " GiB in one tensor, " + std::to_string(world) + " ranks on one host, LibTorch " + TORCH_VERSION +
        (cfg.seed_fixed_limit_gib >= 0 ? ", bounds fixed at " + f3(cfg.seed_fixed_limit_gib) + " GiB" : ""));

    // raw: ranks 0 and 1 only.
    std::vector<double> raw;
    {
        auto pair_store = c10::make_intrusive<c10d::PrefixStore>("seed/raw", ctx.store);
        gloo_ptr pair;
        if (rank < 2) pair = spbcast::dist::make_gloo_group(pair_store, rank, 2, timeout);
        at::Tensor buffer;
        if (root) buffer = at::from_blob(batch[0].seq_ctx.pixel_values->data_ptr(), {static_cast<std::int64_t>(rows * 1536 * 4)}, at::kByte);
        if (rank == 1) buffer = at::ones({rows * 1536 * 4}, at::kByte);  // touched once
        ctx.barrier();
        for (int r = 0; r < cfg.repeats && rank < 2; ++r) {
            std::vector<at::Tensor> one{at::zeros({1}, at::kLong)};
            pair->allreduce(one)->wait();  // a barrier of the pair
            const auto t = clock_type::now();
            std::vector<at::Tensor> v{buffer};
            c10d::BroadcastOptions o;
            o.rootRank = 0;
            o.timeout = timeout;
            pair->broadcast(v, o)->wait();
            std::vector<at::Tensor> took{at::full({1}, seconds_since(t), at::kDouble)};
            c10d::AllreduceOptions max;
            max.reduceOp = c10d::ReduceOp::MAX;
            pair->allreduce(took, max)->wait();
            raw.push_back(took[0].item<double>());
        }
        const std::int64_t check_rows = std::min<std::int64_t>(rows, 4096);
        if (rank == 1 && !buffer.narrow(0, 0, check_rows * 1536 * 4)
                              .equal(at::from_blob(pattern_rows(0, check_rows).data_ptr(), {check_rows * 1536 * 4}, at::kByte)))
            return 1;
        ctx.barrier();
    }
    const double raw_median = slowest(raw.empty() ? 0.0 : median_of(raw));  // ranks 0 and 1 measured it
    std::string list;
    for (double v : raw) append_item(list, ", ", f3(v));
    say("raw Gloo broadcast of " + f3(gib) + " GiB to one follower: median " + f3(raw_median) + " s (" + list + ")");

    // memcpy: the root copies the payload into memory of its own that is already resident, and
    // into a resident shared segment of its pool (a tensor born in a shared_memory_scope): what
    // refilling a recycled segment costs, without the broadcast.
    std::vector<double> copies, shared_copies;
    if (root) {
        const at::Tensor& pixels = *batch[0].seq_ctx.pixel_values;
        for (const bool shared : {false, true}) {
            at::Tensor into;
            {
                std::optional<spbcast::shared_memory_scope> in_shared_memory;
                if (shared) in_shared_memory.emplace();
                into = at::empty_like(pixels);
            }
            std::memset(into.data_ptr(), 1, into.nbytes());  // resident
            for (int r = 0; r < std::max(cfg.repeats, 3); ++r) {
                const auto t = clock_type::now();
                std::memcpy(into.data_ptr(), pixels.data_ptr(), pixels.nbytes());
                (shared ? shared_copies : copies).push_back(seconds_since(t));
            }
        }
        spbcast::release_shared_memory();  // the segment the second one lay in
    }
    const double copy_median = slowest(copies.empty() ? 0.0 : median_of(copies));
    const double shared_copy_median = slowest(shared_copies.empty() ? 0.0 : median_of(shared_copies));
    say("memcpy of the payload on the root into resident memory: median " + f3(copy_median) +
        " s; into a resident shared segment: median " + f3(shared_copy_median) + " s");

    // same-host, with barriers.
    const auto pool_before = spbcast::shared_memory_statistics();  // the reference's segment is gone
    const long shmem_base = shmem_kib_now();
    long shmem_peak = shmem_base;
    std::vector<double> rounds;
    std::size_t most_segments = 0;
    bool exact = true;
    for (int r = 0; r <= cfg.repeats; ++r) {
        xtuner::Batch got;
        ctx.barrier();
        const auto t = clock_type::now();
        spbcast::broadcast(root ? batch : got, *ctx.gloo, {.timeout = timeout});
        rounds.push_back(slowest(seconds_since(t)));
        if (!root && (r == 0 || r == cfg.repeats)) exact = exact && spbcast::digest(got) == want;
        shmem_peak = std::max(shmem_peak, shmem_kib_now());
        if (root) most_segments = std::max(most_segments, spbcast::shared_memory_statistics().segments);
    }  // dropped before the next one comes
    exact = slowest(exact ? 0.0 : 1.0) == 0.0;
    const auto pool = spbcast::shared_memory_statistics();
    const std::vector<double> later(rounds.begin() + 1, rounds.end());
    const double later_median = median_of(later);
    list.clear();
    for (double v : later) append_item(list, ", ", f3(v));
    say("same-host (automatic): round 1 " + f3(rounds[0]) + " s, rounds 2+ median " + f3(later_median) + " s (" + list +
        ") = " + f3(later_median / raw_median) + "x raw, " + f3(later_median / shared_copy_median) +
        "x the memcpy into a shared segment; bit-exact " +
        (exact ? "yes" : "NO") + "; root pool: " +
        std::to_string(pool.segments_created - pool_before.segments_created) + " segments created, " +
        std::to_string(pool.segments_reused - pool_before.segments_reused) + " reused, at most " +
        std::to_string(most_segments) + " tracked, free bound " +
        f3(static_cast<double>(pool.limit_bytes) / (1u << 30)) + " GiB; Shmem peak +" +
        f3(static_cast<double>(shmem_peak - shmem_base) / (1 << 20)) + " GiB (" +
        f3(static_cast<double>(shmem_peak - shmem_base) * 1024 / static_cast<double>(payload)) + " batches)");

    // free-running: no barrier; followers work between batches.
    const auto created_before = pool.segments_created;
    most_segments = 0;
    shmem_peak = shmem_base;
    xtuner::Batch kept;
    ctx.barrier();
    const auto free_start = clock_type::now();
    std::vector<double> calls;  // this rank's broadcast calls
    for (int r = 0; r < cfg.repeats; ++r) {
        xtuner::Batch got;
        const auto t = clock_type::now();
        spbcast::broadcast(root ? batch : got, *ctx.gloo, {.timeout = timeout});
        calls.push_back(seconds_since(t));
        if (!root) {
            kept = std::move(got);  // batch t - 1 goes: the loop keeps t while t + 1 arrives
            std::this_thread::sleep_for(std::chrono::milliseconds(cfg.seed_work_ms));
        }
        shmem_peak = std::max(shmem_peak, shmem_kib_now());
        if (root) most_segments = std::max(most_segments, spbcast::shared_memory_statistics().segments);
    }
    const double free_s = slowest(seconds_since(free_start));
    kept.clear();
    const auto free_pool = spbcast::shared_memory_statistics();
    std::string root_calls, follower_calls;  // the root's calls, and rank 1's
    for (int k = 0; k < cfg.repeats; ++k) {
        append_item(root_calls, ", ", f3(slowest(root ? calls[k] : 0.0)));
        append_item(follower_calls, ", ", f3(slowest(rank == 1 ? calls[k] : 0.0)));
    }
    say("free-running (" + std::to_string(cfg.repeats) + " rounds, followers keep batch t while t + 1 arrives and work " +
        std::to_string(cfg.seed_work_ms) + " ms per batch): " + f3(free_s) + " s, " +
        std::to_string(free_pool.segments_created - created_before) + " segments created, at most " +
        std::to_string(most_segments) + " tracked; Shmem peak +" +
        f3(static_cast<double>(shmem_peak - shmem_base) / (1 << 20)) + " GiB (" +
        f3(static_cast<double>(shmem_peak - shmem_base) * 1024 / static_cast<double>(payload)) +
        " batches); the root's calls " + root_calls + " s, rank 1's " + follower_calls + " s");
    // Every batch is let go of; the root reads the answers at its next broadcast (an empty
    // one), then frees its free segments before the network rounds.
    ctx.barrier();
    std::vector<at::Tensor> nothing;
    spbcast::broadcast(nothing, *ctx.gloo, {.timeout = timeout});
    if (root) spbcast::release_shared_memory();
    ctx.barrier();

    if (cfg.seed_network) {
        std::vector<double> net;
        const auto cache_before = spbcast::receive_cache_statistics();
        for (int r = 0; r <= cfg.repeats; ++r) {
            xtuner::Batch got;
            ctx.barrier();
            const auto t = clock_type::now();
            spbcast::broadcast(root ? batch : got, *ctx.gloo,
                               {.timeout = timeout, .transport = spbcast::transport_mode::network});
            net.push_back(slowest(seconds_since(t)));
            if (!root && (r == 0 || r == cfg.repeats) && spbcast::digest(got) != want) return 1;
        }  // dropped before the next one comes
        const auto cache = spbcast::receive_cache_statistics();
        const std::vector<double> net_later(net.begin() + 1, net.end());
        list.clear();
        for (double v : net_later) append_item(list, ", ", f3(v));
        // Rank 1's receive cache (rank 0 receives nothing).
        const auto reused = ctx.gather(static_cast<std::int64_t>(cache.blocks_reused - cache_before.blocks_reused));
        const auto allocated = ctx.gather(static_cast<std::int64_t>(cache.blocks_allocated - cache_before.blocks_allocated));
        say("network: round 1 " + f3(net[0]) + " s, rounds 2+ median " + f3(median_of(net_later)) + " s (" + list +
            ") = " + f3(median_of(net_later) / raw_median) + "x raw; rank 1's receive cache: " +
            std::to_string(reused[1]) + " blocks reused, " + std::to_string(allocated[1]) + " allocated");
    }
    ctx.barrier();
    return exact ? 0 : 1;
}

int seed_scale_launcher(const config& cfg) {
    if (cfg.world_sizes.size() != 1) usage("--seed-scale takes one world size");
    const auto self = std::filesystem::canonical("/proc/self/exe");
    std::vector<std::string> args = {"--seed-scale", "--seed-gib", number(cfg.seed_gib), "--repeats",
                                     std::to_string(cfg.repeats), "--seed-work-ms", std::to_string(cfg.seed_work_ms),
                                     "--threads", std::to_string(cfg.threads), "--pg-timeout", number(cfg.pg_timeout)};
    if (cfg.seed_network) args.push_back("--seed-network");
    if (cfg.seed_fixed_limit_gib >= 0) {
        args.push_back("--seed-fixed-limit-gib");
        args.push_back(number(cfg.seed_fixed_limit_gib));
    }
    const auto results = spbcast_test::run_processes(
        self, cfg.world_sizes[0], [&](int) { return args; },
        std::chrono::seconds(static_cast<std::int64_t>(cfg.cell_timeout)));
    std::cout << results.at(0).output;
    for (const auto& r : results)
        if (r.exit_code != 0) {
            std::cerr << spbcast_test::describe(results);
            return 1;
        }
    return 0;
}

// ---------------------------------------------------------------------------------------------
// Launcher

std::string last_line(const std::filesystem::path& log) {
    std::ifstream in(log);
    std::string line, last = "(no output)";
    while (std::getline(in, line))
        if (line.find_first_not_of(" \t\r") != std::string::npos) last = line;
    return last;
}

std::string machine_json() {
    std::string cpu = "unknown";
    {
        std::ifstream in("/proc/cpuinfo");
        for (std::string line; std::getline(in, line);)
            if (line.rfind("model name", 0) == 0) {
                cpu = line.substr(line.find(':') + 2);
                break;
            }
    }
    std::int64_t mem = 0;
    {
        std::ifstream in("/proc/meminfo");
        for (std::string line; std::getline(in, line);)
            if (line.rfind("MemTotal:", 0) == 0) mem = std::stoll(line.substr(9)) * 1024;
    }
    cpu_set_t set;
    CPU_ZERO(&set);
    sched_getaffinity(0, sizeof set, &set);
    double load[3] = {0, 0, 0};
    getloadavg(load, 3);
    return json_object{}
        .str("cpu_model", cpu)
        .integer("logical_cores", static_cast<std::int64_t>(std::thread::hardware_concurrency()))
        .integer("usable_cores", CPU_COUNT(&set))
        .integer("mem_total_bytes", mem)
        .raw("loadavg_at_start", "[" + number(load[0]) + ", " + number(load[1]) + ", " + number(load[2]) + "]")
        .dump();
}

std::string libtorch_json() {
    Dl_info info{};
    std::string library = "unknown";
    if (dladdr(reinterpret_cast<void*>(&c10::GetCPUAllocator), &info) != 0 && info.dli_fname)
        library = std::filesystem::canonical(info.dli_fname).string();
    return json_object{}
        .str("version", TORCH_VERSION)
#ifdef SPBCAST_EXPECTED_TORCH_VERSION
        .str("cmake_version", SPBCAST_EXPECTED_TORCH_VERSION)
#endif
        .str("library", library)
        .dump();
}

std::uint64_t estimated_payload(const std::string& profile, int micro_batches) {
    const auto s = xtuner::shape_of(xtuner::profile_from_name(profile));
    const std::uint64_t row = s.tiles ? 3 * 448 * 448 * 4 : 1536 * 4;
    return micro_batches * (3 * s.pack_length * 8 + s.media_rows * row);
}

int launcher_main(const config& cfg, int argc, char** argv) {
    (void)argc;
    const auto self = std::filesystem::canonical("/proc/self/exe");
    const auto start = clock_type::now();
    const auto tmp = std::filesystem::temp_directory_path() / ("spbcast-bench-" + std::to_string(::getpid()));
    std::filesystem::create_directories(tmp);

    std::string command;
    for (int i = 0; i < argc; ++i) command += (i ? " " : "") + std::string(argv[i]);
    const std::string config_json =
        json_object{}
            .str("command", command)
            .raw("profiles", "[\"" + [&] { std::string s; for (auto& p : cfg.profiles) s += (s.empty() ? "" : "\", \"") + p; return s; }() + "\"]")
            .raw("micro_batches", "[" + join_ints(cfg.micro_batches) + "]")
            .raw("world_sizes", "[" + join_ints(cfg.world_sizes) + "]")
            .str("methods", join(cfg.methods))
            .integer("repeats", cfg.repeats).integer("warmup", cfg.warmup)
            .integer("big_repeats", cfg.big_repeats).integer("big_bytes", static_cast<std::int64_t>(cfg.big_bytes))
            .integer("seed", static_cast<std::int64_t>(cfg.seed))
            .integer("bucket_bytes", static_cast<std::int64_t>(cfg.bucket_bytes))
            .integer("threads", cfg.threads)
            .dump();
    const std::string machine = machine_json();
    const std::string libtorch = libtorch_json();
    std::vector<std::string> results;

    auto write = [&] {
        const std::string path = cfg.json + ".tmp";
        {
            std::ofstream out(path);
            out << "{\n \"machine\": " << machine << ",\n \"libtorch\": " << libtorch
                << ",\n \"config\": " << config_json << ",\n \"results\": [";
            for (std::size_t i = 0; i < results.size(); ++i) out << (i ? ",\n  " : "\n  ") << results[i];
            out << "\n ]\n}\n";
        }
        std::filesystem::rename(path, cfg.json);
    };

    int failures = 0, n = 0;
    const int total = static_cast<int>(cfg.profiles.size() * cfg.micro_batches.size() * cfg.world_sizes.size());
    for (const auto& profile : cfg.profiles)
        for (int mb : cfg.micro_batches)
            for (int world : cfg.world_sizes) {
                ++n;
                const auto cell_start = clock_type::now();
                auto skip_row = [&](const std::string& method, const std::string& status, const std::string& reason) {
                    return json_object{}
                        .str("profile", profile).integer("micro_batches", mb).integer("world_size", world)
                        .str("method", method).str("status", status).str("reason", reason)
                        .dump();
                };
                const double left = cfg.deadline - std::chrono::duration<double>(cell_start - start).count();
                // Methods are interleaved, so their state lives together: the root holds the
                // batch and raw's buffer, each follower raw's buffer and one received batch.
                const double need = (static_cast<double>(estimated_payload(profile, mb)) * 2 * world +
                                     world * (350.0 * (1 << 20))) * 1.1;
                const double limit = cfg.mem_limit_gib > 0 ? cfg.mem_limit_gib * (1u << 30)
                                                           : 0.85 * static_cast<double>(mem_available_bytes());
                std::string skip;
                if (left <= 0) skip = "the --deadline of " + number(cfg.deadline) + " s had passed";
                else if (cfg.mem_limit_gib != 0 && need > limit)
                    skip = "estimated " + number(need / (1u << 30)) + " GiB for " + std::to_string(world) +
                           " ranks exceeds the memory limit of " + number(limit / (1u << 30)) + " GiB";
                if (!skip.empty()) {
                    for (const auto& m : cfg.methods) results.push_back(skip_row(m, "skipped", skip));
                    write();
                    std::cerr << "[" << n << "/" << total << "] " << profile << " mb=" << mb << " ws=" << world
                              << ": skipped (" << skip << ")\n";
                    continue;
                }
                const double cell_limit = std::min(cfg.cell_timeout, left);
                const auto rows_path = tmp / ("rows-" + std::to_string(n) + ".jsonl");
                std::vector<std::string> args = {
                    self.string(), "--profiles", profile, "--micro-batches", std::to_string(mb),
                    "--methods", join(cfg.methods), "--repeats", std::to_string(cfg.repeats),
                    "--warmup", std::to_string(cfg.warmup), "--big-repeats", std::to_string(cfg.big_repeats),
                    "--big-mib", std::to_string(cfg.big_bytes >> 20), "--seed", std::to_string(cfg.seed),
                    "--bucket-mib", std::to_string(cfg.bucket_bytes >> 20), "--threads", std::to_string(cfg.threads),
                    "--pg-timeout", number(cfg.pg_timeout), "--rows", rows_path.string()};
                if (cfg.bucket_bytes % (1u << 20)) throw std::runtime_error("--bucket-mib must be whole MiB");
                // A store of the cell's own, on a port the kernel picked (support/processes.hpp).
                const spbcast_test::launcher_store store(std::chrono::seconds(static_cast<std::int64_t>(cell_limit) + 60));
                std::vector<spbcast_test::child> children;
                std::vector<std::filesystem::path> logs;
                for (int rank = 0; rank < world; ++rank) {
                    std::vector<std::string> env = store.rank_env(rank, world);
                    env.push_back("OMP_NUM_THREADS=" + std::to_string(cfg.threads));
                    logs.push_back(tmp / ("cell" + std::to_string(n) + "-rank" + std::to_string(rank) + ".log"));
                    // Each rank in its own process group: a timeout kills exactly it.
                    children.push_back({spbcast_test::spawn(args, spbcast_test::environment_with(env), logs.back(),
                                                            /*own_process_group=*/true),
                                        "rank " + std::to_string(rank), logs.back()});
                }
                // A failed rank leaves the others waiting for it until the group times out: they
                // get 2 s to finish, then are killed.
                const auto outcome = spbcast_test::supervise(
                    children, {.deadline = std::chrono::milliseconds(static_cast<std::int64_t>(cell_limit * 1000)),
                               .stop_on_failure = true,
                               .stop_signal = 0,
                               .grace = std::chrono::seconds(2),
                               .process_groups = true});
                const bool timed_out = outcome.timed_out;
                std::vector<int> codes(world, -1);
                for (int r = 0; r < world; ++r) {
                    const spbcast_test::child& c = children[r];
                    codes[r] = c.stopped && c.signal() == SIGKILL ? -9
                               : WIFEXITED(c.status)          ? WEXITSTATUS(c.status)
                                                              : 128 + WTERMSIG(c.status);
                }
                std::vector<std::string> rows;
                std::vector<std::string> seen;
                {
                    std::ifstream in(rows_path);
                    for (std::string line; std::getline(in, line);)
                        if (!line.empty()) {
                            rows.push_back(line);
                            const auto k = line.find("\"method\": \"");
                            seen.push_back(line.substr(k + 11, line.find('"', k + 11) - k - 11));
                        }
                }
                std::string failure;
                if (timed_out) failure = "cell timed out after " + number(cell_limit) + " s";
                for (int r = 0; r < world; ++r)
                    if (codes[r] != 0 && codes[r] != -9)
                        failure += (failure.empty() ? "" : "; ") + std::string("rank ") + std::to_string(r) +
                                   " exited with " + std::to_string(codes[r]) + ": " + last_line(logs[r]);
                for (const auto& m : cfg.methods)
                    if (std::find(seen.begin(), seen.end(), m) == seen.end())
                        rows.push_back(skip_row(m, "error", failure.empty() ? "no result from the root" : failure));
                for (const auto& r : rows)
                    if (r.find("\"status\": \"error\"") != std::string::npos) {
                        if (failure.empty()) failure = "a method reported an error";
                        break;
                    }
                if (!failure.empty()) ++failures;
                for (auto& r : rows) results.push_back(r);
                write();
                std::cerr << "[" << n << "/" << total << "] " << profile << " mb=" << mb << " ws=" << world << ": "
                          << std::fixed << std::setprecision(1)
                          << std::chrono::duration<double>(clock_type::now() - cell_start).count() << " s"
                          << (failure.empty() ? "" : " FAILED: " + failure) << "\n";
                if (failure.empty()) {
                    for (const auto& l : logs) std::filesystem::remove(l);
                    std::filesystem::remove(rows_path);
                } else {
                    std::cerr << "  logs kept in " << tmp << "\n";
                }
            }
    if (failures == 0) std::filesystem::remove_all(tmp);
    std::cerr << "wrote " << cfg.json << "\n";
    return failures == 0 ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
    try {
        const config cfg = parse(argc, argv);
        if (cfg.seed_scale) return cfg.world_sizes.empty() ? seed_scale_rank(cfg) : seed_scale_launcher(cfg);
        if (!cfg.world_sizes.empty()) return launcher_main(cfg, argc, argv);
        return rank_main(cfg);
    } catch (const std::exception& e) {
        std::cerr << "spbcast_bench: " << e.what() << "\n";
        return 1;
    }
}
