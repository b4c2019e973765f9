// SP leader-only loading. Every rank of an SP group needs the same batch; with
// sp_media_dedup on, only the SP leader builds and runs the data loader, and each step it
// broadcasts one envelope (status, epoch, step, RNG events, batch) over the SP group. Followers
// never build a loader, yet return the same batches and epochs, and their default CPU
// generator advances exactly as if they had run their own loader (see rng_mirror.hpp).
//
// A loader is any type with
//     auto pass = loader.begin();            // creates the underlying iterator (one pass)
//     std::optional<Batch> b = pass.next();  // the next batch, nullopt at the end of the pass
//     static constexpr spbcast::rng_draws rng_draws = ...;   // required: see rng_mirror.hpp
// and optionally
//     int64_t size() const;                  // batches per epoch (enables total-epoch length sync)
//     void set_epoch(int64_t);               // called when a pass ends, with the next epoch
//     std::string save_state() const; void load_state(std::string_view);
//
// Initialisation that needs collectives on every rank (dataset indexing, packing statistics)
// must happen before the leader_loader is built: the factory runs on the SP leader only.
#pragma once

#include "broadcast.hpp"
#include "detail/orchestration/keep_alive.hpp"
#include "dist.hpp"
#include "error.hpp"
#include "rng_mirror.hpp"
#include "shared_memory.hpp"

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

