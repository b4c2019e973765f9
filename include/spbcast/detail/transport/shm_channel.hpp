// The same-host channel between a root and its followers: one SOCK_SEQPACKET Unix socket per
// follower, set up once per (group, root) by a collective handshake over the group.
//
// - The root listens on a name in the abstract namespace made of a random nonce and its pid;
//   the nonce travels over the group, so only ranks of this group can find it, and nothing has
//   a name in a file system (a SIGKILL leaks nothing; the name vanishes with the socket). The
//   listening socket is closed as soon as every follower is accepted.
// - Who shares a host: boot id, user and network namespace (an abstract socket lives in one)
//   must match the root's, and the connect must succeed. Every rank states its result and its
//   options.transport in a broadcast of its own, so every rank sees the same answers and takes
//   the same decision - no rank ever decides by a timeout. The root confirms in one last
//   broadcast.
// - Messages: before the frame of a batch the root sends one message with the descriptors of
//   every segment the batch lies in (SCM_RIGHTS), their ids and the broadcast's number (a host
//   leader on another host: after the frame, once the relay is in, with a progress message per
//   chunk before it); a
//   follower answers "released" (or "forked") with segment ids when the last storage over them
//   is gone, and at the start of every broadcast sends a "released" with no ids that names the
//   broadcast: everything it let go of before is reported. Answers never block a deleter
//   (follower_link), the root reads them at every broadcast (and, before it would create a
//   segment while one its followers map could come back, waits a bounded time for each
//   follower's start of the broadcast: await_followers), and every other wait on these sockets
//   is bounded by options.timeout.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "collective.hpp"
#include "fork_safety.hpp"
#include "../wire/frame.hpp"
#include "group_state.hpp"
#include "shm_pool.hpp"
#include "shm_segment.hpp"

#include <ATen/ATen.h>
#include <c10/util/intrusive_ptr.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <type_traits>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace spbcast::detail {

inline constexpr std::uint32_t shm_message_magic = 0x4D485353;  // "SSHM"
// hello: a follower's first message (its rank). segments: the descriptors of one broadcast,
// sent before its frame. released / forked: a follower's answers, several ids each; forked
// means a child forked since the segment was mapped may still map it (fork_safety.hpp). A
// released with no ids and a sequence: the follower starts that broadcast, and has reported
// every segment it let go of before (follower_link::arrive).
// relay_progress: a host leader on another host has one more chunk of the broadcast `sequence`
// (capacity: chunks landed so far); its followers wait for each one in turn, never for the whole
// relay at once. The root sends its host's followers the same reports of the chunks it has sent
// (ids[0]: the relay's chunk count; the last report has capacity == ids[0]).
// relay_failed: that leader (or the root) is alive but cannot finish the relay; `ids` holds its
// error text (NUL-terminated), which its followers raise.
enum class shm_message_kind : std::uint32_t {
    hello = 1, segments = 2, released = 3, forked = 4, relay_progress = 5, relay_failed = 6
};
// The most segments one batch lies in (its own and the leader's shared allocations, see
// shm_allocator.hpp); further shared allocations of a batch are copied into its own segment.
inline constexpr std::size_t max_batch_segments = 32;

struct shm_message {
    std::uint32_t magic = shm_message_magic;
    shm_message_kind kind = shm_message_kind::hello;
    // segments: the broadcast whose frame it precedes - the one key that keeps the stream in
    // step with the frames (take_segments). hello: the follower's rank.
    std::uint64_t sequence = 0;
    std::uint32_t count = 0;        // ids below
    std::uint32_t descriptors = 0;  // attached (SCM_RIGHTS), one per id, for segments
    std::uint64_t capacity = 0;     // segments from a host leader (relayed): the segment's size
    std::uint64_t ids[max_batch_segments] = {};
};
static_assert(sizeof(shm_message) == 32 + 8 * max_batch_segments);

enum class send_status { sent, would_block, failed };

