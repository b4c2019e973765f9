// The passes: the loader itself, when a pass over it starts and ends, and what that draws from
// the default CPU generator. A pass starts at the first fetch after the previous one ended
// (begin(), with the draws rng_mirror.hpp describes recorded for the followers) and ends when it
// returns no batch (set_epoch with the next epoch); the run ends after total_epoch epochs or
// total_step steps. Followers hold no loader: they replay the leader's recorded draws.
#pragma once

#include "../../error.hpp"
#include "../../rng_mirror.hpp"
#include "resume.hpp"

#include <concepts>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spbcast::detail {

// The loader's declaration, or none where it made none (check_rng_declaration then fails with
// one message, not a cascade).
template <class L>
constexpr rng_draws declared_rng_draws() {
    if constexpr (requires { { L::rng_draws } -> std::convertible_to<rng_draws>; })
        return L::rng_draws;
    else
        return rng_draws::none;
}

// rng_draws is declared and backed by its members: a misspelt member is a compile error, not a
// follower whose generator silently drifts from BASE.
template <class L>
constexpr void check_rng_declaration() {
    static_assert(requires { { L::rng_draws } -> std::convertible_to<rng_draws>; },
                  "spbcast: a loader must declare how it draws from the default CPU generator: add "
                  "'static constexpr spbcast::rng_draws rng_draws = spbcast::rng_draws::none;' "
                  "(or base_seed / events; see spbcast/rng_mirror.hpp)");
    if constexpr (requires { { L::rng_draws } -> std::convertible_to<rng_draws>; }) {
        constexpr bool base_seed_hook = requires(const L& l) { { l.will_consume_base_seed() } -> std::same_as<bool>; };
        constexpr bool event_hooks = requires(const L& l) {
            { l.iterator_rng_events() } -> std::convertible_to<std::vector<rng_event>>;
            { l.construction_rng_events() } -> std::convertible_to<std::vector<rng_event>>;
        };
        static_assert(L::rng_draws != rng_draws::base_seed || base_seed_hook,
                      "spbcast: the loader declares rng_draws = base_seed but has no "
                      "'bool will_consume_base_seed() const'; add it (check its spelling)");
        static_assert(L::rng_draws != rng_draws::events || event_hooks,
                      "spbcast: the loader declares rng_draws = events but lacks "
                      "'std::vector<spbcast::rng_event> iterator_rng_events() const' or "
                      "'construction_rng_events() const'; add both (check their spelling)");
        static_assert(L::rng_draws != rng_draws::none || (!base_seed_hook && !event_hooks),
                      "spbcast: the loader declares rng_draws = none but has RNG hooks; declare "
                      "base_seed or events so followers mirror its draws");
    }
}

// Events from the wire are data: replaying one must not allocate without bound.
inline void check_rng_event(const rng_event& e, const std::string& where) {
    const bool ok = (e.kind == rng_event::base_seed_draw) ||
                    (e.kind == rng_event::randperm && e.n >= 0 && e.n <= (std::int64_t{1} << 34) &&
                     (e.dtype == static_cast<std::int8_t>(at::kLong) ||
                      e.dtype == static_cast<std::int8_t>(at::kInt)));
    if (!ok)
        throw error(errc::corrupt_frame, where + ": an invalid RNG event (kind " +
                                             std::to_string(e.kind) + ", n " + std::to_string(e.n) +
                                             ") arrived from the SP leader");
}

template <class Loader>
class loader_passes {
public:
    using pass_type = decltype(std::declval<Loader&>().begin());
    using batch_type = typename decltype(std::declval<pass_type&>().next())::value_type;

    // `where`: how this rank's messages begin.
    loader_passes(std::optional<std::int64_t> total_epoch, std::optional<std::int64_t> total_step, std::string where)
        : total_epoch_(total_epoch), total_step_(total_step), where_(std::move(where)) {
        check_rng_declaration<Loader>();
    }

    // `make_loader` returns a std::unique_ptr<Loader>.
    template <class Factory>
    void build(Factory& make_loader) {
        loader_ = make_loader();
        length_ = local_length();
    }

