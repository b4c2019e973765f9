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
#pragma once

#include "broadcast.hpp"
#include "detail/orchestration/keep_alive.hpp"
#include "detail/wire/send_plan.hpp"
#include "detail/wire/value_codec.hpp"
#include "dist.hpp"
#include "error.hpp"
#include "prefetch_channel.hpp"
#include "rng_mirror.hpp"
#include "shared_memory.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <unordered_set>
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

// What the loop did on this rank so far, as the Python LeaderLoader.stats() reports it.
struct loader_stats {
    std::string path;                   // same_host, hierarchical, network; local: dedup off
    std::int64_t steps = 0;             // batches returned
    std::uint64_t bytes = 0;            // their tensors' distinct storage bytes
    double loader_seconds = 0;          // the leader (or a rank without dedup): in its loader
    double leader_loader_seconds = 0;   // a follower: the leader's loader time for the same steps
    double broadcast_seconds = 0;       // in the steps' broadcasts (a follower's include waiting
                                        // for the leader's loader)
    double wait_seconds = 0;            // in next(): what the trainer waited
    std::int64_t prefetch_hits = 0;     // steps whose batch was already here when next() was called
    std::size_t prefetch = 0;           // the prefetch depth in use
    std::string prefetch_reason;        // why it is 0, when it is
};

template <class L>
concept data_loader = requires(L& loader) {
    { loader.begin().next() } -> detail::optional_like;
};

template <data_loader L>
using loader_batch_t = typename decltype(std::declval<L&>().begin().next())::value_type;

// What the leader's loader did, on the wire: never inferred from an empty message or an
// absent batch, so no failure can pass for the end of the data.
// pass_end, dropped and stopped come from the prefetch thread only: the pass ended (this step
// goes on synchronously), the leader's load_state dropped what was prefetched, the leader's
// leader_loader was destroyed.
enum class leader_status : std::uint8_t { batch = 1, end = 2, failed = 3, pass_end = 4, dropped = 5, stopped = 6 };

