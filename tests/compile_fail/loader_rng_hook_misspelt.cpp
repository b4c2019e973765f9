// A loader that declares PyTorch base-seed semantics but misspells the hook: without the check,
// followers would silently stop mirroring its draws and drift from BASE.
#include <spbcast/loader.hpp>

#include "transport.hpp"

#include <optional>
#include <vector>

struct Loader {
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::base_seed;
    bool will_consume_base_seeds() const { return true; }  // typo: the hook is will_consume_base_seed
    struct pass {
        std::optional<std::vector<int64_t>> next() { return std::nullopt; }
    };
    pass begin() { return {}; }
};

void build(declared_transport& group) {
    auto loader = spbcast::make_leader_loader(spbcast::loader_config{.total_epoch = 1}, &group, 1,
                                              [] { return std::make_unique<Loader>(); });
}
