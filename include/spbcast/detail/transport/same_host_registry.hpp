// What each rank knows about the same-host path of one (group, root) - its links, the hosts of
// a hierarchical group, why the path ended - and the process-wide registry of that state.
//
// The root reads its followers' answers at every broadcast and, before it would create a
// segment while one its followers map could come back, waits a bounded time for each
// follower's start of the broadcast (await_followers).
#pragma once

#include "descriptor_socket.hpp"
#include "follower_links.hpp"
#include "fork_safety.hpp"
#include "shm_pool.hpp"

#include <c10/util/intrusive_ptr.h>

#include <poll.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace spbcast::detail {

// One host of a hierarchical (group, root): its leader (the root on the root's host) and the
// ranks the leader hands its segments to. A host whose shared memory failed in the handshake
// is split into hosts of one rank each.
struct relay_host {
    int leader = -1;
    std::vector<int> members;
};

// What one rank knows about the same-host path of one (group, root).
struct same_host_state {
    bool shared = false;       // the handshake chose the same-host path, and it has not ended
    // The handshake of a root on transport_mode::network: it exchanged who is where, so that
    // same-host peers are watched (peer_watch.hpp), and decided nothing about the path - a later
    // broadcast on another transport makes the real handshake.
    bool watch_only = false;
    std::string why_not;       // when not: the reasons, for transport_mode::shared_memory
    // Hierarchical (the group spans hosts): every host, the root's first, the same on every
    // rank; empty when every rank is on the root's host. `leader`: this rank's host leader.
    std::vector<relay_host> hosts;
    int leader = -1;
    // The root, and a host leader elsewhere:
    std::vector<root_link> links;
    std::string lost;          // why a link was lost since the last broadcast: the path ends
    // A follower:
    std::shared_ptr<follower_link> link;

    bool relays() const { return !hosts.empty(); }
    int alive_links() const {
        return static_cast<int>(std::count_if(links.begin(), links.end(), [](const root_link& l) { return l.alive; }));
    }

    // Reads every answer waiting on the root's sockets, at every broadcast. A follower whose
    // socket closed or sent nonsense has died or lost step: its link is dropped, and the path
    // ends with this broadcast (send.hpp).
    void collect_releases() {
        for (root_link& l : links)
            while (read_answer(l)) {
            }
    }

    // Root, before it places the batch of broadcast `sequence` in a new segment while one that
    // its followers still map would fit: reads their answers until every live follower has said
    // it started this broadcast (after reporting everything it let go of before), or `done()`
    // (a segment came back), or `bound` has passed. Never an error: the batch then takes a new
    // segment, and a follower that is gone ends the path as at any broadcast (`lost`). So the
    // segments a loop has let go of return before the next batch is placed, and the host holds
    // only the batches the loop keeps alive.
    template <class Done>
    void await_followers(std::uint64_t sequence, std::chrono::milliseconds bound, Done done) {
        const auto deadline = std::chrono::steady_clock::now() + bound;
        for (;;) {
            collect_releases();
            if (done()) return;
            std::vector<pollfd> waiting;
            for (const root_link& l : links)
                if (l.alive && l.arrived < sequence) waiting.push_back({l.sock.get(), POLLIN, 0});
            const auto left =
                std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
            if (waiting.empty() || left.count() <= 0) return;
            const int r = ::poll(waiting.data(), waiting.size(), static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
            if (r < 0 && errno != EINTR) return;
        }
    }

    // Reads one answer of `l` if one is waiting (true). A follower whose socket closed or that
    // sent nonsense is dropped.
    bool read_answer(root_link& l) {
        if (!l.alive) return false;
        shm_message m;
        std::vector<owned_fd> stray;
        const auto status = receive_message(l.sock.get(), m, stray, std::chrono::milliseconds(-1));
        if (status == receive_status::timed_out) return false;
        const bool answer = m.kind == shm_message_kind::released || m.kind == shm_message_kind::forked;
        if (status != receive_status::ok || !answer) {
            drop_link(l, status == receive_status::closed ? "its socket closed" : "it sent a malformed message");
            return false;
        }
        if (m.kind == shm_message_kind::released && m.count == 0) l.arrived = std::max(l.arrived, m.sequence);
        auto& pool = shm_pool::instance();
        for (std::uint32_t i = 0; i < m.count; ++i) {
            auto it = l.held.find(m.ids[i]);
            if (it == l.held.end()) continue;
            l.held.erase(it);
            if (m.kind == shm_message_kind::forked)
                pool.forget(m.ids[i]);
            else
                pool.release_follower(m.ids[i]);
        }
        return true;
    }

    // A follower that can no longer answer may still map what it holds: forgotten.
    void drop_link(root_link& l, const std::string& why) {
        auto& pool = shm_pool::instance();
        for (std::uint64_t id : l.held) pool.forget(id);
        l.held.clear();
        l.sock.reset();
        if (l.alive && lost.empty()) lost = "the same-host link to rank " + std::to_string(l.rank) + " was lost (" + why + ")";
        l.alive = false;
    }

    // The same-host path of this (group, root) ends, on this rank: every socket closes, every
    // segment still mapped elsewhere is forgotten; later broadcasts take the network path.
    void end_path(const std::string& why) {
        for (root_link& l : links) drop_link(l, why);
        links.clear();
        if (link) link->close();
        link.reset();
        hosts.clear();
        if (shared) why_not = why;
        shared = false;
    }

    ~same_host_state() { end_path("the group is gone"); }
};

// Per (group, root) state. A c10d group (an intrusive_ptr_target: ProcessGroup, Backend,
// ProcessGroupGloo) is tracked by a weak reference, so a new group can never be taken for a
// destroyed one at the same address; the state of a destroyed group is dropped (its sockets
// closed) at the next broadcast of any group. A weak reference keeps the group's memory, and
// so its destructor, until then. Other group types are keyed by their address only: they use
// the same-host path only when asked for explicitly (see same_host_for in broadcast.hpp).
class same_host_registry {
public:
    static same_host_registry& instance() {
        static auto* r = new same_host_registry();
        return *r;
    }