// What the leader sends once, when the loader has been built (status batch or failed).
struct loader_init {
    leader_status status = leader_status::batch;
    std::string error;               // the factory's exception, when it failed
    std::vector<rng_event> rng_events;
    std::int64_t length = -1;        // batches per epoch; -1 when the loader has no size()
    std::uint64_t prefetch = 0;      // the prefetch depth, the leader's choice
    std::string channel_key;         // the store prefix of the channel leader_loader makes; empty:
                                     // every rank has its loader_config::prefetch_channel
    std::string prefetch_reason;     // why prefetch is 0, when it is
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
    bool next_prefetched = false;    // the next step's envelope comes over the prefetch channel
    double loader_seconds = 0;       // the leader's time in its loader for this step
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

// The distinct storage bytes of a batch's tensors (what the stats report).
template <class T>
std::uint64_t storage_bytes(const T& value) {
    try {
        const limits unbounded{~std::size_t{0}, ~std::size_t{0}, ~std::size_t{0}, ~std::uint64_t{0},
                               ~std::size_t{0}, ~std::size_t{0}, 4096};
        send_plan plan;
        byte_writer out;
        encoder enc(out, plan, unbounded);
        enc.value(value);
        std::unordered_set<const void*> seen;
        std::uint64_t total = 0;
        for (const at::Tensor& t : plan.tensors())
            if (t.has_storage() && seen.insert(t.storage().unsafeGetStorageImpl()).second)
                total += t.storage().nbytes();
        return total;
    } catch (const std::exception&) {
        return 0;  // only counting: a batch that cannot be sent fails elsewhere
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
        : cfg_(std::move(cfg)), group_(std::move(group)) {
        detail::check_rng_declaration<Loader>();
        auto& g = detail::group_of(group_);
        sp_rank_ = g.getRank();
        validate(cfg_, tp_size, sp_rank_);
        dedup_ = cfg_.sp_media_dedup && g.getSize() > 1;
        choose_root_wait();
        if (!dedup_) {
            prefetch_reason_ = "sp_media_dedup is off or the SP group has one rank: every rank runs its own loader";
            loader_ = make_loader();
            length_ = local_length();
            return;
        }
        check_own_channel();
        loader_init init;
        if (is_leader()) {
            choose_prefetch(init);
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
        broadcast_from_leader(group_, init, "the loader's construction");
        if (init.status == leader_status::failed) throw leader_failed("building the data loader", init.error);
        if (init.status != leader_status::batch)
            throw error(errc::corrupt_frame, where() + ": an unknown loader status arrived from the SP leader");
        if (!is_leader())
            for (const rng_event& event : init.rng_events) {
                detail::check_rng_event(event, where());
                replay(event);
            }
        length_ = init.length;
        prefetch_reason_ = init.prefetch_reason;
        open_prefetch(init);
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
    ~leader_loader() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        changed_.notify_all();
        thread_.join();
    }

    // The next batch - the same on every rank of the SP group - or nullopt once total_epoch
    // epochs or total_step steps are done. With dedup on, every SP rank must call it in step.
    // An error of the leader's (its loader threw, its batch could not be sent) is raised here at
    // the step it belongs to, on every SP rank, whether the batch was prefetched or not.
    std::optional<batch_type> next() {
        const auto started = clock::now();
        struct count_wait {
            loader_stats& stats;
            clock::time_point started;
            ~count_wait() { stats.wait_seconds += seconds_since(started); }
        } waited{stats_, started};
        if (!dedup_) {
            std::vector<rng_event> unused;
            auto batch = fetch(unused);
            stats_.loader_seconds += seconds_since(started);
            count_batch(batch, batch ? detail::storage_bytes(*batch) : 0);
            return batch;
        }
        bool pass_ended = false;
        if (depth_ > 0) {
            if (auto item = take_prefetched()) {
                if (item->envelope.status != leader_status::pass_end) return consume(std::move(*item));
                // The thread met the end of the pass: this step goes on here, as the synchronous
                // loop's does (set_epoch and begin() on this thread, then the first fetch).
                add_times(*item);
                pass_ended = true;
            }
        }
        return step_synchronously(pass_ended);
    }

    bool dedup() const { return dedup_; }
    bool is_leader() const { return sp_rank_ == 0; }
    bool has_loader() const { return loader_ != nullptr; }  // false on dedup followers
    // Steps and epochs consumed: those of the batch next() returned last, not of one prefetched.
    std::int64_t epoch() const { return epoch_; }
    std::int64_t step() const { return step_; }
    // Batches per epoch, from the leader's loader when dedup is on (-1: the loader has no size()).
    std::int64_t length() const { return length_; }
    // Steps of the whole run: total_step, or length() * total_epoch (-1 when unknown).
    std::int64_t total_steps() const {
        if (cfg_.total_step) return *cfg_.total_step;
        return length_ < 0 ? -1 : length_ * *cfg_.total_epoch;
    }
    // The prefetch depth in use (the leader's loader_config::prefetch), and why it is 0 when it is.
    std::size_t prefetch_depth() const { return depth_; }
    const std::string& prefetch_reason() const { return prefetch_reason_; }

    loader_stats stats() const {
        loader_stats s = stats_;
        s.path = path();
        s.prefetch = depth_;
        s.prefetch_reason = prefetch_reason_;
        return s;
    }

    // Checkpoint state: the loop position and the loader's own state, as of the last batch
    // next() returned - a batch already prefetched is not in it, so a resumed run fetches it
    // again. Dedup followers hold no loader and return an empty string; save the leader's (it is
    // the same for the whole SP group) and pass it to load_state on every rank, or nothing to
    // followers.
    std::string save_state() const {
        if (!loader_) return {};
        std::ostringstream out;
        out << "spbcast.leader_loader v1 epoch=" << epoch_ << " step=" << step_
            << " in_epoch=" << in_epoch_ << "\n";
        if constexpr (requires { loader_->save_state(); }) out << consumed_loader_state();
        return out.str();
    }

    // Continues exactly where save_state() was called, from the next next(). First drops what was
    // prefetched, on every rank alike: called mid-run (after next()), it must be called on every
    // SP rank; right after construction followers may skip it (nothing is prefetched yet). Dedup
    // followers otherwise ignore the state: they learn the epoch and step from the leader.
    void load_state(std::string_view state) {
        drop_prefetched();
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

    // Null on dedup followers. While a prefetch is in flight the leader's thread uses it: touch
    // it between next() calls only when prefetch_depth() is 0.
    Loader* loader() { return loader_.get(); }

private:
    using clock = std::chrono::steady_clock;
    using pass_type = decltype(std::declval<Loader&>().begin());
    using channel_type = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

    // One envelope that went over the prefetch channel, with what this rank learnt sending or
    // receiving it.
    struct prefetched {
        step_envelope<batch_type> envelope;
        bool refused = false;          // the leader's batch could not be sent (the envelope says why)
        std::exception_ptr failure;    // this rank's own failure sending or receiving it
        std::string loader_state;      // the leader: its loader's state right before this fetch
        std::int64_t in_epoch = 0;     // the leader: batches of the epoch, this one included
        std::uint64_t bytes = 0;
        double broadcast_seconds = 0;
        bool hit = false;              // it was here when next() was called
    };

    static double seconds_since(clock::time_point start) {
        return std::chrono::duration<double>(clock::now() - start).count();
    }

    options broadcast_options() const {
        return {.root = 0, .timeout = cfg_.timeout, .root_wait = root_wait_, .transport = cfg_.transport,
                .relay_chunk_bytes = cfg_.relay_chunk_bytes};
    }

    // A rank waits for a peer busy outside the loader as long as BASE would: the SP group's own
    // timeout (see loader_config::root_wait).
    void choose_root_wait() {
        if (cfg_.root_wait.count() > 0) {
            root_wait_ = cfg_.root_wait;
            root_wait_source_ = "loader_config::root_wait";
            return;
        }
        const auto own = dist::group_timeout(group_);
        root_wait_ = own.value_or(cfg_.timeout);
        root_wait_source_ = own ? "the SP group's own timeout"
                                : "loader_config::timeout; the SP group does not say its own timeout";
    }

    // ---- The prefetch channel -------------------------------------------------------------

    // A channel of the user's must be a second group over the same ranks: checked on every rank
    // before any collective.
    void check_own_channel() {
        if (!cfg_.prefetch_channel) return;
        auto& g = detail::group_of(group_);
        const auto& channel = cfg_.prefetch_channel;
        if (channel->getSize() != g.getSize() || channel->getRank() != g.getRank())
            throw error(errc::invalid_argument,
                        where() + ": loader_config::prefetch_channel has rank " + std::to_string(channel->getRank()) +
                            " of " + std::to_string(channel->getSize()) + ", the SP group rank " +
                            std::to_string(g.getRank()) + " of " + std::to_string(g.getSize()) +
                            "; make it over the SP group's ranks, in the same order");
        if (detail::gloo_behind(group_).first.get() == channel.get())
            throw error(errc::invalid_argument,
                        where() + ": loader_config::prefetch_channel is the SP group itself; it must be a "
                                  "second group over the same ranks, used by nothing else");
    }

    // The leader chooses the depth and the channel for every rank (it sends both in loader_init).
    void choose_prefetch(loader_init& init) {
        if (cfg_.prefetch == 0) {
            init.prefetch_reason = "loader_config::prefetch is 0 on the SP leader";
            return;
        }
        if (!cfg_.prefetch_channel) {
            auto [gloo, why_not] = detail::gloo_behind(group_);
            if (!gloo) {
                init.prefetch_reason = why_not;
                return;
            }
            std::random_device entropy;
            std::ostringstream key;
            key << "spbcast/prefetch/" << std::hex << entropy() << entropy() << "/";
            init.channel_key = key.str();
        }
        init.prefetch = cfg_.prefetch;
    }

    void open_prefetch(const loader_init& init) {
        depth_ = static_cast<std::size_t>(init.prefetch);
        if (depth_ == 0) return;
        if (init.channel_key.empty()) {
            if (!cfg_.prefetch_channel)
                throw error(errc::invalid_argument,
                            where() + ": the SP leader prefetches over its loader_config::prefetch_channel, "
                                      "but this rank has none; set it on every SP rank");
            channel_ = cfg_.prefetch_channel;
        } else {
            auto [gloo, why_not] = detail::gloo_behind(group_);
            if (!gloo)
                throw error(errc::invalid_argument, where() + ": the SP leader made a prefetch channel from "
                                                              "the SP group's store, but on this rank " + why_not);
            channel_ = make_prefetch_channel(gloo, init.channel_key);
        }
        thread_ = std::thread([this] { is_leader() ? lead() : follow(); });
    }

    // ---- The prefetch thread ----------------------------------------------------------------
    //
    // Invariants, kept here:
    // - The thread alone issues collectives on channel_ (broadcasts, and keep-alive frames while
    //   it fetches); the trainer's thread never does. The trainer's thread alone uses group_.
    // - The leader's thread calls pass_->next() and nothing else of the loader's, only while
    //   running_ (and loader_->save_state() under mutex_, right before each fetch). The trainer's
    //   thread creates and ends passes, calls set_epoch and load_state only while running_ is
    //   false and nothing is in ready_: every draw from the default generator stays on it.
    // - running_ says whether the next envelope goes over the channel. The leader's thread clears
    //   it when it sends an envelope with next_prefetched false; a follower's when it receives one;
    //   the trainer's thread sets it after a synchronous step whose envelope says
    //   next_prefetched. So a step is synchronous, over group_, exactly when on every rank
    //   nothing is prefetched and the thread is paused.
    // - mutex_ guards the hand-off only: neither thread holds it across a collective, a fetch or
    //   a wait on the other ranks (only across the loader's save_state(), which must not fork),
    //   so a fork (a loader's workers) finds it free, and a forked child never takes it (it runs
    //   the loader's code, not ours).
    // - ahead_ is the thread's fetch position; the trainer's thread sets it only while paused.

    struct position {
        std::int64_t epoch = 0, step = 0, in_epoch = 0;
    };

    void lead() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            changed_.wait(lock, [&] { return running_ ? stop_ || drop_ || ready_.size() < depth_ : stop_ || drop_; });
            if (!running_) {  // the followers expect nothing more over the channel
                if (stop_) return;
                drop_ = false;
                changed_.notify_all();
                continue;
            }
            prefetched item;
            const bool marker = stop_ || drop_;
            if (marker) {
                item.envelope.status = stop_ ? leader_status::stopped : leader_status::dropped;
            } else {
                if constexpr (requires { loader_->save_state(); }) fetch_state_ = loader_->save_state();
                fetching_ = true;
            }
            lock.unlock();
            if (!marker) fetch_ahead(item);
            send_ahead(item);
            lock.lock();
            fetching_ = false;
            item.loader_state = std::move(fetch_state_);
            if (!item.envelope.next_prefetched) running_ = false;
            if (marker)
                drop_ = false;
            else
                ready_.push_back(std::move(item));
            changed_.notify_all();
        }
    }

    // pass_->next() on the thread, as fetch() does it on the trainer's.
    void fetch_ahead(prefetched& item) {
        auto& envelope = item.envelope;
        const auto started = clock::now();
        try {
            detail::keep_alive<channel_type> still_working(channel_, broadcast_options());
            std::optional<shared_memory_scope> in_shared_memory;
            if (batches_in_shared_memory(channel_)) in_shared_memory.emplace();
            if (pass_) envelope.batch = pass_->next();
            envelope.status = envelope.batch ? leader_status::batch : leader_status::pass_end;
        } catch (...) {
            envelope.batch.reset();
            envelope.status = leader_status::failed;
            envelope.error = detail::leader_exception_text(std::current_exception());
        }
        envelope.loader_seconds = seconds_since(started);
        if (envelope.status == leader_status::batch) {
            ++ahead_.step;
            ++ahead_.in_epoch;
        }
        envelope.epoch = ahead_.epoch;
        envelope.step = ahead_.step;
        item.in_epoch = ahead_.in_epoch;
        envelope.next_prefetched = envelope.status == leader_status::batch && !step_limit_reached(ahead_.step);
    }

    // The leader's send over the channel; every failure is kept in the item for its step.
    void send_ahead(prefetched& item) {
        const auto started = clock::now();
        try {
            item.refused = !send_step(channel_, item.envelope);
            if (item.envelope.batch && !item.refused) item.bytes = detail::storage_bytes(*item.envelope.batch);
        } catch (...) {
            item.failure = std::current_exception();
            item.envelope.next_prefetched = false;  // the channel is out of step: no more over it
        }
        item.broadcast_seconds = seconds_since(started);
    }

    void follow() {
        std::unique_lock<std::mutex> lock(mutex_);
        for (;;) {
            changed_.wait(lock, [&] { return running_ ? stop_ || drain_ || ready_.size() < depth_ : stop_; });
            if (!running_) return;  // stopping, and the leader sends nothing more over the channel
            lock.unlock();
            prefetched item = receive_ahead();
            lock.lock();
            if (!item.envelope.next_prefetched) running_ = false;
            if (!stop_ && !drain_) ready_.push_back(std::move(item));  // else dropped
            changed_.notify_all();
        }
    }

    prefetched receive_ahead() {
        prefetched item;
        const auto started = clock::now();
        try {
            item.refused = !send_step(channel_, item.envelope);
            if (item.envelope.batch) item.bytes = detail::storage_bytes(*item.envelope.batch);
            received_step_ = item.envelope.step;
        } catch (const transport_error&) {
            item.failure = std::current_exception();
            item.envelope.next_prefetched = false;  // the channel is out of step: no more over it
        } catch (...) {
            // This rank's own failure decoding a batch the leader sent (its frame was drained, the
            // channel is in step): the leader goes on prefetching unless that batch was its last.
            item.failure = std::current_exception();
            item.envelope.next_prefetched = !step_limit_reached(++received_step_);
        }
        item.broadcast_seconds = seconds_since(started);
        return item;
    }

    // The next item over the channel, waited for; nullopt when the next step is synchronous.
    std::optional<prefetched> take_prefetched() {
        std::unique_lock<std::mutex> lock(mutex_);
        const bool hit = !ready_.empty();
        changed_.wait(lock, [&] { return !ready_.empty() || !running_; });
        if (ready_.empty()) return std::nullopt;
        prefetched item = std::move(ready_.front());
        ready_.pop_front();
        item.hit = hit;
        lock.unlock();
        changed_.notify_all();  // room for the next
        return item;
    }

    // Lets the thread fetch or receive the next steps, after a synchronous step.
    void resume_prefetch() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ahead_ = {epoch_, step_, in_epoch_};
            received_step_ = step_;
            running_ = true;
        }
        changed_.notify_all();
    }

