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
//
// Prefetch (loader_config::prefetch, on by default): while the trainer runs step t, a thread of
// the leader fetches batch t+1 and broadcasts it over a second group of the same ranks (the
// prefetch channel, prefetch_channel.hpp), and a thread of each follower receives it, so next()
// returns at once. Only pass.next() runs on that thread; whatever draws from the default CPU
// generator (the factory, begin(), set_epoch) stays on the trainer's thread at the step where the
// synchronous loop runs it, so batches, counters and generators are those of the synchronous loop.
//
// The class below is the story of one step; its parts live in detail/loader/ (README.md there):
// the passes, the position and resume, the step exchange, prefetch, patience and the stats.
#pragma once

#include "broadcast.hpp"
#include "detail/loader/passes.hpp"
#include "detail/loader/patience.hpp"
#include "detail/loader/prefetch.hpp"
#include "detail/loader/resume.hpp"
#include "detail/loader/stats.hpp"
#include "detail/loader/step_exchange.hpp"
#include "dist.hpp"
#include "error.hpp"
#include "prefetch_channel.hpp"
#include "rng_mirror.hpp"
#include "shared_memory.hpp"

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
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
    // How long a step's first message may wait (options::root_wait): a follower for a leader
    // late outside the loader - saving a checkpoint, evaluating - where no keep-alive runs, and
    // the leader for followers late the same way. Zero: the SP group's own timeout (what
    // ProcessGroupGloo::Options or init_process_group was given; spbcast::dist::group_timeout),
    // exactly as long as a BASE rank waits in its next collective on the group, shorter or
    // longer than `timeout` - or `timeout` where the group does not say (a transport of your
    // own). spbcast's own wait ends at most 2 s after it (collective.hpp's wait_grace). The
    // leader's keep-alive frames come every quarter of the shorter of this and `timeout`. A
    // dead peer is seen at once whatever this is (its sockets close). With LibTorch 1.13's Gloo
    // no wait outlasts the group's own timeout: raise that one there.
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
    // Batches the SP leader fetches and broadcasts ahead of the trainer, while the trainer runs
    // its step (each rank then holds at most this many batches beyond the one it trains on).
    // 0: synchronous, every next() fetches and broadcasts. The SP leader's value counts.
    std::size_t prefetch = 1;
    // The group the prefetch broadcasts over: a second Gloo group over the SP group's ranks, used
    // by nothing else (docs/loader.md shows how to make one). Null: leader_loader makes one from
    // the SP group's own store where the SP group is a ProcessGroupGloo held by an intrusive_ptr
    // (prefetch_channel.hpp); elsewhere it loads synchronously and prefetch_reason() says why.
    c10::intrusive_ptr<c10d::ProcessGroupGloo> prefetch_channel;
};

template <class L>
concept data_loader = requires(L& loader) {
    { loader.begin().next() } -> detail::optional_like;
};

template <data_loader L>
using loader_batch_t = typename decltype(std::declval<L&>().begin().next())::value_type;

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
    if (cfg.prefetch > 64) bad("prefetch (" + std::to_string(cfg.prefetch) + ") must be at most 64; 1 or 2 hide a step's data time");
}

template <data_loader Loader, class Group>
class leader_loader {
public:
    using batch_type = loader_batch_t<Loader>;

    // Builds the loader on the ranks that need one: every rank with dedup off or SP size 1,
    // only the SP leader (SP group rank 0) otherwise. `make_loader` returns a
    // std::unique_ptr<Loader>. `group` is the SP group (a c10d group or a pointer to one).
    // With prefetch, every SP rank also joins the prefetch channel here (a collective).
    template <class Factory>
    leader_loader(loader_config cfg, Group group, int tp_size, Factory&& make_loader)
        : group_(std::move(group)),
          sp_rank_(validated_rank(cfg, tp_size)),
          dedup_(cfg.sp_media_dedup && detail::group_of(group_).getSize() > 1),
          patience_(group_,
                    {.root = 0, .timeout = cfg.timeout, .transport = cfg.transport,
                     .relay_chunk_bytes = cfg.relay_chunk_bytes},
                    cfg.root_wait, where(), is_leader()),
          exchange_(patience_, where(), is_leader(),
                    cfg.leader_allocates_in_shared_memory && cfg.transport != transport_mode::network),
          passes_(cfg.total_epoch, cfg.total_step, where()),
          stats_(is_leader(), cfg.transport),
          prefetch_(cfg.prefetch, cfg.prefetch_channel, where(), is_leader()) {
        if (!dedup_) {
            prefetch_.off("sp_media_dedup is off or the SP group has one rank: every rank runs its own loader");
            passes_.build(make_loader);
            return;
        }
        prefetch_.check_own_channel(group_);
        loader_init init;
        if (is_leader()) {
            prefetch_.choose(group_, init);
            exchange_.build_on_leader(group_, init, [&] {
                passes_.build(make_loader);
                init.rng_events = passes_.construction_draws();
                init.length = passes_.length();
            });
        }
        exchange_.share_construction(group_, init);
        if (!is_leader()) passes_.replay_leader_draws(init.rng_events);
        passes_.take_leaders_length(init.length);
        prefetch_.open(group_, init, passes_, exchange_);
    }