namespace spbcast {

struct loader_config {
    bool sp_media_dedup = false;           // off: every rank runs its own loader (BASE)
    std::optional<std::int64_t> total_epoch;  // set exactly one of these two
    std::optional<std::int64_t> total_step;
    // Bounds the transport of each step's broadcast, message by message. A leader that takes
    // longer to fetch a batch is not a failure: it tells the followers it is still working
    // (keep_alive.hpp), and they wait for it as a BASE rank waits for its own loader.
    std::chrono::milliseconds timeout = std::chrono::minutes(5);
    // How long a follower waits for the leader to start a step's broadcast (options::root_wait)
    // when the leader is late outside the loader - saving a checkpoint, evaluating - where no
    // keep-alive runs. Zero: the SP group's own timeout (what ProcessGroupGloo::Options or
    // init_process_group was given; spbcast::dist::group_timeout), as a BASE rank waits in its
    // next collective - or `timeout` where that is longer, or where the group does not say (a
    // transport of your own). Otherwise at least `timeout`. A dead leader is seen at once
    // whatever this is (its sockets close). With LibTorch 1.13's Gloo no wait outlasts the
    // group's own timeout: raise that one there.
    std::chrono::milliseconds root_wait{0};
    // How batches travel: the same-host path where the SP group shares a host (docs/transports.md).
    transport_mode transport = transport_mode::automatic;
    // Across hosts, the chunk each host leader forwards as it lands (options::relay_chunk_bytes).
    std::size_t relay_chunk_bytes = options{}.relay_chunk_bytes;
    // On the same-host path the leader fetches each batch inside a spbcast::shared_memory_scope,
    // so the batch's large tensors are born in shared memory and the broadcast copies nothing
    // (the whole SP group holds one copy). Loaders that collate in worker threads open the
    // scope in those threads themselves.
    bool leader_allocates_in_shared_memory = true;
};

template <class L>
concept data_loader = requires(L& loader) {
    { loader.begin().next() } -> detail::optional_like;
};

template <data_loader L>
using loader_batch_t = typename decltype(std::declval<L&>().begin().next())::value_type;

// What the leader's loader did, on the wire: never inferred from an empty message or an
// absent batch, so no failure can pass for the end of the data.
enum class leader_status : std::uint8_t { batch = 1, end = 2, failed = 3 };

// What the leader sends once, when the loader has been built (status batch or failed).
struct loader_init {
    leader_status status = leader_status::batch;
    std::string error;               // the factory's exception, when it failed
    std::vector<rng_event> rng_events;
    std::int64_t length = -1;        // batches per epoch; -1 when the loader has no size()
};

// What the leader sends every step.
template <class Batch>
struct step_envelope {
    leader_status status = leader_status::end;
    std::string error;               // the loader's exception, when it failed
    std::int64_t epoch = 0;
    std::int64_t step = 0;           // steps consumed, this one included
    std::vector<rng_event> rng_events;  // draws BASE would have made before this batch
    std::optional<Batch> batch;      // present exactly when status is batch
};

namespace detail {

// An exception of the leader's, as text every rank can read: c10 errors without their
// backtrace, an empty message and exceptions not derived from std::exception named as such.
inline std::string leader_exception_text(std::exception_ptr failure) {
    try {
        std::rethrow_exception(failure);
    } catch (const std::exception& e) {
        std::string text = exception_text(e);
        if (text.empty()) text = "an exception with an empty message";
        return text;
    } catch (...) {
        return "an exception that is not a std::exception";
    }
}

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

}  // namespace detail

// Checks a loader configuration. Called by leader_loader on every rank before any collective,
// so a bad configuration is the same clear error everywhere instead of a rank stuck in a
// collective (the lesson of the reference PR's first review comment).
inline void validate(const loader_config& cfg, int tp_size, int rank) {
    auto bad = [&](const std::string& what) {
        throw error(errc::invalid_argument, "spbcast: rank " + std::to_string(rank) +
                                                ": invalid loader configuration: " + what);
    };
    if (cfg.total_epoch.has_value() == cfg.total_step.has_value())
        bad(std::string("set exactly one of total_epoch and total_step (both are ") +
            (cfg.total_epoch ? "set" : "unset") + ")");
    if (cfg.total_epoch && *cfg.total_epoch <= 0) bad("total_epoch must be positive");
    if (cfg.total_step && *cfg.total_step <= 0) bad("total_step must be positive");
    if (tp_size < 1) bad("the TP size must be at least 1");
    if (cfg.sp_media_dedup && tp_size > 1)
        bad("sp_media_dedup requires TP size 1 (got " + std::to_string(tp_size) +
            "); turn sp_media_dedup off or run with tensor parallelism 1");
    if (cfg.timeout.count() <= 0) bad("timeout must be positive");
    if (cfg.root_wait.count() < 0) bad("root_wait must not be negative");
    if (cfg.root_wait.count() > 0 && cfg.root_wait < cfg.timeout)
        bad("root_wait (" + std::to_string(cfg.root_wait.count()) + " ms) is shorter than timeout (" +
            std::to_string(cfg.timeout.count()) +
            " ms), which the leader's keep-alive frames need; set it to at least timeout, or to 0 "
            "for the SP group's own timeout");
}

template <data_loader Loader, class Group>
class leader_loader {
public:
    using batch_type = loader_batch_t<Loader>;

    // Builds the loader on the ranks that need one: every rank with dedup off or SP size 1,
    // only the SP leader (SP group rank 0) otherwise. `make_loader` returns a
    // std::unique_ptr<Loader>. `group` is the SP group (a c10d group or a pointer to one).
    template <class Factory>
    leader_loader(loader_config cfg, Group group, int tp_size, Factory&& make_loader)
        : cfg_(std::move(cfg)), group_(std::move(group)) {
        detail::check_rng_declaration<Loader>();
        auto& g = detail::group_of(group_);
        sp_rank_ = g.getRank();
        validate(cfg_, tp_size, sp_rank_);
        dedup_ = cfg_.sp_media_dedup && g.getSize() > 1;
        choose_root_wait();
        if (!dedup_) {
            loader_ = make_loader();
            length_ = local_length();
            return;
        }
        loader_init init;
        if (is_leader()) {
            try {
                detail::keep_alive<Group> still_working(group_, broadcast_options());
                loader_ = make_loader();
                if constexpr (detail::declared_rng_draws<Loader>() == rng_draws::events)
                    init.rng_events = loader_->construction_rng_events();
                init.length = local_length();
            } catch (...) {
                init.status = leader_status::failed;
                init.error = detail::leader_exception_text(std::current_exception());
            }
        }
        broadcast_from_leader(init, "the loader's construction");
        if (init.status == leader_status::failed) throw leader_failed("building the data loader", init.error);
        if (init.status != leader_status::batch)
            throw error(errc::corrupt_frame, where() + ": an unknown loader status arrived from the SP leader");
        if (!is_leader())
            for (const rng_event& event : init.rng_events) {
                detail::check_rng_event(event, where());
                replay(event);
            }
        length_ = init.length;
    }