// Sends `m` with `fds` attached, waiting at most `timeout` for room in the socket (negative:
// not at all). Never raises SIGPIPE, never blocks past the bound.
inline send_status send_message(int sock, const shm_message& m, const std::vector<int>& fds,
                                std::chrono::milliseconds timeout) {
    if (fds.size() > max_batch_segments || sock < 0) return send_status::failed;
    iovec iov{const_cast<shm_message*>(&m), sizeof m};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_batch_segments)] = {};
    if (!fds.empty()) {
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (n == static_cast<ssize_t>(sizeof m)) return send_status::sent;
        if (n < 0 && errno == EINTR) continue;
        if (n >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) return send_status::failed;
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        if (timeout.count() < 0 || left.count() <= 0) return send_status::would_block;
        pollfd p{sock, POLLOUT, 0};
        ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 1000)));
    }
}
inline bool send_message(int sock, const shm_message& m, std::chrono::milliseconds timeout) {
    return send_message(sock, m, {}, timeout) == send_status::sent;
}

// truncated: the message arrived whole, but the kernel dropped its descriptors (MSG_CTRUNC:
// this process is at its descriptor limit); its ids are valid.
enum class receive_status { ok, closed, timed_out, malformed, truncated };

// Receives one message within `timeout` (negative: do not wait). Every descriptor that arrives
// is either returned in `fds` (as many as the message says) or closed here, so nothing a peer
// sends can leak.
inline receive_status receive_message(int sock, shm_message& m, std::vector<owned_fd>& fds_out,
                                      std::chrono::milliseconds timeout) {
    fds_out.clear();
    if (sock < 0) return receive_status::closed;
    pollfd p{sock, POLLIN, 0};
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        const int r = ::poll(&p, 1, timeout.count() < 0 ? 0 : static_cast<int>(std::max<std::int64_t>(left.count(), 0)));
        if (r < 0 && errno == EINTR) continue;
        if (r <= 0) return receive_status::timed_out;
        break;
    }
    iovec iov{&m, sizeof m};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_batch_segments)] = {};
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t n;
    do n = ::recvmsg(sock, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    while (n < 0 && errno == EINTR);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return receive_status::timed_out;
    std::vector<owned_fd> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
            fds.emplace_back(received);
        }
    }
    if (n <= 0) return receive_status::closed;
    if (n != static_cast<ssize_t>(sizeof m) || m.magic != shm_message_magic || (msg.msg_flags & MSG_TRUNC) ||
        m.count > max_batch_segments || m.descriptors > m.count)
        return receive_status::malformed;
    if (msg.msg_flags & MSG_CTRUNC) return receive_status::truncated;
    if (fds.size() != m.descriptors) return receive_status::malformed;
    fds_out = std::move(fds);
    return receive_status::ok;
}

// ---------------------------------------------------------------------------------------------
// Host identity

struct host_identity {
    char boot_id[40] = {};
    std::uint32_t uid = 0;
    std::uint32_t pad = 0;
    std::uint64_t netns = 0;

    static host_identity of_this_process() {
        host_identity id;
        std::ifstream in("/proc/sys/kernel/random/boot_id");
        std::string boot;
        std::getline(in, boot);
        std::strncpy(id.boot_id, boot.c_str(), sizeof id.boot_id - 1);
        id.uid = static_cast<std::uint32_t>(::getuid());
        struct stat st {};
        if (::stat("/proc/self/ns/net", &st) == 0) id.netns = static_cast<std::uint64_t>(st.st_ino);
        return id;
    }
    bool known() const { return boot_id[0] != 0 && netns != 0; }
    bool operator==(const host_identity& o) const {
        return std::memcmp(boot_id, o.boot_id, sizeof boot_id) == 0 && uid == o.uid && netns == o.netns;
    }
};

inline sockaddr_un abstract_address(const std::string& name, socklen_t& length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    addr.sun_path[0] = '\0';
    std::memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof addr.sun_path - 2));
    length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

// ---------------------------------------------------------------------------------------------
// Follower side: the connection to the root, shared by every mapping that reports to it.

class follower_link {
public:
    explicit follower_link(owned_fd sock) : sock_(std::move(sock)) {}

    int socket() const { return sock_.get(); }

