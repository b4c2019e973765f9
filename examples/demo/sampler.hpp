// A shuffling sampler that can be checkpointed mid-epoch. Its state is (epoch, position): the
// epoch picks the order and the position says how many of its indices were consumed, so a new
// process that loads the state continues with exactly the next index.
#pragma once

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <charconv>
#include <cstdint>
#include <map>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace demo {

class ResumableSampler {
public:
    // Shards like DistributedSampler with drop_last: each of world_size replicas gets
    // dataset_size / world_size indices per epoch, and the remainder is skipped.
    ResumableSampler(int64_t dataset_size, uint64_t seed, int rank = 0, int world_size = 1)
        : dataset_size_(dataset_size), seed_(seed), rank_(rank), world_size_(world_size),
          size_(world_size > 0 ? dataset_size / world_size : 0) {
        if (dataset_size < 0 || world_size < 1 || rank < 0 || rank >= world_size)
            throw std::invalid_argument("demo::ResumableSampler: need dataset_size >= 0 and 0 <= rank < world_size, got " +
                                        std::to_string(dataset_size) + ", " + std::to_string(rank) + ", " +
                                        std::to_string(world_size));
    }

    int64_t size() const { return size_; }  // indices per epoch for this rank
    int64_t epoch() const { return epoch_; }
    int64_t position() const { return position_; }

    // DistributedSampler's recipe: a permutation from a generator seeded with seed + epoch,
    // then every world_size-th element starting at rank. The generator is private because the
    // default CPU generator belongs to the trainer: a sampler that drew from it would shift the
    // trainer's random stream on the ranks that run the loader but not on the others.
    std::vector<int64_t> indices(int64_t epoch) const {
        at::Generator generator = at::make_generator<at::CPUGeneratorImpl>(seed_ + static_cast<uint64_t>(epoch));
        const at::Tensor order = at::randperm(dataset_size_, generator, at::TensorOptions().dtype(at::kLong));
        const int64_t* p = order.data_ptr<int64_t>();
        std::vector<int64_t> mine;
        mine.reserve(static_cast<size_t>(size_));
        for (int64_t k = 0; k < size_; ++k) mine.push_back(p[rank_ + k * world_size_]);
        return mine;
    }

    void set_epoch(int64_t epoch) {
        if (epoch < 0) throw std::invalid_argument("demo::ResumableSampler::set_epoch: epoch must be >= 0");
        epoch_ = epoch;
        position_ = 0;
    }

    void advance(int64_t count) {
        if (count < 0 || position_ + count > size_)
            throw std::logic_error("demo::ResumableSampler::advance: " + std::to_string(count) + " more indices from position " +
                                   std::to_string(position_) + " would run past the epoch's " + std::to_string(size_));
        position_ += count;
    }

    // "epoch=E position=P size=N seed=S"; size and seed are there to refuse a state that was
    // saved for another dataset or order.
    std::string save_state() const {
        return "epoch=" + std::to_string(epoch_) + " position=" + std::to_string(position_) +
               " size=" + std::to_string(size_) + " seed=" + std::to_string(seed_);
    }

    void load_state(std::string_view state) {
        std::map<std::string, std::string, std::less<>> fields;
        for (size_t begin = 0; begin < state.size();) {
            const size_t end = std::min(state.find(' ', begin), state.size());
            const std::string_view field = state.substr(begin, end - begin);
            const size_t eq = field.find('=');
            if (!field.empty()) {
                if (eq == std::string_view::npos) bad_state(state, "'" + std::string(field) + "' is not key=value");
                fields[std::string(field.substr(0, eq))] = std::string(field.substr(eq + 1));
            }
            begin = end + 1;
        }
        if (fields.size() != 4) bad_state(state, "expected exactly the keys epoch, position, size, seed");
        const auto epoch = number<int64_t>(fields, "epoch", state);
        const auto position = number<int64_t>(fields, "position", state);
        const auto size = number<int64_t>(fields, "size", state);
        const auto seed = number<uint64_t>(fields, "seed", state);
        if (size != size_ || seed != seed_)
            bad_state(state, "it was saved for " + std::to_string(size) + " indices per epoch and seed " + std::to_string(seed) +
                                 ", this sampler has " + std::to_string(size_) + " and seed " + std::to_string(seed_) +
                                 "; restore with the same dataset, seed and DP size");
        if (epoch < 0 || position < 0 || position > size_) bad_state(state, "epoch or position out of range");
        epoch_ = epoch;
        position_ = position;
    }

private:
    [[noreturn]] static void bad_state(std::string_view state, const std::string& why) {
        throw std::invalid_argument("demo::ResumableSampler::load_state: cannot use state '" + std::string(state) + "': " + why);
    }

    template <typename T>
    static T number(const std::map<std::string, std::string, std::less<>>& fields, const char* key, std::string_view state) {
        const auto it = fields.find(key);
        if (it == fields.end()) bad_state(state, std::string("missing '") + key + "'");
        T value{};
        const std::string& text = it->second;
        const auto [end, error] = std::from_chars(text.data(), text.data() + text.size(), value);
        if (error != std::errc() || end != text.data() + text.size())
            bad_state(state, std::string("'") + key + "' is not a number");
        return value;
    }

    int64_t dataset_size_;
    uint64_t seed_;
    int64_t rank_, world_size_, size_;
    int64_t epoch_ = 0, position_ = 0;
};

}  // namespace demo