    // The next batch - the same on every rank of the SP group - or nullopt once total_epoch
    // epochs or total_step steps are done. With dedup on, every SP rank must call it in step.
    std::optional<batch_type> next() {
        if (!dedup_) {
            std::vector<rng_event> unused;
            return fetch(unused);
        }
        step_envelope<batch_type> envelope;
        if (is_leader()) {
            try {
                detail::keep_alive<Group> still_working(group_, broadcast_options());
                std::optional<shared_memory_scope> in_shared_memory;
                if (batches_in_shared_memory()) in_shared_memory.emplace();
                envelope.batch = fetch(envelope.rng_events);
                envelope.status = envelope.batch ? leader_status::batch : leader_status::end;
            } catch (...) {
                envelope.batch.reset();
                envelope.status = leader_status::failed;
                envelope.error = detail::leader_exception_text(std::current_exception());
            }
            envelope.epoch = epoch_;
            envelope.step = step_;
        }
        const bool refused = !send_step(envelope);
        if ((envelope.status == leader_status::batch) != envelope.batch.has_value() ||
            (envelope.status != leader_status::batch && envelope.status != leader_status::end &&
             envelope.status != leader_status::failed))
            throw error(errc::corrupt_frame, where() + ": an inconsistent loader status arrived from the SP leader");
        if (!is_leader()) {
            // Before any error is raised: the leader's draws and counters, whatever the step's
            // outcome, so a trainer that catches the error goes on with BASE's generator.
            for (const rng_event& event : envelope.rng_events) {
                detail::check_rng_event(event, where());
                replay(event);
            }
            epoch_ = envelope.epoch;
            step_ = envelope.step;
        }
        if (refused) throw leader_failed("sending step " + std::to_string(envelope.step), envelope.error);
        if (envelope.status == leader_status::failed)
            throw leader_failed("fetching step " + std::to_string(envelope.step + 1), envelope.error);
        return std::move(envelope.batch);
    }

    bool dedup() const { return dedup_; }
    bool is_leader() const { return sp_rank_ == 0; }
    bool has_loader() const { return loader_ != nullptr; }  // false on dedup followers
    std::int64_t epoch() const { return epoch_; }
    std::int64_t step() const { return step_; }
    // Batches per epoch, from the leader's loader when dedup is on (-1: the loader has no size()).
    std::int64_t length() const { return length_; }
    // Steps of the whole run: total_step, or length() * total_epoch (-1 when unknown).
    std::int64_t total_steps() const {
        if (cfg_.total_step) return *cfg_.total_step;
        return length_ < 0 ? -1 : length_ * *cfg_.total_epoch;
    }

    // Checkpoint state: the loop position and the loader's own state. Dedup followers hold no
    // loader and return an empty string; save the leader's (it is the same for the whole SP
    // group) and pass it to load_state on every rank, or nothing to followers.
    std::string save_state() const {
        if (!loader_) return {};
        std::ostringstream out;
        out << "spbcast.leader_loader v1 epoch=" << epoch_ << " step=" << step_
            << " in_epoch=" << in_epoch_ << "\n";
        if constexpr (requires { loader_->save_state(); }) out << loader_->save_state();
        return out.str();
    }

