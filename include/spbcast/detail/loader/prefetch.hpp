// Prefetch inside the loader: while the trainer runs step t, a thread of the leader fetches batch
// t+1 and broadcasts it over the prefetch channel (a second group of the SP group's ranks,
// prefetch_channel.hpp), and a thread of each follower receives it, so next() takes it at once.
// The leader chooses the depth and the channel for every rank (in loader_init); the envelopes
// wait in a queue of at most that depth until next() takes them.
#pragma once

#include "../../error.hpp"
#include "../../group.hpp"
#include "../../prefetch_channel.hpp"
#include "passes.hpp"
#include "resume.hpp"
#include "stats.hpp"
#include "step_exchange.hpp"

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <mutex>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <utility>

namespace spbcast::detail {

template <class Loader>
class loader_prefetch {
public:
    using passes_type = loader_passes<Loader>;
    using batch_type = typename passes_type::batch_type;
    using channel_type = c10::intrusive_ptr<c10d::ProcessGroupGloo>;

    // One envelope that went over the prefetch channel, with what this rank learnt sending or
    // receiving it.
    struct prefetched {
        step_envelope<batch_type> envelope;
        bool refused = false;          // the leader's batch could not be sent (the envelope says why)
        std::exception_ptr failure;    // this rank's own failure sending or receiving it
        std::string loader_state;      // the leader: its loader's state right before this fetch
        loader_position ahead;         // the leader: its position with this batch taken
        std::uint64_t bytes = 0;
        double broadcast_seconds = 0;
        bool hit = false;              // it was here when next() was called
    };

    // `wanted`: loader_config::prefetch; `own_channel`: loader_config::prefetch_channel;
    // `where`: how this rank's messages begin.
    loader_prefetch(std::size_t wanted, channel_type own_channel, std::string where, bool leader)
        : wanted_(wanted), own_channel_(std::move(own_channel)), where_(std::move(where)), leader_(leader) {}

    loader_prefetch(const loader_prefetch&) = delete;
    loader_prefetch& operator=(const loader_prefetch&) = delete;
    ~loader_prefetch() { stop(); }

    // The depth in use, and why it is 0 when it is.
    std::size_t depth() const { return depth_; }
    const std::string& reason() const { return reason_; }
    // The channel the batches travel over; null when the steps go over the SP group.
    const void* channel() const { return channel_.get(); }

    // No prefetch, because `why`.
    void off(std::string why) { reason_ = std::move(why); }

    // A channel of the user's must be a second group over the same ranks: checked on every rank
    // before any collective.
    template <class Group>
    void check_own_channel(Group& group) const {
        if (!own_channel_) return;
        auto& g = group_of(group);
        if (own_channel_->getSize() != g.getSize() || own_channel_->getRank() != g.getRank())
            throw error(errc::invalid_argument,
                        where_ + ": loader_config::prefetch_channel has rank " + std::to_string(own_channel_->getRank()) +
                            " of " + std::to_string(own_channel_->getSize()) + ", the SP group rank " +
                            std::to_string(g.getRank()) + " of " + std::to_string(g.getSize()) +
                            "; make it over the SP group's ranks, in the same order");
        if (gloo_behind(group).first.get() == own_channel_.get())
            throw error(errc::invalid_argument,
                        where_ + ": loader_config::prefetch_channel is the SP group itself; it must be a "
                                 "second group over the same ranks, used by nothing else");
    }

    // The leader chooses the depth and the channel for every rank (it sends both in loader_init).
    template <class Group>
    void choose(Group& group, loader_init& init) const {
        if (wanted_ == 0) {
            init.prefetch_reason = "loader_config::prefetch is 0 on the SP leader";
            return;
        }
        if (!own_channel_) {
            auto [gloo, why_not] = gloo_behind(group);
            if (!gloo) {
                init.prefetch_reason = why_not;
                return;
            }
            std::random_device entropy;
            std::ostringstream key;
            key << "spbcast/prefetch/" << std::hex << entropy() << entropy() << "/";
            init.channel_key = key.str();
        }
        init.prefetch = wanted_;
    }

    // Every rank: joins the channel the leader chose (a collective) and starts the thread, which
    // fetches through `passes` and sends or receives through `exchange`.
    template <class Group>
    void open(Group& group, const loader_init& init, passes_type& passes, const step_exchange& exchange) {
        reason_ = init.prefetch_reason;
        depth_ = static_cast<std::size_t>(init.prefetch);
        if (depth_ == 0) return;
        if (init.channel_key.empty()) {
            if (!own_channel_)
                throw error(errc::invalid_argument,
                            where_ + ": the SP leader prefetches over its loader_config::prefetch_channel, "
                                     "but this rank has none; set it on every SP rank");
            channel_ = own_channel_;
        } else {
            auto [gloo, why_not] = gloo_behind(group);
            if (!gloo)
                throw error(errc::invalid_argument, where_ + ": the SP leader made a prefetch channel from "
                                                             "the SP group's store, but on this rank " + why_not);
            channel_ = make_prefetch_channel(gloo, init.channel_key);
        }
        passes_ = &passes;
        exchange_ = &exchange;
        thread_ = std::thread([this] { leader_ ? lead() : follow(); });
    }

    // Stops the thread and joins it (see ~leader_loader).
    void stop() {
        if (!thread_.joinable()) return;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        changed_.notify_all();
        thread_.join();
    }