    // It owns a thread that refers to it: construct it in place (make_leader_loader's result is).
    leader_loader(const leader_loader&) = delete;
    leader_loader& operator=(const leader_loader&) = delete;

    // Stops the prefetch thread and joins it. The leader's thread finishes the fetch in progress
    // and, where the followers expect a prefetched envelope, sends a stop envelope (a broadcast:
    // bounded by loader_config::timeout where followers stopped receiving); a follower's thread
    // receives until that envelope (or any the leader sends that ends prefetching), each wait
    // bounded by root_wait. When every SP rank destroys its loader - the loop ended, or a
    // trainer that raised everywhere - that is at once.
    ~leader_loader() { prefetch_.stop(); }

    // The next batch - the same on every rank of the SP group - or nullopt once total_epoch
    // epochs or total_step steps are done. With dedup on, every SP rank must call it in step.
    // An error of the leader's (its loader threw, its batch could not be sent) is raised here at
    // the step it belongs to, on every SP rank, whether the batch was prefetched or not.
    std::optional<batch_type> next() {
        const auto started = detail::loader_clock::now();
        const auto waited = stats_.time_wait(started);
        if (!dedup_) {
            std::vector<rng_event> unused;
            auto batch = passes_.fetch(position_, unused);
            stats_.add_own_loader_time(detail::seconds_since(started));
            stats_.count_batch(batch);
            return batch;
        }
        bool pass_ended = false;
        if (prefetch_.depth() > 0) {
            if (auto item = prefetch_.take()) {
                if (item->envelope.status != leader_status::pass_end) return consume(std::move(*item));
                // The thread met the end of the pass: this step goes on here, as the synchronous
                // loop's does (set_epoch and begin() on this thread, then the first fetch).
                stats_.add_step_times(item->broadcast_seconds, item->envelope.loader_seconds);
                pass_ended = true;
            }
        }
        return step_synchronously(pass_ended);
    }

    bool dedup() const { return dedup_; }
    bool is_leader() const { return sp_rank_ == 0; }
    bool has_loader() const { return passes_.has_loader(); }  // false on dedup followers
    // Steps and epochs consumed: those of the batch next() returned last, not of one prefetched.
    std::int64_t epoch() const { return position_.epoch(); }
    std::int64_t step() const { return position_.step(); }
    // Batches per epoch, from the leader's loader when dedup is on (-1: the loader has no size()).
    std::int64_t length() const { return passes_.length(); }
    // Steps of the whole run: total_step, or length() * total_epoch (-1 when unknown).
    std::int64_t total_steps() const { return passes_.total_steps(); }
    // The prefetch depth in use (the leader's loader_config::prefetch), and why it is 0 when it is.
    std::size_t prefetch_depth() const { return prefetch_.depth(); }
    const std::string& prefetch_reason() const { return prefetch_.reason(); }

    loader_stats stats() const { return stats_.summary(batch_carrier(), prefetch_.depth(), prefetch_.reason()); }

    // Checkpoint state: the loop position and the loader's own state, as of the last batch
    // next() returned - a batch already prefetched is not in it, so a resumed run fetches it
    // again. Dedup followers hold no loader and return an empty string; save the leader's (it is
    // the same for the whole SP group) and pass it to load_state on every rank, or nothing to
    // followers.
    std::string save_state() const {
        if (!passes_.has_loader()) return {};
        if constexpr (requires { passes_.loader_state(); })
            return position_.save(prefetch_.consumed_loader_state(passes_));
        else
            return position_.save({});
    }