    // Continues exactly where save_state() was called, from the next next(). Dedup followers
    // skip it: they learn the epoch and step from the leader's next envelope.
    void load_state(std::string_view state) {
        if (!loader_) return;
        const auto newline = state.find('\n');
        std::istringstream header(std::string(state.substr(0, newline)));
        std::string magic, version, epoch, step, in_epoch;
        header >> magic >> version >> epoch >> step >> in_epoch;
        if (magic != "spbcast.leader_loader" || version != "v1" || epoch.rfind("epoch=", 0) != 0 ||
            step.rfind("step=", 0) != 0 || in_epoch.rfind("in_epoch=", 0) != 0 ||
            newline == std::string_view::npos)
            throw error(errc::invalid_argument,
                        where() + ": load_state got a state that leader_loader::save_state did not "
                                  "write; pass the string that save_state returned on the SP leader");
        epoch_ = std::stoll(epoch.substr(6));
        step_ = std::stoll(step.substr(5));
        in_epoch_ = std::stoll(in_epoch.substr(9));
        pass_.reset();
        if constexpr (requires { loader_->load_state(state.substr(newline + 1)); })
            loader_->load_state(state.substr(newline + 1));
        // Saved right after an epoch's last batch: the continuous run would end that pass at
        // its next fetch, so the resumed run starts the next epoch.
        if (length_ > 0 && in_epoch_ >= length_) end_epoch();
    }

    Loader* loader() { return loader_.get(); }  // null on dedup followers

private:
    using pass_type = decltype(std::declval<Loader&>().begin());

    options broadcast_options() const {
        return {.root = 0, .timeout = cfg_.timeout, .root_wait = root_wait_, .transport = cfg_.transport,
                .relay_chunk_bytes = cfg_.relay_chunk_bytes};
    }

    // A follower waits for a leader busy outside the loader as long as BASE would: the SP
    // group's own timeout (see loader_config::root_wait).
    void choose_root_wait() {
        if (cfg_.root_wait.count() > 0) {
            root_wait_ = cfg_.root_wait;
            root_wait_source_ = "loader_config::root_wait";
            return;
        }
        const auto own = dist::group_timeout(group_);
        root_wait_ = std::max(cfg_.timeout, own.value_or(cfg_.timeout));
        if (!own)
            root_wait_source_ = "loader_config::timeout; the SP group does not say its own timeout";
        else if (*own > cfg_.timeout)
            root_wait_source_ = "the SP group's own timeout";
        else
            root_wait_source_ = "loader_config::timeout, not below the SP group's own timeout";
    }

    // broadcast(value) from the leader. A follower that waited root_wait for the leader's first
    // message says so in the loader's terms: the leader is hung, or busy outside the loader for
    // longer than the group allows.
    template <class T>
    void broadcast_from_leader(T& value, const std::string& what) {
        try {
            broadcast(value, group_, broadcast_options());
        } catch (const transport_error& e) {
            if (is_leader() || e.code() != errc::timeout || e.phase() != "frame") throw;
            const std::string said = e.what();  // its first line: its advice is about broadcast()
            throw transport_error(
                errc::timeout,
                where() + ": the SP leader (SP rank 0) sent nothing for " + what + " within " +
                    std::to_string(root_wait_.count()) + " ms (" + root_wait_source_ +
                    "). A leader busy outside the loader (saving a checkpoint, evaluating) must be "
                    "back within that time: raise loader_config::root_wait or the SP group's "
                    "timeout; if the leader hangs, restart the job. The transport said: " +
                    said.substr(0, said.find('\n')),
                e.phase());
        }
    }

    // Whether the leader's broadcasts take the same-host path (decided by the first one).
    bool batches_in_shared_memory() {
        if (!cfg_.leader_allocates_in_shared_memory || cfg_.transport == transport_mode::network) return false;
        const auto state = detail::same_host_registry::instance().find(&detail::group_of(group_), 0);
        return state && state->shared;
    }

