// Keeping a follower's default CPU generator where it would have been had the follower run
// its own data loader (BASE). The SP leader observes what its loader draws from the default
// generator and sends *events*, never seeds; followers replay exactly those draws and never
// reseed, so every later CPU random operation on a follower sees the same stream as in BASE.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace spbcast {

// How a loader draws from the default CPU generator, declared by the loader itself as
//     static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;
// An explicit declaration, checked at compile time, so a misspelt hook cannot silently turn
// the mirror off (followers' generators would drift from BASE without a word):
//   none       the loader never draws;
//   base_seed  PyTorch DataLoader semantics: bool will_consume_base_seed() const tells before
//              each begin() whether it draws one int64 base seed;
//   events     std::vector<rng_event> iterator_rng_events() const (draws of each begin()) and
//              std::vector<rng_event> construction_rng_events() const (draws while built).
enum class rng_draws { none, base_seed, events };

// One draw from the default CPU generator that a data loader makes as a side effect.
struct rng_event {
    enum kind_t : std::uint8_t {
        base_seed_draw = 1,  // PyTorch DataLoader iterator creation: one int64 random_()
        randperm = 2,        // torch::data RandomSampler construction and reset: randperm(n)
    };
    std::uint8_t kind = base_seed_draw;
    std::int64_t n = 0;                                 // randperm: the permutation size
    std::int8_t dtype = static_cast<std::int8_t>(at::kLong);  // randperm: the index dtype
};

// The follower's half of a base-seed draw: one int64 draw from the default CPU generator,
// result discarded - exactly what PyTorch's _BaseDataLoaderIter.__init__ consumes.
inline void mirror_base_seed_draw() { at::empty({}, at::kLong).random_(); }

inline void replay(const rng_event& event) {
    switch (event.kind) {
        case rng_event::base_seed_draw: mirror_base_seed_draw(); break;
        case rng_event::randperm:
            at::randperm(event.n, at::TensorOptions().dtype(static_cast<c10::ScalarType>(event.dtype)));
            break;
    }
}

}  // namespace spbcast
