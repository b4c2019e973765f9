// demo::MediaLoader, the data loader that the SP leader runs. It keeps PyTorch DataLoader's
// behaviour where spbcast depends on it:
//
// - begin() creates the underlying iterator, and creating it draws one int64 base seed from the
//   default CPU generator, as _BaseDataLoaderIter.__init__ does. With persistent_workers the
//   iterator is created once and later begin() calls only reset it, drawing nothing.
//   will_consume_base_seed() tells before begin() whether it will draw, so that the leader can
//   tell the followers, which never run a loader, to mirror the draw. This draw is the only use
//   of the default generator in the whole pipeline.
// - num_workers threads load and collate whole batches in parallel, at most prefetch_factor
//   batches per worker ahead of the consumer, and hand them out in order; num_workers = 0
//   loads in the calling thread. The batches are the same for any number of workers. A batch
//   whose loading threw rethrows that error (naming the batch and the sample) from the next()
//   that needs it.
// - save_state()/load_state() carry (epoch, position), so that a new process continues with
//   exactly the next batch.
//
// Iteration is explicit, not a range-for, because begin() does things a reader must see (the
// RNG draw, starting the workers):
//
//   demo::MediaLoader loader(config);
//   while (loader.epoch() < epochs) {
//       const bool draws = loader.will_consume_base_seed();  // the leader sends this along
//       demo::MediaLoader::Pass pass = loader.begin();
//       while (std::optional<xtuner::Batch> batch = pass.next()) train(*batch);
//   }
//
// A pass runs from the loader's position to the end of its epoch. Taking an epoch's last batch
// moves the loader to (epoch + 1, position 0), so the next begin() starts the next epoch and a
// state saved at that moment resumes there. set_epoch() is for starting another epoch by hand.
// One thread uses a loader and its passes; the workers are internal.
#pragma once

#include "../common/xtuner_batch.hpp"
#include <spbcast/rng_mirror.hpp>
#include "config.hpp"
#include "dataset.hpp"
#include "packing.hpp"
#include "sampler.hpp"

#include <ATen/ATen.h>

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

namespace demo {

namespace detail {

// The worker threads of one underlying iterator and the batches they have loaded.
class Prefetcher {
public:
    using Load = std::function<xtuner::Batch(int64_t)>;

    Prefetcher(int num_workers, int prefetch_factor)
        : window_(static_cast<int64_t>(num_workers) * prefetch_factor) {
        for (int w = 0; w < num_workers; ++w) workers_.emplace_back([this] { work(); });
    }

    // A worker finishes the batch it is loading before it stops.
    ~Prefetcher() {
        {
            std::lock_guard lock(mutex_);
            stopping_ = true;
        }
        work_ready_.notify_all();
        for (std::thread& worker : workers_) worker.join();
    }

    Prefetcher(const Prefetcher&) = delete;
    Prefetcher& operator=(const Prefetcher&) = delete;

    // Starts over with batches 0..count-1 of `load`. Batches of the previous start that are
    // still being loaded are dropped when they are done.
    void restart(int64_t count, Load load) {
        {
            std::lock_guard lock(mutex_);
            ++generation_;
            count_ = count;
            next_task_ = next_take_ = 0;
            load_ = std::make_shared<const Load>(std::move(load));
            done_.clear();
        }
        work_ready_.notify_all();
    }

    // The next batch in order. If loading it failed, this rethrows the failure and the batch
    // stays the next one.
    xtuner::Batch take() {
        if (workers_.empty()) {
            xtuner::Batch batch = (*load_)(next_take_);
            ++next_take_;
            return batch;
        }
        std::unique_lock lock(mutex_);
        batch_ready_.wait(lock, [&] { return done_.contains(next_take_); });
        const auto it = done_.find(next_take_);
        if (const auto* error = std::get_if<std::exception_ptr>(&it->second)) std::rethrow_exception(*error);
        xtuner::Batch batch = std::move(std::get<xtuner::Batch>(it->second));
        done_.erase(it);
        ++next_take_;
        lock.unlock();
        work_ready_.notify_all();  // the window moved on
        return batch;
    }

private:
    using Result = std::variant<xtuner::Batch, std::exception_ptr>;

    void work() {
        std::unique_lock lock(mutex_);
        while (true) {
            work_ready_.wait(lock, [&] {
                return stopping_ || (next_task_ < count_ && next_task_ < next_take_ + window_);
            });
            if (stopping_) return;
            const int64_t index = next_task_++;
            const uint64_t generation = generation_;
            const std::shared_ptr<const Load> load = load_;
            lock.unlock();
            Result result;
            try {
                result = (*load)(index);
            } catch (...) {
                result = std::current_exception();
            }
            lock.lock();
            if (generation == generation_) {
                done_.emplace(index, std::move(result));
                batch_ready_.notify_all();
            }
        }
    }

    const int64_t window_;
    std::mutex mutex_;
    std::condition_variable work_ready_, batch_ready_;
    bool stopping_ = false;
    uint64_t generation_ = 0;
    int64_t count_ = 0, next_task_ = 0, next_take_ = 0;
    std::shared_ptr<const Load> load_;
    std::map<int64_t, Result> done_;
    std::vector<std::thread> workers_;  // last: they start working as soon as they exist
};

}  // namespace detail

class MediaLoader {
public:
    // One pass over the rest of an epoch; see the top of this file.
    class Pass {
    public:
        // The next batch, or nullopt at the end of the epoch.
        std::optional<xtuner::Batch> next() { return loader_->next(id_); }