    // A weak reference to `g` when it is a reference-counted c10 object, else nothing.
    template <class G>
    static std::optional<c10::weak_intrusive_ptr<c10::intrusive_ptr_target>> owner_of(G& g) {
        if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, G>) {
            auto* target = static_cast<c10::intrusive_ptr_target*>(&g);
            if (c10::raw::intrusive_ptr::use_count(target) == 0) return std::nullopt;  // not heap-owned
            auto strong = c10::intrusive_ptr<c10::intrusive_ptr_target>::unsafe_reclaim_from_nonowning(target);
            return c10::weak_intrusive_ptr<c10::intrusive_ptr_target>(strong);
        } else {
            return std::nullopt;
        }
    }
    template <class G>
    static constexpr bool tracked = std::is_base_of_v<c10::intrusive_ptr_target, G>;

    std::shared_ptr<same_host_state> find(const void* group, int root) {
        sweep();
        std::lock_guard<std::mutex> lock(mutex_);
        auto it = states_.find({group, root});
        return it == states_.end() ? nullptr : it->second.state;
    }
    void put(const void* group, int root, std::shared_ptr<same_host_state> s,
             std::optional<c10::weak_intrusive_ptr<c10::intrusive_ptr_target>> owner) {
        std::lock_guard<std::mutex> lock(mutex_);
        states_.insert_or_assign(std::make_pair(group, root), entry{std::move(s), std::move(owner)});
        shm_pool::instance().set_serving(true);
    }
    // Drops the state of a failed group: its sockets close now. When no same-host state is
    // left, the free segments serve nobody and are freed too.
    void drop(const void* group, int root) {
        std::shared_ptr<same_host_state> s;
        bool last = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            auto it = states_.find({group, root});
            if (it == states_.end()) return;
            s = std::move(it->second.state);
            states_.erase(it);
            last = states_.empty();
        }
        s->end_path("a broadcast on this group failed");
        if (last) release_all_free();
    }
    void drop_all() {
        std::map<std::pair<const void*, int>, entry> states;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            states.swap(states_);
        }
        for (auto& [key, e] : states) e.state->end_path("the same-host channels were closed");
        release_all_free();
    }

private:
    same_host_registry() { fork_safety::instance().hold_across_fork(fork_safety::lock_order::same_host_registry, mutex_); }

    struct entry {
        std::shared_ptr<same_host_state> state;
        std::optional<c10::weak_intrusive_ptr<c10::intrusive_ptr_target>> owner;
    };

    // Drops the states of destroyed groups.
    void sweep() {
        std::vector<entry> dead;
        bool last = false;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (auto it = states_.begin(); it != states_.end();) {
                if (it->second.owner && it->second.owner->expired()) {
                    dead.push_back(std::move(it->second));
                    it = states_.erase(it);
                } else {
                    ++it;
                }
            }
            last = !dead.empty() && states_.empty();
        }
        for (auto& e : dead) e.state->end_path("the same-host channels were closed");
        if (last) release_all_free();
    }

    // No same-host state is left: the free segments serve nobody, now or when let go of.
    void release_all_free() {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!states_.empty()) return;
        shm_pool::instance().set_serving(false);
        shm_pool::instance().release_free();
    }

    std::mutex mutex_;
    std::map<std::pair<const void*, int>, entry> states_;
};

}  // namespace spbcast::detail
