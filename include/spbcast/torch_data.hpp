// LibTorch's own data loaders (torch::data) as spbcast loaders, with their RNG draws mirrored:
// a RandomSampler calls torch::randperm(size) on the default CPU generator when it is built
// and every time StatelessDataLoader::begin() resets it. On dedup followers, which never build
// the loader, leader_loader replays exactly those draws.
//
//   auto loader = spbcast::make_leader_loader(cfg, sp_group, 1, [&] {
//       return std::make_unique<spbcast::torch_data_loader<decltype(data_loader)::element_type>>(
//           torch::data::make_data_loader(dataset, torch::data::samplers::RandomSampler(n), opts), n);
//   });
#pragma once

#include "codec.hpp"
#include "rng_mirror.hpp"

#include <torch/data.h>

#include <memory>
#include <optional>
#include <tuple>
#include <vector>

namespace spbcast {

template <class TorchLoader>
class torch_data_loader {
public:
    using batch_type = typename TorchLoader::BatchType;

    struct pass {
        torch::data::Iterator<batch_type> it, end;
        std::optional<batch_type> next() {
            if (it == end) return std::nullopt;
            batch_type batch = std::move(*it);
            ++it;
            return batch;
        }
    };

    // `sampler_size` is the size the RandomSampler was built with; `random_sampler` false for
    // samplers that draw nothing (SequentialSampler).
    torch_data_loader(std::unique_ptr<TorchLoader> loader, std::int64_t sampler_size,
                      bool random_sampler = true, c10::ScalarType index_dtype = at::kLong)
        : loader_(std::move(loader)), sampler_size_(sampler_size), random_(random_sampler),
          index_dtype_(index_dtype) {}

    pass begin() {
        auto it = loader_->begin();  // resets the sampler: randperm(size) for a RandomSampler
        return pass{std::move(it), loader_->end()};
    }

    std::int64_t size() const {
        const auto batch = static_cast<std::int64_t>(loader_->options().batch_size);
        return loader_->options().drop_last ? sampler_size_ / batch
                                            : (sampler_size_ + batch - 1) / batch;
    }

    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::events;
    std::vector<rng_event> construction_rng_events() const { return draws(); }
    std::vector<rng_event> iterator_rng_events() const { return draws(); }

private:
    std::vector<rng_event> draws() const {
        if (!random_) return {};
        return {rng_event{rng_event::randperm, sampler_size_, static_cast<std::int8_t>(index_dtype_)}};
    }

    std::unique_ptr<TorchLoader> loader_;
    std::int64_t sampler_size_;
    bool random_;
    c10::ScalarType index_dtype_;
};

// torch::data::Example has constructors, so it is no aggregate: send it as (data, target).
template <class Data, class Target>
struct codec<torch::data::Example<Data, Target>> {
    static std::tuple<Data, Target> to_wire(const torch::data::Example<Data, Target>& e) {
        return {e.data, e.target};
    }
    static torch::data::Example<Data, Target> from_wire(std::tuple<Data, Target>&& w) {
        return {std::move(std::get<0>(w)), std::move(std::get<1>(w))};
    }
};

}  // namespace spbcast
