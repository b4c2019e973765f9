// Soak: many broadcasts of randomly generated batches across 4 ranks (threads, real Gloo on
// one store): random nesting, shapes, dtypes (every dtype with a wire code in this LibTorch),
// views, aliases, expanded, self-overlapping (unfold) and conjugated tensors, random IValue
// trees, a random root and random options per step. Every follower's value must be identical
// to the root's, and the process's resident memory must not grow once warm.
//
// SPBCAST_SOAK_STEPS sets the number of broadcasts (support/fixtures.hpp: soak_steps);
// SPBCAST_SOAK_SEED changes the batches.
#include "support/fixtures.hpp"
#include "support/identical.hpp"
#include "support/ranks.hpp"

#include <boost/hana/define_struct.hpp>

#include <malloc.h>
#include <unistd.h>

#include <barrier>
#include <chrono>
#include <exception>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <variant>
#include <vector>

namespace soak {

struct Leaf {
    BOOST_HANA_DEFINE_STRUCT(Leaf,
        (at::Tensor, tensor),
        (std::optional<at::Tensor>, maybe),
        (std::variant<int64_t, std::string, at::Tensor>, tag),
        (std::vector<double>, weights));
};

struct Node {
    BOOST_HANA_DEFINE_STRUCT(Node,
        (std::vector<Leaf>, leaves),
        (std::map<std::string, at::Tensor>, named),
        (std::vector<std::vector<at::Tensor>>, nested),
        (std::optional<std::string>, label),
        (c10::IValue, dynamic));
};

using Batch = std::vector<Node>;

// Builds one random batch; the same (seed, step) gives the same batch on every rank.
class generator {
public:
    explicit generator(std::uint64_t seed) : rng_(seed) {
        for (int code = 0; code < 256; ++code)
            if (auto t = spbcast::detail::dtype_from_code(static_cast<std::uint8_t>(code))) dtypes_.push_back(*t);
    }

    Batch batch() {
        Batch b(pick(0, 4));
        for (Node& n : b) n = node();
        return b;
    }

    bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
    std::int64_t pick(std::int64_t lo, std::int64_t hi) {  // inclusive
        return std::uniform_int_distribution<std::int64_t>(lo, hi)(rng_);
    }

private:
    Node node() {
        Node n;
        n.leaves.resize(pick(0, 3));
        for (Leaf& l : n.leaves) {
            l.tensor = tensor();
            if (chance(0.5)) l.maybe = tensor();
            switch (pick(0, 2)) {
                case 0: l.tag = pick(-1000, 1000); break;
                case 1: l.tag = std::string(pick(0, 40), static_cast<char>('a' + pick(0, 25))); break;
                default: l.tag = tensor(); break;
            }
            l.weights.resize(pick(0, 5));
            for (auto& w : l.weights) w = std::bit_cast<double>(rng_());  // NaN payloads included
        }
        for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i) n.named["k" + std::to_string(pick(0, 9))] = tensor();
        n.nested.resize(pick(0, 2));
        for (auto& v : n.nested) {
            v.resize(pick(0, 3));
            for (auto& t : v) t = tensor();
        }
        if (chance(0.5)) n.label = "label-" + std::to_string(pick(0, 1 << 20));
        n.dynamic = ivalue(0);
        return n;
    }