    // load_state: the leader's thread ends the stream with a dropped envelope (unless its last one
    // already ended it), each follower's thread receives up to that envelope, and all of it is
    // dropped: the next step is synchronous on every rank.
    void drop_prefetched() {
        if (depth_ == 0) return;
        std::unique_lock<std::mutex> lock(mutex_);
        bool& ask = is_leader() ? drop_ : drain_;
        if (running_) {
            ask = true;
            changed_.notify_all();
            changed_.wait(lock, [&] { return !running_; });
        }
        drain_ = false;
        ready_.clear();
    }

    // The leader's loader state as of the last batch next() returned.
    std::string consumed_loader_state() const
        requires requires(const Loader& l) { l.save_state(); }
    {
        if (depth_ == 0) return loader_->save_state();
        std::lock_guard<std::mutex> lock(mutex_);
        if (!ready_.empty()) return ready_.front().loader_state;
        if (fetching_) return fetch_state_;
        return loader_->save_state();  // the thread is idle, and starts no fetch while we hold mutex_
    }

    // ---- One step -----------------------------------------------------------------------------

    // A prefetched step, taken on the trainer's thread as the synchronous loop takes its own.
    std::optional<batch_type> consume(prefetched item) {
        add_times(item);
        if (item.failure) std::rethrow_exception(item.failure);
        auto& envelope = item.envelope;
        if (envelope.status == leader_status::stopped)
            throw error(errc::loader, where() + ": the SP leader's leader_loader was destroyed (its loop "
                                                "ended or its trainer raised) while this rank still calls "
                                                "next(); every SP rank must leave the loop together");
        if (envelope.status == leader_status::dropped)
            throw error(errc::invalid_argument,
                        where() + ": the SP leader called load_state after next() and this rank did not; "
                                  "call load_state on every SP rank (followers with an empty string)");
        if (is_leader()) in_epoch_ = item.in_epoch;
        auto batch = finish_step(envelope, item.refused, /*synchronous=*/false);
        if (item.hit) ++stats_.prefetch_hits;
        count_batch(batch, item.bytes);
        return batch;
    }