    // What building the loader drew, for the followers to replay.
    std::vector<rng_event> construction_draws() const {
        if constexpr (declared_rng_draws<Loader>() == rng_draws::events)
            return loader_->construction_rng_events();
        else
            return {};
    }

    // A follower: the leader's draws for the same construction or step, before any of its errors
    // is raised, so a trainer that catches the error goes on with BASE's generator.
    void replay_leader_draws(const std::vector<rng_event>& events) const {
        for (const rng_event& event : events) {
            check_rng_event(event, where_);
            replay(event);
        }
    }

    bool has_loader() const { return loader_ != nullptr; }
    Loader* loader() { return loader_.get(); }

    // Batches per epoch (-1: the loader has no size()); with dedup on, the leader's on every rank.
    std::int64_t length() const { return length_; }
    void take_leaders_length(std::int64_t length) { length_ = length; }

    // Steps of the whole run: total_step, or length() * total_epoch (-1 when unknown).
    std::int64_t total_steps() const {
        if (total_step_) return *total_step_;
        return length_ < 0 ? -1 : length_ * *total_epoch_;
    }

    bool step_limit_reached(std::int64_t step) const { return total_step_ && step >= *total_step_; }

    // The one fetch/epoch loop: next batch of the current pass; at the end of a pass, advance
    // the epoch and start the next pass, recording in `events` the RNG draws that creating it
    // makes. `pass_ended`: the current pass already returned its end (to the prefetch thread).
    std::optional<batch_type> fetch(loader_position& at, std::vector<rng_event>& events, bool pass_ended = false) {
        if (finished_ || step_limit_reached(at.step())) return finish();
        for (int empty_passes = 0;;) {
            if (!pass_ended) {
                if (!pass_) begin_pass(events);
                if (auto batch = pass_->next()) {
                    at.count_batch();
                    return batch;
                }
            }
            pass_ended = false;
            end_epoch(at);
            if (total_epoch_ && at.epoch() >= *total_epoch_) return finish();
            if (++empty_passes == 2)
                throw error(errc::loader, where_ + ": the data loader yielded no batch for a whole "
                                                   "epoch; check the dataset and the sampler");
        }
    }

    // The next batch of the pass in progress, none at its end (or with no pass in progress): the
    // prefetch thread's fetch, which starts and ends no pass.
    std::optional<batch_type> next_in_pass() {
        if (!pass_) return std::nullopt;
        return pass_->next();
    }

    void end_epoch(loader_position& at) {
        pass_.reset();
        at.next_epoch();
        if constexpr (requires { loader_->set_epoch(at.epoch()); }) loader_->set_epoch(at.epoch());
    }

    std::string loader_state() const
        requires requires(const Loader& l) { l.save_state(); }
    {
        return loader_->save_state();
    }

    // Ends the pass in progress and gives the loader its saved state, where it keeps one.
    void restore(std::string_view loader_state) {
        pass_.reset();
        if constexpr (requires { loader_->load_state(loader_state); }) loader_->load_state(loader_state);
    }

private:
    void begin_pass(std::vector<rng_event>& events) {
        if constexpr (declared_rng_draws<Loader>() == rng_draws::events) {
            for (const rng_event& e : loader_->iterator_rng_events()) events.push_back(e);
        } else if constexpr (declared_rng_draws<Loader>() == rng_draws::base_seed) {
            if (loader_->will_consume_base_seed()) events.push_back({rng_event::base_seed_draw});
        }
        pass_.emplace(loader_->begin());
    }

    std::int64_t local_length() const {
        if constexpr (requires { loader_->size(); })
            return static_cast<std::int64_t>(loader_->size());
        else
            return -1;
    }

    std::optional<batch_type> finish() {
        finished_ = true;
        return std::nullopt;
    }

    std::optional<std::int64_t> total_epoch_, total_step_;
    std::string where_;
    bool finished_ = false;
    std::int64_t length_ = -1;
    std::unique_ptr<Loader> loader_;
    std::optional<pass_type> pass_;
};

}  // namespace spbcast::detail
