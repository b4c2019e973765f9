// Runs the broadcasts of one spbcast::broadcast call on the user's group: at most
// options.max_in_flight outstanding, each wait bounded by options.timeout, and any failure of
// the group turned into a spbcast::transport_error that names the rank, the broadcast number,
// the phase and the root - after marking the group broken (group_state.hpp), since the
// announced sequence can no longer be completed.
#pragma once

#include "../../error.hpp"
#include "../../group.hpp"
#include "../../options.hpp"
#include "../base/exception_text.hpp"
#include "death_board.hpp"
#include "group_state.hpp"
#include "peer_watch.hpp"
#include "quarantine.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include <chrono>
#include <concepts>
#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

namespace spbcast::detail {

// A group that also sends to and receives from one rank (c10d's send/recv), with the same work
// handle as its broadcast: what the hierarchical transport needs between hosts.
template <class G>
concept point_to_point_group = requires(G& g, std::vector<at::Tensor>& tensors) {
    { g.send(tensors, 0, 0) } -> std::same_as<decltype(g.broadcast(tensors, std::declval<const c10d::BroadcastOptions&>()))>;
    { g.recv(tensors, 0, 0) } -> std::same_as<decltype(g.broadcast(tensors, std::declval<const c10d::BroadcastOptions&>()))>;
};

// The tag of spbcast's point-to-point messages. Gloo keeps them apart from its collectives; the
// order of a broadcast's messages is fixed, so one tag serves them all.
inline constexpr int point_to_point_tag = 0x5bca;

// Extra time on top of options.timeout before we stop waiting ourselves: the backend is given
// the same timeout and normally reports first, with its own, more precise message.
inline constexpr std::chrono::milliseconds wait_grace{2000};

// How long a failed collective waits for the kernel to tell which peer on this host died, if
// one did: its sockets close during its exit, a moment before the exit is reported.
inline constexpr std::chrono::milliseconds death_notice_wait{200};
// How much longer it waits where it also has peers on its own host: a death on another host is
// told through the group's store (death_board.hpp) after that host's ranks saw it.
inline constexpr std::chrono::milliseconds board_extra_wait{100};
// How often the board is asked meanwhile (a store round trip, only once a collective failed).
inline constexpr std::chrono::milliseconds board_poll{10};

template <class Group>
class collective {
    // c10d groups return a Work handle; a synchronous user transport may return nothing.
    using raw_work_type = decltype(std::declval<Group&>().broadcast(
        std::declval<std::vector<at::Tensor>&>(), std::declval<const c10d::BroadcastOptions&>()));
    using work_type =
        std::conditional_t<std::is_void_v<raw_work_type>, std::monostate, raw_work_type>;

public:
    // `sequence`: the number of this broadcast on the group (group_state::broadcasts).
    collective(Group& group, const options& opts, group_state& state, std::uint64_t sequence)
        : group_(group), opts_(opts), state_(state), sequence_(sequence), rank_(group.getRank()) {
        broadcast_options_.rootRank = opts.root;
        broadcast_options_.rootTensor = 0;
        broadcast_options_.timeout = opts.timeout;
    }
    collective(const collective&) = delete;
    collective& operator=(const collective&) = delete;

    ~collective() {
        if (pending_.empty()) return;
        std::vector<at::Tensor> buffers;
        for (auto& p : pending_) buffers.push_back(p.buffer);
        quarantine(std::move(buffers));
    }

    // Starts broadcasting `buffer` (sent on the root, received elsewhere); `on_done` runs when
    // it has completed. Waits for the oldest outstanding broadcast first if too many are.
    // `timeout` replaces options.timeout for this message (a follower waiting for the root).
    void launch(at::Tensor buffer, std::string phase, std::function<void()> on_done = {},
                std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
        while (pending_.size() >= std::max<std::size_t>(opts_.max_in_flight, 1)) finish_oldest();
        raise_if_a_peer_died(phase);
        c10d::BroadcastOptions broadcast_options = broadcast_options_;
        if (timeout) broadcast_options.timeout = *timeout;
        pending p{{}, buffer, std::move(phase), std::move(on_done), {buffer},
                  broadcast_options.timeout, true};
        try {
            if constexpr (std::is_void_v<raw_work_type>)
                group_.broadcast(p.tensors, broadcast_options);
            else
                p.work = group_.broadcast(p.tensors, broadcast_options);
        } catch (const std::exception& e) {
            fail(p.phase, exception_text(e));
        }
        pending_.push_back(std::move(p));
    }