    // Called from a storage deleter, on any thread, at any moment: it never waits. What the
    // socket has no room for now stays in a local backlog, sent with the next report or
    // broadcast. A forked child's copy of a batch reports nothing: it has no socket
    // (fork_safety.hpp), and the parent still maps the segment.
    void report(std::uint64_t segment, bool forked) {
        if (::getpid() != owner_) return;  // before the lock: another thread may have held it at the fork
        std::lock_guard<std::mutex> lock(mutex_);
        if (!sock_) return;  // a root that is gone needs no answer
        (forked ? forked_ : released_).push_back(segment);
        flush_locked();
    }

    // At every broadcast: what the backlog holds.
    void flush() {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        flush_locked();
    }

    // At the start of broadcast `sequence`: what the backlog holds, then a report with no ids
    // that names the broadcast - so the root, which may wait for it before it places the batch
    // (same_host_state::await_followers), knows every segment this rank let go of by then. It
    // never waits either: what has no room now goes with the next report or broadcast.
    void arrive(std::uint64_t sequence) {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        arrival_ = sequence;
        flush_locked();
    }

    // After a transport failure or when the same-host path ends: no more reports; the socket
    // closes now, not when the last storage of this group's batches goes.
    void close() {
        if (::getpid() != owner_) return;
        std::lock_guard<std::mutex> lock(mutex_);
        sock_.reset();
        released_.clear();
        forked_.clear();
        arrival_ = 0;
    }

private:
    void flush_locked() {
        for (auto* ids : {&forked_, &released_}) {
            while (!ids->empty()) {
                shm_message m;
                m.kind = ids == &forked_ ? shm_message_kind::forked : shm_message_kind::released;
                m.count = static_cast<std::uint32_t>(std::min(ids->size(), max_batch_segments));
                std::copy(ids->end() - m.count, ids->end(), m.ids);
                const auto status = send_message(sock_.get(), m, {}, std::chrono::milliseconds(-1));
                if (status == send_status::would_block) return;  // the root reads at its next broadcast
                if (status == send_status::failed) {  // the root is gone
                    forked_.clear();
                    released_.clear();
                    arrival_ = 0;
                    return;
                }
                ids->resize(ids->size() - m.count);
            }
        }
        if (arrival_ == 0) return;  // after every id: the root takes it as "all reported"
        shm_message m;
        m.kind = shm_message_kind::released;
        m.sequence = arrival_;
        if (send_message(sock_.get(), m, {}, std::chrono::milliseconds(-1)) != send_status::would_block) arrival_ = 0;
    }

    std::mutex mutex_;
    owned_fd sock_;
    std::vector<std::uint64_t> released_, forked_;
    std::uint64_t arrival_ = 0;  // a start of a broadcast not yet told (arrive)
    const pid_t owner_ = ::getpid();
};

// A follower's private mapping of one segment; unmapped, and reported to the root, when the
// last storage over it goes - as forked when a child forked since may still map it. A host
// leader's mapping of its own pool's segment (`local`) reports to that pool directly.
struct shm_mapping {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::uint64_t segment = 0;
    std::shared_ptr<follower_link> link;
    bool local = false;
    std::uint64_t forks_at_birth = fork_generation();  // read before the segment is mapped

    ~shm_mapping() {
        if (data) ::munmap(data, bytes);
        const bool forked = fork_generation() != forks_at_birth;
        if (link) link->report(segment, forked);
        if (local && forked) shm_pool::instance().forget(segment);
        if (local && !forked) shm_pool::instance().release_follower(segment);
    }
};

// ---------------------------------------------------------------------------------------------
// Root side: one connection per follower, and the segments each one holds.

struct root_link {
    int rank = -1;
    owned_fd sock;
    std::multiset<std::uint64_t> held;  // segments this follower maps (or has not yet answered)
    bool alive = true;
    std::uint64_t arrived = 0;  // the latest broadcast this follower said it started
};

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

// ---------------------------------------------------------------------------------------------
// The handshake

struct handshake_offer {
    std::uint32_t magic = shm_message_magic;
    std::uint32_t root_ok = 0;  // the root can listen and create sealed segments
    host_identity host;
    char name[64] = {};         // abstract socket name
    char why_not[128] = {};
    std::uint32_t transport = 0;  // the root's options.transport
    std::uint32_t relays = 0;     // ranks on other hosts get the payload through their host leader
};