    void add_times(const prefetched& item) {
        stats_.broadcast_seconds += item.broadcast_seconds;
        (is_leader() ? stats_.loader_seconds : stats_.leader_loader_seconds) += item.envelope.loader_seconds;
    }

    void count_batch(const std::optional<batch_type>& batch, std::uint64_t bytes) {
        if (!batch) return;
        ++stats_.steps;
        stats_.bytes += bytes;
    }

    // The synchronous step, over the SP group: fetch on the leader, one envelope to every rank.
    // `pass_ended`: the prefetch thread met the end of the pass, so it is not asked again.
    std::optional<batch_type> step_synchronously(bool pass_ended) {
        step_envelope<batch_type> envelope;
        if (is_leader()) {
            const auto started = clock::now();
            try {
                detail::keep_alive<Group> still_working(group_, broadcast_options());
                std::optional<shared_memory_scope> in_shared_memory;
                if (batches_in_shared_memory(group_)) in_shared_memory.emplace();
                envelope.batch = fetch(envelope.rng_events, pass_ended);
                envelope.status = envelope.batch ? leader_status::batch : leader_status::end;
            } catch (...) {
                envelope.batch.reset();
                envelope.status = leader_status::failed;
                envelope.error = detail::leader_exception_text(std::current_exception());
            }
            envelope.loader_seconds = seconds_since(started);
            envelope.epoch = epoch_;
            envelope.step = step_;
            envelope.next_prefetched =
                depth_ > 0 && envelope.status == leader_status::batch && !step_limit_reached(step_);
        }
        const auto started = clock::now();
        const bool refused = !send_step(group_, envelope);
        stats_.broadcast_seconds += seconds_since(started);
        (is_leader() ? stats_.loader_seconds : stats_.leader_loader_seconds) += envelope.loader_seconds;
        auto batch = finish_step(envelope, refused, /*synchronous=*/true);
        count_batch(batch, batch ? detail::storage_bytes(*batch) : 0);
        return batch;
    }