    // Starts sending `buffer` to group rank `peer` (send) or receiving it from there (!send):
    // bounded by options.timeout and reported like a broadcast. `in_flight`: the most messages
    // outstanding (default options.max_in_flight); a relay that receives and forwards at once
    // needs room for both.
    void launch_point_to_point(at::Tensor buffer, int peer, bool send, std::string phase,
                               std::size_t in_flight = 0) {
        if constexpr (point_to_point_group<Group>) {
            const std::size_t bound = in_flight != 0 ? in_flight : std::max<std::size_t>(opts_.max_in_flight, 1);
            while (pending_.size() >= bound) finish_oldest();
            raise_if_a_peer_died(phase);
            pending p{{}, buffer, std::move(phase), {}, {buffer}, opts_.timeout, false};
            try {
                p.work = send ? group_.send(p.tensors, peer, point_to_point_tag)
                              : group_.recv(p.tensors, peer, point_to_point_tag);
            } catch (const std::exception& e) {
                fail(p.phase, exception_text(e));
            }
            pending_.push_back(std::move(p));
        } else {
            (void)buffer, (void)peer, (void)send;
            break_group(errc::invalid_argument, where() + ": the group has no send/recv", phase);
        }
    }

    void run(at::Tensor buffer, std::string phase,
             std::optional<std::chrono::milliseconds> timeout = std::nullopt) {
        launch(std::move(buffer), std::move(phase), {}, timeout);
        wait_all();
    }

    // The first exception a completion callback threw: callbacks never interrupt the
    // sequence, the caller raises this once every announced message has been issued.
    std::exception_ptr callback_failure() const { return callback_failure_; }

    // This rank cannot complete the announced sequence (it cannot even drain): later calls on
    // the group raise `cause` at once instead of issuing collectives the peers would mismatch.
    [[noreturn]] void break_group(errc code, const std::string& cause, const std::string& phase) {
        state_.broken = code;
        state_.broken_cause = cause;
        throw transport_error(code, cause, phase);
    }

    void wait_all() {
        while (!pending_.empty()) finish_oldest();
    }

    // Messages complete in launch order: `launched()` before a launch numbers that message,
    // and `wait_through(n)` waits until it (and every one before it) has completed.
    std::size_t launched() const { return completed_ + pending_.size(); }
    void wait_through(std::size_t n) {
        while (completed_ <= n && !pending_.empty()) finish_oldest();
    }

    int rank() const { return rank_; }
    std::uint64_t sequence() const { return sequence_; }
    // A follower that found the root at another count takes the root's, so the next broadcast
    // is in step again.
    void adopt_sequence(std::uint64_t root_sequence) {
        state_.broadcasts = root_sequence;
        sequence_ = root_sequence;
    }
    const options& opts() const { return opts_; }

    // "rank 1: broadcast #7 from root 0" - the prefix of every message about this call.
    std::string where() const {
        return "spbcast: rank " + std::to_string(rank_) + ": broadcast #" +
               std::to_string(sequence_) + " from root " + std::to_string(opts_.root);
    }

private:
    struct pending {
        work_type work;
        at::Tensor buffer;
        std::string phase;
        std::function<void()> on_done;
        std::vector<at::Tensor> tensors;
        std::chrono::milliseconds timeout;
        bool broadcast;  // a broadcast's work has a future (c10d's send and recv works do not)
    };

    void finish_oldest() {
        pending& p = pending_.front();
        try {
            if (p.broadcast) wait_unless_a_peer_dies(p.work, p.timeout, p.phase);
            wait(p.work, p.timeout);
        } catch (const transport_error&) {
            throw;
        } catch (const std::exception& e) {
            fail(p.phase, exception_text(e), p.timeout);
        }
        auto on_done = std::move(p.on_done);
        pending_.pop_front();
        ++completed_;
        if (!on_done) return;
        try {
            on_done();
        } catch (...) {
            if (!callback_failure_) callback_failure_ = std::current_exception();
        }
    }

    // With peers on this host watched, a broadcast is waited for until it completes or one of
    // them fails (peer_watch.hpp: killed by a signal, or exited with a status other than 0): the
    // death ends the wait at once, even while the dead
    // process's children keep its sockets open and the backend waits on. Returns when the
    // work completed (the backend's own wait then reports how); throws at the deadline, which is
    // the backend's wait's own.
    void wait_unless_a_peer_dies(work_type& work, std::chrono::milliseconds timeout, const std::string& phase) {
        if constexpr (requires { work->getFuture()->completed(); }) {
            if (state_.peers.empty()) return;
            decltype(work->getFuture()) future;
            try {
                future = work->getFuture();
            } catch (const std::exception&) {
                return;  // a backend without futures: its own wait alone
            }
            if (!future) return;
            if (!future->completed()) {
                auto& watch = peer_watch::instance();
                future->addCallback([&watch](auto&) { watch.notify(); });
                const auto deadline = std::chrono::steady_clock::now() + timeout + wait_grace;
                const std::string death =
                    watch.wait(state_.peers, deadline, [&future] { return future->completed(); });
                if (future->completed()) return;
                if (!death.empty()) peer_died(phase, death);
                // The deadline passed: the backend's wait would wait as long again.
                throw std::runtime_error("timed out waiting for the backend");
            }
        } else {
            (void)work, (void)timeout, (void)phase;
        }
    }