    // Broadcasts the step's envelope; false when the leader's batch was refused (spbcast cannot
    // send it). The leader then sends the same envelope without the batch, with the refusal as
    // its error, so the step's RNG events, epoch and step still reach every rank. A refused batch
    // counts as a step (the loader produced it): a trainer that skips it goes on at the same step
    // everywhere. A fetch that threw counts on no rank.
    bool send_step(step_envelope<batch_type>& envelope) {
        try {
            broadcast_from_leader(envelope, "the next step");
            return true;
        } catch (const transport_error&) {
            throw;  // the group is out of step: no follow-up can reach the followers
        } catch (const remote_error&) {
            if (is_leader()) throw;  // a follower's: the leader refused its batch; its step follows
        } catch (const error& e) {
            if (!is_leader()) throw;  // this follower's own failure, not the leader's refusal
            envelope.batch.reset();
            envelope.status = leader_status::failed;
            envelope.error = e.what();
        }
        broadcast_from_leader(envelope, "the next step");
        return false;
    }

    std::string where() const {
        return "spbcast: SP rank " + std::to_string(sp_rank_) + " (leader_loader)";
    }

    error leader_failed(const std::string& doing, const std::string& message) const {
        return error(errc::loader, where() + ": the SP leader (SP rank 0) failed " + doing + ": " + message);
    }

    std::int64_t local_length() const {
        if constexpr (requires { loader_->size(); })
            return static_cast<std::int64_t>(loader_->size());
        else
            return -1;
    }

    // The one fetch/epoch loop: next batch of the current pass; at the end of a pass, advance
    // the epoch and start the next pass, recording the RNG draws that creating it makes.
    std::optional<batch_type> fetch(std::vector<rng_event>& events) {
        if (finished_ || (cfg_.total_step && step_ >= *cfg_.total_step)) return finish();
        for (int empty_passes = 0;;) {
            if (!pass_) {
                if constexpr (detail::declared_rng_draws<Loader>() == rng_draws::events) {
                    for (const rng_event& e : loader_->iterator_rng_events()) events.push_back(e);
                } else if constexpr (detail::declared_rng_draws<Loader>() == rng_draws::base_seed) {
                    if (loader_->will_consume_base_seed()) events.push_back({rng_event::base_seed_draw});
                }
                pass_.emplace(loader_->begin());
            }
            if (auto batch = pass_->next()) {
                ++step_;
                ++in_epoch_;
                return batch;
            }
            end_epoch();
            if (cfg_.total_epoch && epoch_ >= *cfg_.total_epoch) return finish();
            if (++empty_passes == 2)
                throw error(errc::loader, where() + ": the data loader yielded no batch for a whole "
                                                    "epoch; check the dataset and the sampler");
        }
    }

    void end_epoch() {
        pass_.reset();
        ++epoch_;
        in_epoch_ = 0;
        if constexpr (requires { loader_->set_epoch(epoch_); }) loader_->set_epoch(epoch_);
    }

    std::optional<batch_type> finish() {
        finished_ = true;
        return std::nullopt;
    }

    loader_config cfg_;
    Group group_;
    std::chrono::milliseconds root_wait_{0};
    const char* root_wait_source_ = "";
    int sp_rank_ = 0;
    bool dedup_ = false;
    bool finished_ = false;
    std::int64_t epoch_ = 0, step_ = 0, length_ = -1;
    std::int64_t in_epoch_ = 0;  // batches taken in the current epoch
    std::unique_ptr<Loader> loader_;
    std::optional<pass_type> pass_;
};

// Deduces the loader type from the factory:
//   auto loader = spbcast::make_leader_loader(cfg, sp_group, 1, [&] { return std::make_unique<MyLoader>(...); });
template <class Group, class Factory>
auto make_leader_loader(loader_config cfg, Group group, int tp_size, Factory&& make_loader) {
    using Loader = typename std::invoke_result_t<Factory&>::element_type;
    return leader_loader<Loader, Group>(std::move(cfg), std::move(group), tp_size,
                                        std::forward<Factory>(make_loader));
}

}  // namespace spbcast
