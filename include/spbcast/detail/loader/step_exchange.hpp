// The step exchange: what the SP leader sends its followers - once when its loader is built
// (loader_init), then every step (step_envelope: status, epoch, step, RNG events, batch) - and how
// the leader's failures and refusals travel in it, so that each is raised on every SP rank at the
// step it belongs to. What the leader's loader did is always on the wire: never inferred from an
// empty message or an absent batch, so no failure can pass for the end of the data.
#pragma once

#include "../../error.hpp"
#include "../../group.hpp"
#include "../../rng_mirror.hpp"
#include "../../shared_memory.hpp"
#include "../base/exception_text.hpp"
#include "../transport/same_host_registry.hpp"
#include "patience.hpp"
#include "stats.hpp"

#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace spbcast {

// What the leader's loader did, on the wire.
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

class step_exchange {
public:
    // `leader_allocates_in_shared_memory`: loader_config's, unless the transport is the network.
    step_exchange(const loader_patience& patience, std::string where, bool leader,
                  bool leader_allocates_in_shared_memory)
        : patience_(patience),
          where_(std::move(where)),
          leader_(leader),
          leader_allocates_(leader_allocates_in_shared_memory) {}

    // ---- The loader's construction ------------------------------------------------------------

    // The leader builds its loader (`build` fills `init`); a failure goes into `init`.
    template <class G, class Build>
    void build_on_leader(G& group, loader_init& init, Build&& build) const {
        try {
            patience_.keep_while_working(group, build);
        } catch (...) {
            init.status = leader_status::failed;
            init.error = leader_exception_text(std::current_exception());
        }
    }

    // Every rank: the leader's loader_init, or its failure raised.
    template <class G>
    void share_construction(G& group, loader_init& init) const {
        patience_.broadcast_from_leader(group, init, "the loader's construction");
        if (init.status == leader_status::failed) throw leader_failed("building the data loader", init.error);
        if (init.status != leader_status::batch)
            throw error(errc::corrupt_frame, where_ + ": an unknown loader status arrived from the SP leader");
    }

    // ---- A step -------------------------------------------------------------------------------

    // The leader's fetch of a step's batch into `envelope`, on the same-host path inside a
    // shared_memory_scope (the batch is born where the followers read it). `at_end`: the status
    // when `fetch` returns no batch. A failure goes into the envelope.
    template <class G, class Batch, class Fetch>
    void fetch_on_leader(G& group, step_envelope<Batch>& envelope, leader_status at_end, Fetch&& fetch) const {
        const auto started = loader_clock::now();
        try {
            patience_.keep_while_working(group, [&] {
                std::optional<shared_memory_scope> in_shared_memory;
                if (batches_in_shared_memory(group)) in_shared_memory.emplace();
                envelope.batch = fetch();
            });
            envelope.status = envelope.batch ? leader_status::batch : at_end;
        } catch (...) {
            envelope.batch.reset();
            envelope.status = leader_status::failed;
            envelope.error = leader_exception_text(std::current_exception());
        }
        envelope.loader_seconds = seconds_since(started);
    }

    // Broadcasts the step's envelope on `group`; false when the leader's batch was refused
    // (spbcast cannot send it). The leader then sends the same envelope without the batch, with
    // the refusal as its error, so the step's RNG events, epoch and step still reach every rank. A
    // refused batch counts as a step (the loader produced it): a trainer that skips it goes on at
    // the same step everywhere. A fetch that threw counts on no rank.
    template <class G, class Batch>
    bool send_step(G& group, step_envelope<Batch>& envelope) const {
        try {
            patience_.broadcast_from_leader(group, envelope, "the next step");
            return true;
        } catch (const transport_error&) {
            throw;  // the group is out of step: no follow-up can reach the followers
        } catch (const remote_error&) {
            if (leader_) throw;  // a follower's: the leader refused its batch; its step follows
        } catch (const error& e) {
            if (!leader_) throw;  // this follower's own failure, not the leader's refusal
            envelope.batch.reset();
            envelope.status = leader_status::failed;
            envelope.error = e.what();
            envelope.next_prefetched = false;  // the next step is synchronous
        }
        patience_.broadcast_from_leader(group, envelope, "the next step");
        return false;
    }

    // A prefetched envelope that ends the stream instead of carrying a step.
    template <class Batch>
    void check_not_a_marker(const step_envelope<Batch>& envelope) const {
        if (envelope.status == leader_status::stopped)
            throw error(errc::loader, where_ + ": the SP leader's leader_loader was destroyed (its loop "
                                               "ended or its trainer raised) while this rank still calls "
                                               "next(); every SP rank must leave the loop together");
        if (envelope.status == leader_status::dropped)
            throw error(errc::invalid_argument,
                        where_ + ": the SP leader called load_state after next() and this rank did not; "
                                 "call load_state on every SP rank (followers with an empty string)");
    }

    template <class Batch>
    void check_status(const step_envelope<Batch>& envelope) const {
        if ((envelope.status == leader_status::batch) != envelope.batch.has_value() ||
            (envelope.status != leader_status::batch && envelope.status != leader_status::end &&
             envelope.status != leader_status::failed))
            throw error(errc::corrupt_frame, where_ + ": an inconsistent loader status arrived from the SP leader");
    }

    // The leader's refusal of its batch, or its loader's failure, raised on every rank.
    template <class Batch>
    void raise_failure(const step_envelope<Batch>& envelope, bool refused) const {
        if (refused) throw leader_failed("sending step " + std::to_string(envelope.step), envelope.error);
        if (envelope.status == leader_status::failed)
            throw leader_failed("fetching step " + std::to_string(envelope.step + 1), envelope.error);
    }

private:
    error leader_failed(const std::string& doing, const std::string& message) const {
        return error(errc::loader, where_ + ": the SP leader (SP rank 0) failed " + doing + ": " + message);
    }

    // Whether the leader's broadcasts on `group` take the same-host path (decided by the first one).
    template <class G>
    bool batches_in_shared_memory(G& group) const {
        if (!leader_allocates_) return false;
        const auto state = same_host_registry::instance().find(&group_of(group), 0);
        return state && state->shared;
    }

    const loader_patience& patience_;
    std::string where_;
    bool leader_;
    bool leader_allocates_;
};

}  // namespace detail
}  // namespace spbcast