    private:
        friend class MediaLoader;
        Pass(MediaLoader& loader, uint64_t id) : loader_(&loader), id_(id) {}
        MediaLoader* loader_;
        uint64_t id_;
    };

    // Generates the media cache if needed (see demo::ensure_cache) and plans the packs.
    explicit MediaLoader(PipelineConfig config)
        : config_(std::move(config)),
          dataset_(config_),
          packs_(plan_packs(dataset_, config_.pack_length)),
          sampler_(static_cast<int64_t>(packs_.size()), config_.seed, config_.dp_rank, config_.dp_size) {
        if (size() == 0)
            throw std::invalid_argument(
                "demo::MediaLoader: the " + std::to_string(config_.num_samples) + " samples make " +
                std::to_string(packs_.size()) + " packs, fewer than one batch needs on each of " +
                std::to_string(config_.dp_size) + " DP ranks (micro_batches " + std::to_string(config_.micro_batches) +
                "); raise num_samples or lower micro_batches");
    }

    MediaLoader(const MediaLoader&) = delete;
    MediaLoader& operator=(const MediaLoader&) = delete;

    int64_t size() const { return sampler_.size() / config_.micro_batches; }  // batches per epoch
    int64_t epoch() const { return sampler_.epoch(); }
    int64_t position() const { return sampler_.position() / config_.micro_batches; }  // batches taken this epoch
    int64_t base_seed() const { return base_seed_; }  // the last one drawn
    const PipelineConfig& config() const { return config_; }
    const Dataset& dataset() const { return dataset_; }

    // Will the next begin() draw a base seed from the default CPU generator?
    static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::base_seed;
    bool will_consume_base_seed() const { return !config_.persistent_workers || !iterator_; }

    Pass begin() {
        if (will_consume_base_seed()) {
            iterator_.reset();  // joins the workers of the previous iterator
            base_seed_ = at::empty({}, at::kLong).random_().item<int64_t>();
            iterator_ = std::make_unique<detail::Prefetcher>(config_.num_workers, config_.prefetch_factor);
        }
        remaining_ = size() - position();
        iterator_->restart(remaining_, [this, order = sampler_.indices(epoch()), epoch = epoch(),
                                        first = position()](int64_t k) {
            return load_batch(order, epoch, first + k);
        });
        return Pass(*this, ++pass_id_);
    }

    // Moves to the start of `epoch`; the current pass, if any, ends.
    void set_epoch(int64_t epoch) {
        sampler_.set_epoch(epoch);
        end_pass();
    }

    std::string save_state() const { return sampler_.save_state(); }

    // Continues where save_state() was called, from the next begin(); the current pass ends.
    // The iterator is left as it is: in a new process the first begin() draws a base seed, as
    // the first iter() of a restarted PyTorch trainer does.
    void load_state(std::string_view state) {
        sampler_.load_state(state);
        if (sampler_.position() % config_.micro_batches != 0)
            throw std::invalid_argument("demo::MediaLoader::load_state: state '" + std::string(state) +
                                        "' is not at a batch boundary for micro_batches " +
                                        std::to_string(config_.micro_batches) + "; restore with the same micro_batches");
        if (position() == size()) sampler_.set_epoch(epoch() + 1);
        end_pass();
    }

private:
    xtuner::Batch load_batch(const std::vector<int64_t>& order, int64_t epoch, int64_t batch_index) const {
        xtuner::Batch batch;
        try {
            for (int64_t m = 0; m < config_.micro_batches; ++m) {
                const int64_t pack = order[static_cast<size_t>(batch_index * config_.micro_batches + m)];
                batch.push_back(pack_samples(dataset_, packs_[static_cast<size_t>(pack)], config_.pack_length,
                                             config_.collate_in_shared_memory));
            }
        } catch (const std::exception& e) {
            throw std::runtime_error("demo::MediaLoader: batch " + std::to_string(batch_index) + " of epoch " +
                                     std::to_string(epoch) + ": " + e.what());
        }
        return batch;
    }

    std::optional<xtuner::Batch> next(uint64_t pass_id) {
        if (pass_id != pass_id_)
            throw std::logic_error("demo::MediaLoader: this pass was ended by a later begin(), set_epoch() or "
                                   "load_state(); iterate the pass that the last begin() returned");
        if (remaining_ == 0) return std::nullopt;
        xtuner::Batch batch = iterator_->take();
        --remaining_;
        sampler_.advance(config_.micro_batches);
        if (position() == size()) sampler_.set_epoch(epoch() + 1);
        return batch;
    }

    void end_pass() {
        ++pass_id_;
        remaining_ = 0;
    }

    PipelineConfig config_;
    Dataset dataset_;
    std::vector<std::vector<int64_t>> packs_;
    ResumableSampler sampler_;
    int64_t base_seed_ = 0;
    int64_t remaining_ = 0;  // batches left in the current pass
    uint64_t pass_id_ = 0;
    std::unique_ptr<detail::Prefetcher> iterator_;  // last: its workers use the members above
};

}  // namespace demo