    c10::IValue ivalue(int depth) {
        const int kind = static_cast<int>(pick(0, depth >= 3 ? 6 : 11));
        switch (kind) {
            case 0: return c10::IValue();
            case 1: return pick(-100000, 100000);
            case 2: return std::bit_cast<double>(rng_());
            case 3: return chance(0.5);
            case 4: return std::string(pick(0, 20), 'x');
            case 5: return tensor();
            case 6: {
                std::vector<int64_t> v(pick(0, 5));
                for (auto& x : v) x = pick(-9, 9);
                return v;
            }
            case 7: {
                c10::List<at::Tensor> l;
                for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i) l.push_back(tensor());
                return l;
            }
            case 8: {
                c10::impl::GenericList l(c10::AnyType::get());
                for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i) l.push_back(ivalue(depth + 1));
                return l;
            }
            case 9: {
                c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
                for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i)
                    d.insert_or_assign("key" + std::to_string(pick(0, 5)), ivalue(depth + 1));
                return d;
            }
            case 10: {
                c10::impl::GenericDict d(c10::IntType::get(), c10::TensorType::get());
                for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i) d.insert_or_assign(pick(0, 5), tensor());
                return d;
            }
            default: {
                std::vector<c10::IValue> e;
                for (int i = 0, k = static_cast<int>(pick(0, 3)); i < k; ++i) e.push_back(ivalue(depth + 1));
                return c10::ivalue::Tuple::create(std::move(e));
            }
        }
    }

    at::Tensor tensor() {
        at::Tensor t;
        if (!pool_.empty() && chance(0.2)) {
            t = pool_[pick(0, static_cast<std::int64_t>(pool_.size()) - 1)];  // the same tensor again
        } else if (!pool_.empty() && chance(0.3)) {
            t = view_of(pool_[pick(0, static_cast<std::int64_t>(pool_.size()) - 1)]);
        } else if (chance(0.05)) {
            return at::Tensor();
        } else {
            t = fresh();
        }
        pool_.push_back(t);
        return t;
    }

    at::Tensor fresh() {
        const c10::ScalarType dtype = dtypes_[pick(0, static_cast<std::int64_t>(dtypes_.size()) - 1)];
        std::vector<std::int64_t> sizes(chance(0.03) ? pick(5, 7) : pick(0, 3));
        for (auto& s : sizes) s = chance(0.05) ? 0 : pick(1, 6);
        if (chance(0.02)) sizes = {pick(300000, 700000)};  // a large storage: an in-place slot
        at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
        auto* bytes = static_cast<std::uint8_t*>(t.data_ptr());
        const auto n = static_cast<std::size_t>(t.numel()) * t.element_size();
        for (std::size_t i = 0; i < n; i += 8) {
            const std::uint64_t r = rng_();
            std::memcpy(bytes + i, &r, std::min<std::size_t>(8, n - i));
        }
        if (dtype == at::kBool)
            for (std::size_t i = 0; i < n; ++i) bytes[i] &= 1;
        if (t.dim() >= 2 && chance(0.3)) t = t.transpose(0, t.dim() - 1);  // born non-contiguous
        const bool differentiable = dtype == at::kFloat || dtype == at::kDouble || dtype == at::kComplexFloat;
        if (differentiable && t.is_leaf() && chance(0.2)) t.set_requires_grad(true);
        return t;
    }

    at::Tensor view_of(const at::Tensor& base) {
        if (!base.defined()) return fresh();
        const auto dim = base.dim();
        switch (pick(0, 7)) {
            case 0:
                if (dim >= 2) return base.transpose(0, 1);
                break;
            case 1:
                if (dim >= 1 && base.size(0) > 1) {
                    const auto start = pick(0, base.size(0) - 1);
                    return base.narrow(0, start, pick(0, base.size(0) - start));
                }
                break;
            case 2:
                if (dim >= 1 && base.size(dim - 1) > 2) return base.slice(dim - 1, 0, base.size(dim - 1), 2);
                break;
            case 3:
                if (dim <= 5) {
                    auto sizes = base.sizes().vec();
                    sizes.insert(sizes.begin(), pick(1, 4));
                    return base.unsqueeze(0).expand(sizes);
                }
                break;
            case 4:
                if (base.is_complex() && !base.requires_grad()) return chance(0.5) ? base.conj() : at::imag(base.conj());
                break;
            case 5:
                if (dim >= 1 && base.size(0) > 0) return base.select(0, pick(0, base.size(0) - 1));
                break;
            case 6:  // sliding windows: a view that overlaps itself (small bases only: the
                     // checker reads views element by element, windows multiply their size)
                if (dim >= 1 && base.size(-1) >= 2 && base.numel() <= 1024) {
                    const auto window = pick(1, base.size(-1));
                    return base.unfold(dim - 1, window, pick(1, window));
                }
                break;
            default:
                if (!base.requires_grad() && base.element_size() == 4 && base.dim() >= 1 && base.stride(-1) == 1 &&
                    !base.is_conj() && !base.is_neg())
                    return base.view(chance(0.5) ? at::kInt : at::kFloat);  // another dtype over the same bytes
                break;
        }
        return base;
    }

    std::mt19937_64 rng_;
    std::vector<c10::ScalarType> dtypes_;
    std::vector<at::Tensor> pool_;
};

struct step_setup {
    int root;
    spbcast::options opts;
};