    // A broadcast is not started on a group one of whose peers on this host has died: the
    // collective could never complete.
    void raise_if_a_peer_died(const std::string& phase) {
        if (const std::string death = peer_watch::instance().death_among(state_.peers); !death.empty())
            peer_died(phase, death);
    }

    // `death`: a peer of this host that exited. It may have left after its own error, caused by
    // another rank's death that the group's board told first: that one is named then.
    [[noreturn]] void peer_died(const std::string& phase, const std::string& death, const std::string& backend = {}) {
        std::string cause = death;
        if (state_.board) {
            const std::string told = state_.board->told();
            auto who = [](const std::string& d) { return d.substr(0, d.find(')') + 1); };
            if (!told.empty() && who(told) != who(death)) cause = told + ", as its host's ranks tell";
        }
        raise_death(phase, cause + (backend.empty() ? "" : " (" + backend + ")"));
    }

    [[noreturn]] void raise_death(const std::string& phase, const std::string& named) {
        break_group(errc::transport,
                    where() + " failed in phase '" + phase + "': " + named + "\nThe group is unusable now - restart the job.",
                    phase);
    }

    void wait(work_type& work, std::chrono::milliseconds timeout) {
        const auto limit = timeout + wait_grace;
        if constexpr (requires { work->wait(limit); }) {
            if (!work->wait(limit)) throw std::runtime_error("timed out waiting for the backend");
        } else if constexpr (requires { work->wait(); }) {
            work->wait();
        } else if constexpr (requires { work.wait(); }) {
            work.wait();
        }
    }

    [[noreturn]] void fail(const std::string& phase, const std::string& what,
                           std::chrono::milliseconds timeout) {
        const bool timed_out = what.find("imed out") != std::string::npos ||
                               what.find("imeout") != std::string::npos;
        // The backend saw the peer's sockets close: the kernel tells its death a moment later,
        // on this host, or a rank of its host writes it on the group's board for the others.
        // Not after a timeout: a peer that gave up at the same moment and left is no cause.
        // Both are asked together: the kernel's notice of a death here, the board's of one there.
        const bool local = !state_.peers.empty();
        if (!timed_out && (local || state_.board)) {
            const auto deadline = std::chrono::steady_clock::now() + death_notice_wait +
                                  (local && state_.board ? board_extra_wait : std::chrono::milliseconds(0));
            for (;;) {
                const auto slice_end = state_.board ? std::min(std::chrono::steady_clock::now() + board_poll, deadline)
                                                    : deadline;
                if (local) {
                    const std::string death = peer_watch::instance().wait(state_.peers, slice_end, [] { return false; },
                                                                          peer_watch::any_exit);
                    if (!death.empty()) peer_died(phase, death, what);
                } else {
                    std::this_thread::sleep_until(slice_end);
                }
                if (state_.board)
                    if (const std::string death = state_.board->told(); !death.empty())
                        raise_death(phase, death + ", as its host's ranks tell (" + what + ")");
                if (std::chrono::steady_clock::now() >= deadline) break;
            }
        }
        break_group(timed_out ? errc::timeout : errc::transport,
                    where() + " failed in phase '" + phase + "' (" +
                        (timed_out ? std::string("timed out after ") +
                                         (timeout == opts_.timeout ? "options.timeout" : "options.root_wait") +
                                         " = " + std::to_string(timeout.count()) + " ms"
                                   : std::string("the process group failed")) +
                        "): " + what +
                        "\nA peer has probably died or stopped calling spbcast::broadcast on this "
                        "group; the group is unusable now - restart the job (raise "
                        "options.timeout if peers are only slow).",
                    phase);
    }
    [[noreturn]] void fail(const std::string& phase, const std::string& what) {
        fail(phase, what, opts_.timeout);
    }

    Group& group_;
    const options& opts_;
    group_state& state_;
    std::uint64_t sequence_;
    int rank_;
    c10d::BroadcastOptions broadcast_options_;
    std::deque<pending> pending_;
    std::size_t completed_ = 0;
    std::exception_ptr callback_failure_;
};

}  // namespace spbcast::detail