    // Continues exactly where save_state() was called, from the next next(). First drops what was
    // prefetched, on every rank alike: called mid-run (after next()), it must be called on every
    // SP rank; right after construction followers may skip it (nothing is prefetched yet). Dedup
    // followers otherwise ignore the state: they learn the epoch and step from the leader.
    void load_state(std::string_view state) {
        prefetch_.drop();
        if (!passes_.has_loader()) return;
        std::string_view loader_state;
        position_ = detail::loader_position::load(state, loader_state, where());
        passes_.restore(loader_state);
        if (position_.saved_at_epoch_end(passes_.length())) passes_.end_epoch(position_);
    }

    // Null on dedup followers. While a prefetch is in flight the leader's thread uses it: touch
    // it between next() calls only when prefetch_depth() is 0.
    Loader* loader() { return passes_.loader(); }

private:
    using prefetched = typename detail::loader_prefetch<Loader>::prefetched;

    // Checks the configuration on every rank before any collective, so a bad one is the same
    // clear error everywhere instead of a rank stuck in a collective.
    int validated_rank(const loader_config& cfg, int tp_size) {
        const int rank = detail::group_of(group_).getRank();
        validate(cfg, tp_size, rank);
        return rank;
    }

    std::string where() const { return "spbcast: SP rank " + std::to_string(sp_rank_) + " (leader_loader)"; }

    // What the batches travel over: the prefetch channel when prefetching, else the SP group;
    // nothing with dedup off.
    const void* batch_carrier() const {
        if (!dedup_) return nullptr;
        if (const void* channel = prefetch_.channel()) return channel;
        return &detail::group_of(const_cast<Group&>(group_));
    }

    // ---- One step -----------------------------------------------------------------------------

    // The synchronous step, over the SP group: fetch on the leader, one envelope to every rank.
    // `pass_ended`: the prefetch thread met the end of the pass, so it is not asked again.
    std::optional<batch_type> step_synchronously(bool pass_ended) {
        step_envelope<batch_type> envelope;
        if (is_leader()) {
            exchange_.fetch_on_leader(group_, envelope, leader_status::end, [&] {
                return passes_.fetch(position_, envelope.rng_events, pass_ended);
            });
            envelope.epoch = position_.epoch();
            envelope.step = position_.step();
            envelope.next_prefetched = prefetch_.depth() > 0 && envelope.status == leader_status::batch &&
                                       !passes_.step_limit_reached(position_.step());
        }
        const auto started = detail::loader_clock::now();
        const bool refused = !exchange_.send_step(group_, envelope);
        stats_.add_step_times(detail::seconds_since(started), envelope.loader_seconds);
        auto batch = finish_step(envelope, refused, /*synchronous=*/true);
        stats_.count_batch(batch);
        return batch;
    }

    // A prefetched step, taken on the trainer's thread as the synchronous loop takes its own.
    std::optional<batch_type> consume(prefetched item) {
        stats_.add_step_times(item.broadcast_seconds, item.envelope.loader_seconds);
        if (item.failure) std::rethrow_exception(item.failure);
        exchange_.check_not_a_marker(item.envelope);
        if (is_leader()) position_ = item.ahead;
        auto batch = finish_step(item.envelope, item.refused, /*synchronous=*/false);
        if (item.hit) stats_.count_prefetch_hit();
        stats_.count_batch(batch, item.bytes);
        return batch;
    }

    // What every step ends with, prefetched or not: the follower takes the leader's draws and
    // counters, a synchronous step that says so lets the thread go on, then the leader's failure
    // is raised on every rank.
    std::optional<batch_type> finish_step(step_envelope<batch_type>& envelope, bool refused, bool synchronous) {
        exchange_.check_status(envelope);
        if (!is_leader()) passes_.replay_leader_draws(envelope.rng_events);
        position_.take_leaders(envelope.epoch, envelope.step);
        if (synchronous && envelope.next_prefetched) prefetch_.resume(position_);
        exchange_.raise_failure(envelope, refused);
        return std::move(envelope.batch);
    }

    // Declared in the order they are built; prefetch_ last, so its thread, which uses passes_ and
    // exchange_, is joined before they go.
    Group group_;
    int sp_rank_ = 0;
    bool dedup_ = false;
    detail::loader_patience patience_;
    detail::step_exchange exchange_;  // speaks through patience_
    detail::loader_position position_;  // of the last batch next() returned
    detail::loader_passes<Loader> passes_;
    detail::loader_counts stats_;       // the trainer's thread's
    detail::loader_prefetch<Loader> prefetch_;
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