// A follower's answer to the offer, in a broadcast of its own.
struct handshake_answer {
    std::uint8_t connected = 0;  // to its host leader; a leader: it listens on `name`
    std::uint8_t transport = 0;  // this rank's options.transport
    std::uint8_t leads = 0;      // it leads a host other than the root's
    std::uint8_t reserved = 0;
    char why_not[124] = {};
    host_identity host;
    char name[64] = {};          // a host leader's abstract socket name
};
static_assert(sizeof(handshake_answer) == 248);

inline const char* transport_name(transport_mode m) {
    switch (m) {
        case transport_mode::automatic: return "transport_mode::automatic";
        case transport_mode::network: return "transport_mode::network";
        case transport_mode::shared_memory: return "transport_mode::shared_memory";
        case transport_mode::hierarchical: return "transport_mode::hierarchical";
    }
    return "an unknown transport_mode";
}

// Whether this process can create, seal and map a segment at all.
inline std::string probe_segments() {
    std::string why;
    shm_segment s = shm_segment::create(segment_page, why);
    return s ? std::string() : why;
}

inline std::string random_nonce() {
    std::random_device rd;
    static const char* hex = "0123456789abcdef";
    std::string out;
    for (int i = 0; i < 8; ++i) {
        const unsigned v = rd();
        for (int j = 0; j < 4; ++j) out += hex[(v >> (4 * j)) & 15];
    }
    return out;
}