    // What every step ends with, prefetched or not: the follower takes the leader's draws and
    // counters, a synchronous step that says so lets the thread go on, then the leader's failure
    // is raised on every rank.
    std::optional<batch_type> finish_step(step_envelope<batch_type>& envelope, bool refused, bool synchronous) {
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
        }
        epoch_ = envelope.epoch;
        step_ = envelope.step;
        if (synchronous && envelope.next_prefetched) resume_prefetch();
        if (refused) throw leader_failed("sending step " + std::to_string(envelope.step), envelope.error);
        if (envelope.status == leader_status::failed)
            throw leader_failed("fetching step " + std::to_string(envelope.step + 1), envelope.error);
        return std::move(envelope.batch);
    }

    bool step_limit_reached(std::int64_t step) const { return cfg_.total_step && step >= *cfg_.total_step; }

    // broadcast(value) from the leader. A follower that waited root_wait for the leader's first
    // message says so in the loader's terms: the leader is hung, or busy outside the loader for
    // longer than the group allows.
    template <class G, class T>
    void broadcast_from_leader(G& group, T& value, const std::string& what) {
        try {
            broadcast(value, group, broadcast_options());
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

    // Whether the leader's broadcasts on `group` take the same-host path (decided by the first one).
    template <class G>
    bool batches_in_shared_memory(G& group) const {
        if (!cfg_.leader_allocates_in_shared_memory || cfg_.transport == transport_mode::network) return false;
        const auto state = detail::same_host_registry::instance().find(&detail::group_of(group), 0);
        return state && state->shared;
    }

    // How the batches travel: over the channel when prefetching, else over the SP group.
    std::string path() const {
        if (!dedup_) return "local";
        if (cfg_.transport == transport_mode::network) return "network";
        const void* carrier = channel_ ? static_cast<const void*>(channel_.get())
                                       : static_cast<const void*>(&detail::group_of(const_cast<Group&>(group_)));
        const auto state = detail::same_host_registry::instance().find(carrier, 0);
        if (!state || !state->shared) return "network";
        return state->relays() ? "hierarchical" : "same_host";
    }

    // Broadcasts the step's envelope on `group`; false when the leader's batch was refused
    // (spbcast cannot send it). The leader then sends the same envelope without the batch, with
    // the refusal as its error, so the step's RNG events, epoch and step still reach every rank. A
    // refused batch counts as a step (the loader produced it): a trainer that skips it goes on at
    // the same step everywhere. A fetch that threw counts on no rank.
    template <class G>
    bool send_step(G& group, step_envelope<batch_type>& envelope) {
        try {
            broadcast_from_leader(group, envelope, "the next step");
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
            envelope.next_prefetched = false;  // the next step is synchronous
        }
        broadcast_from_leader(group, envelope, "the next step");
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
    // `pass_ended`: the current pass already returned its end (to the prefetch thread).
    std::optional<batch_type> fetch(std::vector<rng_event>& events, bool pass_ended = false) {
        if (finished_ || step_limit_reached(step_)) return finish();
        for (int empty_passes = 0;;) {
            if (!pass_ended) {
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
            }
            pass_ended = false;
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
    loader_stats stats_;         // the trainer's thread's

    // The prefetch stage (see "The prefetch thread" above for who touches what).
    std::size_t depth_ = 0;
    std::string prefetch_reason_;
    channel_type channel_;
    mutable std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<prefetched> ready_;  // sent or received, not yet taken by next()
    bool running_ = false;          // the next envelope goes over the channel
    bool stop_ = false;             // the destructor's
    bool drop_ = false;             // the leader's load_state: end the stream with a dropped envelope
    bool drain_ = false;            // a follower's load_state: receive up to the end of the stream
    bool fetching_ = false;         // the leader's thread is fetching; fetch_state_ is the state before
    std::string fetch_state_;
    position ahead_;
    std::int64_t received_step_ = 0;  // a follower's thread: the step of the last envelope received
    std::thread thread_;               // last: it starts once everything above exists
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