    // The next item over the channel, waited for; nullopt when the next step is synchronous.
    std::optional<prefetched> take() {
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

    // Lets the thread fetch or receive the steps after a synchronous one, taken at `at`.
    void resume(const loader_position& at) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ahead_ = at;
            received_step_ = at.step();
            running_ = true;
        }
        changed_.notify_all();
    }

    // load_state: the leader's thread ends the stream with a dropped envelope (unless its last one
    // already ended it), each follower's thread receives up to that envelope, and all of it is
    // dropped: the next step is synchronous on every rank.
    void drop() {
        if (depth_ == 0) return;
        std::unique_lock<std::mutex> lock(mutex_);
        bool& ask = leader_ ? drop_ : drain_;
        if (running_) {
            ask = true;
            changed_.notify_all();
            changed_.wait(lock, [&] { return !running_; });
        }
        drain_ = false;
        ready_.clear();
    }

    // The leader's loader state as of the last batch next() returned.
    std::string consumed_loader_state(const passes_type& passes) const
        requires requires(const Loader& l) { l.save_state(); }
    {
        if (depth_ == 0) return passes.loader_state();
        std::lock_guard<std::mutex> lock(mutex_);
        if (!ready_.empty()) return ready_.front().loader_state;
        if (fetching_) return fetch_state_;
        return passes.loader_state();  // the thread is idle, and starts no fetch while we hold mutex_
    }

private:
    // ---- The thread ---------------------------------------------------------------------------
    //
    // Invariants, kept here:
    // - The thread alone issues collectives on channel_ (broadcasts, and keep-alive frames while
    //   it fetches); the trainer's thread never does. The trainer's thread alone uses the SP group.
    // - The leader's thread fetches only within the pass in progress (passes_->next_in_pass()),
    //   only while running_ (and takes the loader's state under mutex_, right before each fetch).
    //   The trainer's thread creates and ends passes, calls set_epoch and load_state only while
    //   running_ is false and nothing is in ready_: every draw from the default generator stays on
    //   it.
    // - running_ says whether the next envelope goes over the channel. The leader's thread clears
    //   it when it sends an envelope with next_prefetched false; a follower's when it receives one;
    //   the trainer's thread sets it (resume) after a synchronous step whose envelope says
    //   next_prefetched. So a step is synchronous, over the SP group, exactly when on every rank
    //   nothing is prefetched and the thread is paused.
    // - mutex_ guards the hand-off only: neither thread holds it across a collective, a fetch or
    //   a wait on the other ranks (only across the loader's save_state(), which must not fork),
    //   so a fork (a loader's workers) finds it free, and a forked child never takes it (it runs
    //   the loader's code, not ours).
    // - ahead_ is the thread's fetch position; the trainer's thread sets it only while paused.

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
                if constexpr (requires { passes_->loader_state(); }) fetch_state_ = passes_->loader_state();
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

    // The next batch of the pass on the thread, as passes::fetch takes it on the trainer's.
    void fetch_ahead(prefetched& item) {
        auto& envelope = item.envelope;
        exchange_->fetch_on_leader(channel_, envelope, leader_status::pass_end, [&] { return passes_->next_in_pass(); });
        if (envelope.status == leader_status::batch) ahead_.count_batch();
        envelope.epoch = ahead_.epoch();
        envelope.step = ahead_.step();
        item.ahead = ahead_;
        envelope.next_prefetched = envelope.status == leader_status::batch && !passes_->step_limit_reached(ahead_.step());
    }

    // The leader's send over the channel; every failure is kept in the item for its step.
    void send_ahead(prefetched& item) {
        const auto started = loader_clock::now();
        try {
            item.refused = !exchange_->send_step(channel_, item.envelope);
            if (item.envelope.batch && !item.refused) item.bytes = storage_bytes(*item.envelope.batch);
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
        const auto started = loader_clock::now();
        try {
            item.refused = !exchange_->send_step(channel_, item.envelope);
            if (item.envelope.batch) item.bytes = storage_bytes(*item.envelope.batch);
            received_step_ = item.envelope.step;
        } catch (const transport_error&) {
            item.failure = std::current_exception();
            item.envelope.next_prefetched = false;  // the channel is out of step: no more over it
        } catch (...) {
            // This rank's own failure decoding a batch the leader sent (its frame was drained, the
            // channel is in step): the leader goes on prefetching unless that batch was its last.
            item.failure = std::current_exception();
            item.envelope.next_prefetched = !passes_->step_limit_reached(++received_step_);
        }
        item.broadcast_seconds = seconds_since(started);
        return item;
    }

    std::size_t wanted_;
    channel_type own_channel_;
    std::string where_;
    bool leader_;
    std::size_t depth_ = 0;
    std::string reason_;
    channel_type channel_;
    passes_type* passes_ = nullptr;           // the thread's: what it fetches from
    const step_exchange* exchange_ = nullptr; // the thread's: how it sends and receives
    mutable std::mutex mutex_;
    std::condition_variable changed_;
    std::deque<prefetched> ready_;  // sent or received, not yet taken by next()
    bool running_ = false;          // the next envelope goes over the channel
    bool stop_ = false;             // the destructor's
    bool drop_ = false;             // the leader's load_state: end the stream with a dropped envelope
    bool drain_ = false;            // a follower's load_state: receive up to the end of the stream
    bool fetching_ = false;         // the leader's thread is fetching; fetch_state_ is the state before
    std::string fetch_state_;
    loader_position ahead_;
    std::int64_t received_step_ = 0;  // a follower's thread: the step of the last envelope received
    std::thread thread_;               // last: it starts once everything above exists
};

}  // namespace spbcast::detail