step_setup setup_of(std::uint64_t seed, std::uint64_t step, int world) {
    generator g(seed * 7919 + step * 2 + 1);
    step_setup s;
    s.root = static_cast<int>(g.pick(0, world - 1));
    s.opts.root = s.root;
    s.opts.timeout = std::chrono::seconds(60);
    s.opts.inplace_min_bytes = std::size_t{1} << g.pick(10, 21);
    s.opts.bucket_bytes = std::size_t{1} << g.pick(8, 24);
    s.opts.max_in_flight = static_cast<std::size_t>(g.pick(1, 4));
    s.opts.checksum = g.chance(0.3);
    return s;
}

Batch batch_of(std::uint64_t seed, std::uint64_t step) { return generator(seed * 7919 + step * 2).batch(); }

double rss_mib() {
    std::ifstream statm("/proc/self/statm");
    long long pages = 0, resident = 0;
    statm >> pages >> resident;
    return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / (1 << 20);
}

}  // namespace soak

TEST_SUITE("soak") {

TEST_CASE("soak: random batches across 4 ranks arrive identical, and memory stays flat") {
    const std::uint64_t steps = spbcast_test::soak_steps();
    const std::uint64_t seed = spbcast_test::env_number("SPBCAST_SOAK_SEED", 20251129);
    constexpr int world = 4;
    std::vector<std::pair<std::uint64_t, double>> rss;  // (step, MiB) at checkpoints, rank 0
    std::vector<std::uint64_t> tensors_checked(world, 0);
    const auto start = std::chrono::steady_clock::now();
    // Memory is measured where no batch is alive on any rank (all ranks meet at a barrier),
    // after returning free heap pages to the system, with glibc's mmap threshold fixed so that
    // large tensors are mapped and unmapped rather than left in a growing heap: what remains is
    // what spbcast, Gloo and LibTorch hold, which must not grow with the number of steps.
    ::mallopt(M_MMAP_THRESHOLD, 128 * 1024);
    std::barrier sync(world);
    const std::uint64_t every = std::max<std::uint64_t>(steps / 20, 1);
    spbcast_test::run_ranks(world, [&](int rank, auto& group) {
        // A rank that fails leaves the barrier, so the others reach their own failure (or the
        // timeout) instead of waiting for it forever.
        struct leave_on_failure {
            std::barrier<>& sync;
            int uncaught = std::uncaught_exceptions();
            ~leave_on_failure() {
                if (std::uncaught_exceptions() > uncaught) sync.arrive_and_drop();
            }
        } leave{sync};
        for (std::uint64_t step = 1; step <= steps; ++step) {
            {
                const soak::step_setup s = soak::setup_of(seed, step, world);
                soak::Batch value;
                if (rank == s.root) value = soak::batch_of(seed, step);
                spbcast::broadcast(value, group, s.opts);
                spbcast_test::identical_checker checker;
                checker.check(soak::batch_of(seed, step), value);
                checker.check_structure();
                tensors_checked[rank] += checker.tensors_checked();
            }
            if (step % every == 0 || step == 1) {
                sync.arrive_and_wait();
                if (rank == 0) {
                    ::malloc_trim(0);
                    rss.emplace_back(step, soak::rss_mib());
                }
                sync.arrive_and_wait();
            }
        }
    }, std::chrono::seconds(60));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    std::string series;
    for (auto [step, mib] : rss) series += " " + std::to_string(step) + ":" + std::to_string(static_cast<int>(mib));
    MESSAGE("soak: " << steps << " broadcasts x " << world << " ranks in " << seconds << " s ("
                     << 1000.0 * seconds / static_cast<double>(steps) << " ms per step), "
                     << tensors_checked[1] << " tensors checked on rank 1; RSS MiB by step:" << series);
    // Memory: once warm (after the first quarter), RSS must not keep growing. The bound
    // allows for allocator noise, not for a leak: a leak of one small tensor per step would
    // be tens of MiB over the default 1000 steps.
    REQUIRE(rss.size() >= 4);
#if defined(__SANITIZE_ADDRESS__)
    MESSAGE("RSS flatness not checked: AddressSanitizer's quarantine keeps freed memory "
            "resident by design (LeakSanitizer checks for leaks at exit instead)");
    return;
#endif
    const std::size_t warm = rss.size() / 4;
    double warm_max = 0;
    for (std::size_t i = warm; i < rss.size() / 2; ++i) warm_max = std::max(warm_max, rss[i].second);
    double late_max = 0;
    for (std::size_t i = rss.size() / 2; i < rss.size(); ++i) late_max = std::max(late_max, rss[i].second);
    CHECK_MESSAGE(late_max <= warm_max + 16.0, "RSS grew from " << warm_max << " MiB to " << late_max << " MiB");
}

}  // TEST_SUITE