// The root's offer travels as a frame (status same_host_offer) of the usual fixed size: a
// follower may still be receiving keep-alive frames the root sent while it produced its batch
// (keep_alive.hpp), and takes the offer after them as it would take a frame.
inline at::Tensor offer_frame(const handshake_offer& offer, std::uint64_t sequence, int root) {
    at::Tensor first = at::zeros({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    frame_header header;
    header.status = static_cast<std::uint16_t>(frame_status::same_host_offer);
    header.flags = transport_flag(static_cast<transport_mode>(offer.transport));
    header.body_bytes = sizeof offer;
    header.body_checksum = checksum64(&offer, sizeof offer);
    header.sequence = sequence;
    header.root = static_cast<std::uint32_t>(root);
    header.header_checksum = header.compute_checksum();
    std::memcpy(first.data_ptr<std::uint8_t>(), &header, sizeof header);
    std::memcpy(first.data_ptr<std::uint8_t>() + sizeof header, &offer, sizeof offer);
    return first;
}

// The offer inside a first message, if that message is one.
inline std::optional<handshake_offer> offer_in(const at::Tensor& first) {
    const auto* in = first.data_ptr<std::uint8_t>();
    frame_header header;
    std::memcpy(&header, in, sizeof header);
    const bool valid = header.magic == frame_magic && header.header_checksum == header.compute_checksum();
    handshake_offer offer;
    if (!valid || header.status != static_cast<std::uint16_t>(frame_status::same_host_offer) ||
        header.body_bytes != sizeof offer)
        return std::nullopt;
    std::memcpy(&offer, in + sizeof header, sizeof offer);
    if (checksum64(&offer, sizeof offer) != header.body_checksum) return std::nullopt;
    return offer;
}

// A follower's wait for the offer. A root that does not run the handshake now (it broadcasts
// through another object for the same communicator, which has made its own decision, or on a
// transport it is not tracked for) sends its frame instead: that frame is returned in `frame`,
// and this broadcast takes the network path.
template <class Group>
std::optional<handshake_offer> receive_offer(collective<Group>& c, at::Tensor& frame) {
    at::Tensor first = at::empty({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    for (;;) {
        // The first message of the broadcast, whichever it is: named as a frame wait.
        c.run(first, "frame", c.opts().root_wait_or_timeout());
        frame_header header;
        std::memcpy(&header, first.data_ptr<std::uint8_t>(), sizeof header);
        if (is_keep_alive(header)) continue;
        if (auto offer = offer_in(first)) return offer;
        frame = first;  // the root's frame, or a damaged message receive_frame reports
        return std::nullopt;
    }
}

// Root, step 1 (and a host leader elsewhere): a socket in the abstract namespace that the ranks
// of its host connect to; the reason when it cannot be had.
inline std::string listen_for_followers(const host_identity& me, owned_fd& listener, std::string& name) {
    std::string why = me.known() ? probe_segments() : "cannot read this host's identity";
    name = "spbcast-" + random_nonce() + "-" + std::to_string(::getpid());
    if (why.empty()) {
        listener.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
        socklen_t length;
        sockaddr_un addr = abstract_address(name, length);
        if (!listener || ::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0 ||
            ::listen(listener.get(), SOMAXCONN) != 0)
            why = "cannot listen on an abstract Unix socket: " + errno_text(errno);
    }
    if (!why.empty()) listener.reset();
    return why;
}

// Root, step 1: what it offers, and the socket followers connect to. `relays`: it offers the
// hierarchical transport to ranks on other hosts.
inline handshake_offer make_offer(const options& opts, const host_identity& me, bool relays, owned_fd& listener) {
    handshake_offer offer;
    offer.host = me;
    offer.transport = static_cast<std::uint32_t>(opts.transport);
    offer.relays = relays ? 1 : 0;
    std::string name;
    const std::string why = listen_for_followers(me, listener, name);
    offer.root_ok = why.empty() ? 1 : 0;
    std::strncpy(offer.name, name.c_str(), sizeof offer.name - 1);
    std::strncpy(offer.why_not, why.c_str(), sizeof offer.why_not - 1);
    return offer;
}

// Connects to the socket `name` of this rank's host leader and says who it is; the reason
// when it cannot.
inline std::string connect_to_leader(const char* name, std::size_t name_size, const options& opts, int rank,
                                     owned_fd& sock) {
    sock.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
    socklen_t length;
    sockaddr_un addr = abstract_address(std::string(name, strnlen(name, name_size)), length);
    shm_message hello;
    hello.kind = shm_message_kind::hello;
    hello.sequence = static_cast<std::uint64_t>(rank);
    std::string why;
    if (!sock || ::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0)
        why = "cannot connect to its host leader's socket: " + errno_text(errno);
    else if (!send_message(sock.get(), hello, opts.timeout))
        why = "cannot write to its host leader's socket: " + errno_text(errno);
    if (!why.empty()) sock.reset();
    return why;
}

inline std::string other_host_reason(const host_identity& a, const host_identity& b) {
    return std::memcmp(a.boot_id, b.boot_id, sizeof a.boot_id) != 0 ? "another host (boot id differs)"
           : a.uid != b.uid                                        ? "another user"
                                                                   : "another network namespace";
}

// Follower, step 2, in group-rank order: `earlier` holds the answers of the ranks before this
// one. A rank on the root's host connects to the root. On another host, when the root relays,
// the lowest rank of that host leads it (it listens, and says where in its answer) and the
// others connect to their leader.
inline handshake_answer answer_offer(const handshake_offer& offer, const std::vector<handshake_answer>& earlier,
                                     int root, const options& opts, const host_identity& me, int rank,
                                     owned_fd& sock, owned_fd& listener) {
    handshake_answer answer;
    answer.transport = static_cast<std::uint8_t>(opts.transport);
    answer.host = me;
    std::string why;
    if (!offer.root_ok || offer.transport != static_cast<std::uint32_t>(opts.transport)) {
        why = "not asked";
    } else if (offer.host == me) {
        why = connect_to_leader(offer.name, sizeof offer.name, opts, rank, sock);
    } else if (!offer.relays) {
        why = other_host_reason(offer.host, me);
    } else {
        int leader = -1;
        for (int r = 0; r < rank && leader < 0; ++r)
            if (r != root && earlier[static_cast<std::size_t>(r)].host == me) leader = r;
        if (leader < 0) {
            std::string name;
            why = listen_for_followers(me, listener, name);
            answer.leads = why.empty() ? 1 : 0;
            std::strncpy(answer.name, name.c_str(), sizeof answer.name - 1);
        } else if (!earlier[static_cast<std::size_t>(leader)].leads) {
            why = "its host leader (rank " + std::to_string(leader) + ") cannot use shared memory";
        } else {
            const auto& lead = earlier[static_cast<std::size_t>(leader)];
            why = connect_to_leader(lead.name, sizeof lead.name, opts, rank, sock);
        }
    }
    answer.connected = why.empty() ? 1 : 0;
    std::memcpy(answer.why_not, why.data(), std::min(why.size(), sizeof answer.why_not - 1));
    return answer;
}

// Root (or a host leader), step 3: accepts a connection from each of `members` (all
// connected before they said so). Returns the links, or none and the reason.
inline std::vector<root_link> accept_followers(int listener, const std::vector<int>& members,
                                               std::chrono::milliseconds timeout, std::string& why) {
    std::vector<root_link> links;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (std::size_t i = 0; i < members.size(); ++i) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
        pollfd p{listener, POLLIN, 0};
        if (left.count() <= 0 || ::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(left.count(), 10000))) != 1) {
            why = "a follower's connection did not arrive";
            return {};
        }
        owned_fd conn(::accept4(listener, nullptr, nullptr, SOCK_CLOEXEC));
        ucred cred{};
        socklen_t len = sizeof cred;
        shm_message hello;
        std::vector<owned_fd> stray;
        const auto expected = [&](std::uint64_t r) {
            return std::find(members.begin(), members.end(), static_cast<int>(r)) != members.end() &&
                   std::none_of(links.begin(), links.end(), [&](const root_link& l) { return l.rank == static_cast<int>(r); });
        };
        if (!conn || ::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 || cred.uid != ::getuid() ||
            receive_message(conn.get(), hello, stray, timeout) != receive_status::ok ||
            hello.kind != shm_message_kind::hello || !expected(hello.sequence)) {
            why = "a connection to the socket was not a follower of this group";
            return {};
        }
        root_link l;
        l.rank = static_cast<int>(hello.sequence);
        l.sock = std::move(conn);
        links.push_back(std::move(l));
    }
    return links;
}

// The options.transport values that differ from the root's, as the message every rank raises.
inline std::string transport_disagreement(const std::vector<transport_mode>& modes, int root) {
    std::string out;
    for (std::size_t r = 0; r < modes.size(); ++r)
        if (modes[r] != modes[static_cast<std::size_t>(root)])
            out += std::string(out.empty() ? "" : ", ") + transport_name(modes[r]) + " on rank " + std::to_string(r);
    if (out.empty()) return out;
    return "options.transport differs between ranks: " + std::string(transport_name(modes[static_cast<std::size_t>(root)])) +
           " on the root (rank " + std::to_string(root) + "), " + out +
           "; pass the same options.transport on every rank (no batch was sent; the group stays usable)";
}

// automatic's model of the two paths over H hosts, for a payload B much larger than the relay
// chunk C on links of rate b (docs/transports.md): Gloo's broadcast sends every rank its own copy,
// so a host's link carries one copy per rank there, in ceil(log2 ranks) rounds; the chain carries
// one copy per link, all links at once, in (B + (H - 2) C) / b. The chain is ahead wherever a host
// has a second rank (fewer copies over that host's link, shared pages on the root's) and over
// three hosts or more (one copy's time against two rounds or more). With one rank on each of two
// hosts both send the one copy once, and the network path needs no socket or segment.
inline bool relay_is_faster(const std::vector<relay_host>& hosts) {
    return hosts.size() >= 3 ||
           std::any_of(hosts.begin(), hosts.end(), [](const relay_host& h) { return !h.members.empty(); });
}

// The hosts of a group that spans hosts, from the answers every rank holds: the root's host
// first, then the others in the order of their leaders. Empty when the hierarchical transport
// is not taken: every rank on the root's host, or (automatic) where the model above gives the
// network path the lead.
inline std::vector<relay_host> hosts_of(const handshake_offer& offer, const std::vector<handshake_answer>& answers,
                                        int root, std::string& why_not) {
    std::vector<relay_host> hosts{relay_host{root, {}}};
    std::vector<host_identity> identities{offer.host};
    for (int r = 0; r < static_cast<int>(answers.size()); ++r) {
        if (r == root) continue;
        const auto& id = answers[static_cast<std::size_t>(r)].host;
        auto it = std::find(identities.begin(), identities.end(), id);
        if (it == identities.end()) {
            identities.push_back(id);
            hosts.push_back(relay_host{r, {}});
        } else {
            hosts[static_cast<std::size_t>(it - identities.begin())].members.push_back(r);
        }
    }
    if (hosts.size() == 1 || !offer.relays) return {};
    if (offer.transport == static_cast<std::uint32_t>(transport_mode::automatic) && !relay_is_faster(hosts)) {
        why_not = "the group is one rank on each of two hosts, where the relay and the network path send the same "
                  "one copy (transport_mode::automatic takes the network path there; pass "
                  "transport_mode::hierarchical to relay anyway)";
        return {};
    }
    return hosts;
}

// The same-host decision of one (group, root), taken by every rank together from the same data
// in a fixed sequence of broadcasts: the root's offer; each follower's answer (connected or why
// not, its options.transport and its host); then the decision - the root's confirmation once it
// accepted everyone, or, when the group spans hosts and the root relays, each host leader's in
// turn once it accepted its host. A host whose leader could not accept its ranks is split into
// hosts of one rank each. No rank decides by a timeout. Returns null, with the root's first
// frame in `early_frame`, when the root sent its frame instead of an offer (see
// receive_offer); nothing is decided then. A follower that met the offer while it meant to
// take the network path passes it as `offer`. Throws invalid_argument on every rank when the
// ranks' options.transport differ.
template <class Group>
std::shared_ptr<same_host_state> same_host_handshake(Group& group, const options& opts, group_state& gstate,
                                                     std::uint64_t sequence, at::Tensor& early_frame,
                                                     std::optional<handshake_offer> offer = std::nullopt) {
    const int rank = group.getRank(), size = group.getSize(), root = opts.root;
    const host_identity me = host_identity::of_this_process();
    options o = opts;
    auto where = [&] {
        return "spbcast: rank " + std::to_string(rank) + ": broadcast #" + std::to_string(sequence) + " from root " +
               std::to_string(root);
    };

    owned_fd listener;
    if (!offer) {
        collective<Group> c(group, o, gstate, sequence);
        if (rank == root) {
            const bool relays = point_to_point_group<Group> && (opts.transport == transport_mode::automatic ||
                                                                opts.transport == transport_mode::hierarchical);
            offer = make_offer(opts, me, relays, listener);
            c.run(offer_frame(*offer, sequence, root), "same-host handshake: the root's offer");
        } else {
            offer = receive_offer(c, early_frame);
            if (!offer) return nullptr;
        }
    }
    if (offer->magic != shm_message_magic) offer->root_ok = 0;

    owned_fd sock;
    std::vector<handshake_answer> answers(static_cast<std::size_t>(size));
    std::vector<transport_mode> modes(static_cast<std::size_t>(size), static_cast<transport_mode>(offer->transport));
    for (int r = 0; r < size; ++r) {
        if (r == root) continue;
        auto& answer = answers[static_cast<std::size_t>(r)];
        if (r == rank) answer = answer_offer(*offer, answers, root, opts, me, rank, sock, listener);
        at::Tensor flag = at::zeros({static_cast<std::int64_t>(sizeof(handshake_answer))}, at::kByte);
        std::memcpy(flag.data_ptr(), &answer, sizeof answer);
        o.root = r;
        collective<Group> c(group, o, gstate, sequence);
        c.run(flag, "same-host handshake: rank " + std::to_string(r) + "'s answer");
        std::memcpy(&answer, flag.data_ptr(), sizeof answer);
        answer.why_not[sizeof answer.why_not - 1] = 0;
        answer.name[sizeof answer.name - 1] = 0;
        modes[static_cast<std::size_t>(r)] = static_cast<transport_mode>(answer.transport);
    }
    // Every rank holds the same modes now: a disagreement is raised everywhere, before the
    // decision, which nobody then sends.
    if (const std::string disagreement = transport_disagreement(modes, root); !disagreement.empty())
        throw error(errc::invalid_argument, where() + ": " + disagreement);

    auto state = std::make_shared<same_host_state>();
    std::vector<std::string> reasons;
    auto reason = [&](int r, const std::string& why) {
        reasons.push_back((r == root ? "root (rank " + std::to_string(r) + ")" : "rank " + std::to_string(r)) + ": " + why);
    };
    if (!offer->root_ok) reason(root, std::string(offer->why_not, strnlen(offer->why_not, sizeof offer->why_not)));
    std::string network_is_as_fast;
    auto hosts = offer->root_ok ? hosts_of(*offer, answers, root, network_is_as_fast) : std::vector<relay_host>{};
    if (hosts.empty()) {
        // One host (or none relayed): every follower must have connected to the root.
        for (int r = 0; r < size; ++r)
            if (r != root && offer->root_ok && answers[static_cast<std::size_t>(r)].connected != 1)
                reason(r, answers[static_cast<std::size_t>(r)].why_not);
        if (!network_is_as_fast.empty()) reasons.assign(1, network_is_as_fast);
        std::vector<int> followers;
        for (int r = 0; r < size; ++r)
            if (r != root) followers.push_back(r);
        hosts.push_back(relay_host{root, reasons.empty() ? followers : std::vector<int>{}});
    }
    const bool spans_hosts = hosts.size() > 1;
    // Each host leader's decision in turn (on one host: the root's confirmation).
    std::vector<relay_host> decided;
    for (const relay_host& host : hosts) {
        bool connected = host.leader == root ? offer->root_ok == 1 : answers[static_cast<std::size_t>(host.leader)].leads == 1;
        if (!connected && host.leader != root) reason(host.leader, answers[static_cast<std::size_t>(host.leader)].why_not);
        for (int m : host.members)
            if (answers[static_cast<std::size_t>(m)].connected != 1) {
                if (spans_hosts) reason(m, answers[static_cast<std::size_t>(m)].why_not);
                connected = false;
            }
        at::Tensor confirm = at::zeros({1}, at::kByte);
        if (rank == host.leader && connected && !host.members.empty() && (spans_hosts || reasons.empty())) {
            std::string why;
            auto links = accept_followers(listener.get(), host.members, opts.timeout, why);
            if (why.empty()) {
                confirm.data_ptr<std::uint8_t>()[0] = 1;
                state->links = std::move(links);
            } else {
                reason(rank, why);
            }
        }
        o.root = host.leader;
        {
            collective<Group> c(group, o, gstate, sequence);
            c.run(confirm, spans_hosts ? "same-host handshake: rank " + std::to_string(host.leader) + "'s host"
                                       : "same-host handshake: the root's decision");
        }
        if (confirm.data_ptr<std::uint8_t>()[0] == 1) {
            decided.push_back(host);
        } else {
            // Its ranks get the payload one by one; nobody uses the links of this host.
            if (rank == host.leader) state->links.clear();
            decided.push_back(relay_host{host.leader, {}});
            for (int m : host.members) decided.push_back(relay_host{m, {}});
        }
    }
    listener.reset();  // the name disappears; nobody else can connect
    // Across hosts the relay runs even where every rank is alone on its host (each gets the
    // payload into memory of its own); on one host the path needs a follower that maps.
    state->shared = spans_hosts || std::any_of(decided.begin(), decided.end(),
                                               [](const relay_host& h) { return !h.members.empty(); });
    for (const relay_host& host : decided) {
        const bool here = host.leader == rank || std::find(host.members.begin(), host.members.end(), rank) != host.members.end();
        if (here) state->leader = host.leader;
        if (here && host.leader != rank && state->shared) state->link = std::make_shared<follower_link>(std::move(sock));
    }
    if (state->shared) {
        if (spans_hosts) state->hosts = std::move(decided);
    } else {
        state->links.clear();
        if (reasons.empty()) reason(root, "could not accept every follower");
        for (const auto& r : reasons) state->why_not += (state->why_not.empty() ? "" : "; ") + r;
    }
    return state;
}

}  // namespace spbcast::detail
