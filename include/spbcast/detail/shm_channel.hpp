// The same-host channel between a root and its followers: one SOCK_SEQPACKET Unix socket per
// follower, set up once per (group, root) by a collective handshake over the group.
//
// - The root listens on a name in the abstract namespace made of a random nonce and its pid;
//   the nonce travels over the group, so only ranks of this group can find it, and nothing has
//   a name in a file system (a SIGKILL leaks nothing; the name vanishes with the socket). The
//   listening socket is closed as soon as every follower is accepted.
// - Who shares a host: boot id, user and network namespace (an abstract socket lives in one)
//   must match the root's, and the connect must succeed. Every rank states its result in a
//   broadcast of its own, so every rank sees the same flags and takes the same decision - no
//   rank ever decides by a timeout. The root confirms in one last broadcast.
// - Messages: before the frame of a batch the root sends one message with the descriptors of
//   every segment the batch lies in (SCM_RIGHTS) and their ids; a follower answers "released"
//   per segment when the last storage over it is gone.
#pragma once

#include "../error.hpp"
#include "../options.hpp"
#include "collective.hpp"
#include "frame.hpp"
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
enum class shm_message_kind : std::uint32_t { hello = 1, segments = 2, released = 3 };
// The most segments one batch lies in (its own and the leader's shared allocations, see
// shm_allocator.hpp); further shared allocations of a batch are copied into its own segment.
inline constexpr std::size_t max_batch_segments = 32;

struct shm_message {
    std::uint32_t magic = shm_message_magic;
    shm_message_kind kind = shm_message_kind::hello;
    std::uint64_t sequence = 0;  // the broadcast it belongs to (segments), or the rank (hello)
    std::uint64_t segment = 0;   // released: which one
    std::uint32_t count = 0;     // segments: descriptors attached, one per id below
    std::uint32_t reserved = 0;
    std::uint64_t ids[max_batch_segments] = {};
};
static_assert(sizeof(shm_message) == 32 + 8 * max_batch_segments);

// Sends `m` with `fds` attached. Never raises SIGPIPE.
inline bool send_message(int sock, const shm_message& m, const std::vector<int>& fds = {}) {
    iovec iov{const_cast<shm_message*>(&m), sizeof m};
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    alignas(cmsghdr) char control[CMSG_SPACE(sizeof(int) * max_batch_segments)] = {};
    if (!fds.empty()) {
        if (fds.size() > max_batch_segments) return false;
        msg.msg_control = control;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * fds.size());
        cmsghdr* c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * fds.size());
        std::memcpy(CMSG_DATA(c), fds.data(), sizeof(int) * fds.size());
    }
    for (;;) {
        const ssize_t n = ::sendmsg(sock, &msg, MSG_NOSIGNAL);
        if (n == static_cast<ssize_t>(sizeof m)) return true;
        if (n < 0 && errno == EINTR) continue;
        return false;
    }
}

enum class receive_status { ok, closed, timed_out, malformed };

// Receives one message within `timeout` (negative: do not wait). Every descriptor that arrives
// is either returned in `fds` (as many as the message counts) or closed here, so nothing a peer
// sends can leak.
inline receive_status receive_message(int sock, shm_message& m, std::vector<unique_fd>& fds_out,
                                      std::chrono::milliseconds timeout) {
    fds_out.clear();
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
    std::vector<int> fds;
    for (cmsghdr* c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS) continue;
        const std::size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (std::size_t i = 0; i < count; ++i) {
            int received;
            std::memcpy(&received, CMSG_DATA(c) + i * sizeof(int), sizeof received);
            fds.push_back(received);
        }
    }
    auto close_all = [&] {
        for (int f : fds) ::close(f);
    };
    if (n == 0) {
        close_all();
        return receive_status::closed;
    }
    if (n != static_cast<ssize_t>(sizeof m) || m.magic != shm_message_magic ||
        (msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || fds.size() != m.count) {
        close_all();
        return n < 0 ? receive_status::closed : receive_status::malformed;
    }
    for (int f : fds) fds_out.emplace_back(f);
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
    explicit follower_link(unique_fd sock) : sock_(std::move(sock)) {}

    int socket() const { return sock_.get(); }

    // Called from a storage deleter, on any thread. A root that is gone needs no answer, and
    // neither does a forked child's copy of a batch: the parent still maps the segment.
    void report_released(std::uint64_t segment) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!sock_ || ::getpid() != owner_) return;
        shm_message m;
        m.kind = shm_message_kind::released;
        m.segment = segment;
        send_message(sock_.get(), m);
    }

    // After a transport failure: no more reports; the socket closes now, not when the last
    // storage of this group's batches goes.
    void close() {
        std::lock_guard<std::mutex> lock(mutex_);
        sock_.reset();
    }

private:
    std::mutex mutex_;
    unique_fd sock_;
    const pid_t owner_ = ::getpid();
};

// A follower's private mapping of one segment; unmapped, and reported to the root, when the
// last storage over it goes.
struct shm_mapping {
    void* data = nullptr;
    std::size_t bytes = 0;
    std::uint64_t segment = 0;
    std::shared_ptr<follower_link> link;

    ~shm_mapping() {
        if (data) ::munmap(data, bytes);
        if (link) link->report_released(segment);
    }
};

// ---------------------------------------------------------------------------------------------
// Root side: one connection per follower, and the segments each one holds.

struct root_link {
    int rank = -1;
    unique_fd sock;
    std::multiset<std::uint64_t> held;  // segments this follower maps (or has not yet answered)
    bool alive = true;
};

// What one rank knows about the same-host path of one (group, root).
struct same_host_state {
    bool shared = false;       // the handshake chose the same-host path
    std::string why_not;       // when not: the reasons, for transport_mode::shared_memory
    // Root:
    std::vector<root_link> links;
    // Follower:
    std::shared_ptr<follower_link> link;

    // Reads every "released" message waiting on the root's sockets. A follower whose socket
    // closed has died: its segments are never written again (orphaned).
    void collect_releases() {
        auto& pool = shm_pool::instance();
        for (root_link& l : links) {
            while (l.alive) {
                shm_message m;
                std::vector<unique_fd> stray;
                const auto status = receive_message(l.sock.get(), m, stray, std::chrono::milliseconds(-1));
                if (status == receive_status::timed_out) break;
                if (status != receive_status::ok || m.kind != shm_message_kind::released) {
                    drop_link(l);
                    break;
                }
                auto it = l.held.find(m.segment);
                if (it == l.held.end()) continue;
                l.held.erase(it);
                pool.release(m.segment);
            }
        }
    }

    void drop_link(root_link& l) {
        auto& pool = shm_pool::instance();
        for (std::uint64_t id : l.held) pool.orphan(id);
        l.held.clear();
        l.sock.reset();
        l.alive = false;
    }

    // After a transport failure: every socket closes, every segment still mapped elsewhere is
    // forgotten.
    void tear_down() {
        for (root_link& l : links) drop_link(l);
        if (link) link->close();
        link.reset();
        shared = false;
    }

    ~same_host_state() {
        for (root_link& l : links) drop_link(l);
        if (link) link->close();
    }
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
        s->tear_down();
        if (last) shm_pool::instance().release_free();
    }
    void drop_all() {
        std::map<std::pair<const void*, int>, entry> states;
        {
            std::lock_guard<std::mutex> lock(mutex_);
            states.swap(states_);
        }
        for (auto& [key, e] : states) e.state->tear_down();
        shm_pool::instance().release_free();
    }

private:
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
        for (auto& e : dead) e.state->tear_down();
        if (last) shm_pool::instance().release_free();
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
};

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
    header.body_bytes = sizeof offer;
    header.body_checksum = checksum64(&offer, sizeof offer);
    header.sequence = sequence;
    header.root = static_cast<std::uint32_t>(root);
    header.header_checksum = header.compute_checksum();
    std::memcpy(first.data_ptr<std::uint8_t>(), &header, sizeof header);
    std::memcpy(first.data_ptr<std::uint8_t>() + sizeof header, &offer, sizeof offer);
    return first;
}

// A follower's wait for the offer. A root that does not run the handshake now (it broadcasts
// through another object for the same communicator, which has made its own decision) sends its
// frame instead: that frame is returned in `frame`, and this broadcast takes the network path.
template <class Group>
std::optional<handshake_offer> receive_offer(collective<Group>& c, at::Tensor& frame) {
    at::Tensor first = at::empty({static_cast<std::int64_t>(inline_frame_bytes)}, at::kByte);
    const auto* in = first.data_ptr<std::uint8_t>();
    frame_header header;
    for (;;) {
        c.run(first, "same-host handshake: the root's offer", c.opts().root_wait_or_timeout());
        std::memcpy(&header, in, sizeof header);
        const bool valid = header.magic == frame_magic && header.header_checksum == header.compute_checksum();
        if (valid && header.status == static_cast<std::uint16_t>(frame_status::keep_alive) && header.body_bytes == 0)
            continue;
        handshake_offer offer;
        if (valid && header.status == static_cast<std::uint16_t>(frame_status::same_host_offer) &&
            header.body_bytes == sizeof offer) {
            std::memcpy(&offer, in + sizeof header, sizeof offer);
            if (checksum64(&offer, sizeof offer) == header.body_checksum) return offer;
        }
        frame = first;  // the root's frame, or a damaged message receive_frame reports
        return std::nullopt;
    }
}

// Returns null, with the root's first frame in `early_frame`, when the root sent its frame
// instead of an offer (see receive_offer); nothing is decided then.
template <class Group>
std::shared_ptr<same_host_state> same_host_handshake(Group& group, const options& opts, group_state& gstate,
                                                     std::uint64_t sequence, at::Tensor& early_frame) {
    const int rank = group.getRank(), size = group.getSize(), root = opts.root;
    auto state = std::make_shared<same_host_state>();
    const host_identity me = host_identity::of_this_process();

    // 1. The root's offer.
    unique_fd listener;
    handshake_offer offer;
    if (rank == root) {
        offer.host = me;
        std::string why = me.known() ? probe_segments() : "cannot read this host's identity";
        const std::string name = "spbcast-" + random_nonce() + "-" + std::to_string(::getpid());
        if (why.empty()) {
            listener.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
            socklen_t length;
            sockaddr_un addr = abstract_address(name, length);
            if (!listener || ::bind(listener.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0 ||
                ::listen(listener.get(), SOMAXCONN) != 0)
                why = "cannot listen on an abstract Unix socket: " + errno_text(errno);
        }
        offer.root_ok = why.empty() ? 1 : 0;
        std::strncpy(offer.name, name.c_str(), sizeof offer.name - 1);
        std::strncpy(offer.why_not, why.c_str(), sizeof offer.why_not - 1);
    }
    options o = opts;
    {
        collective<Group> c(group, o, gstate, sequence);
        if (rank == root) {
            c.run(offer_frame(offer, sequence, root), "same-host handshake: the root's offer");
        } else {
            auto received = receive_offer(c, early_frame);
            if (!received) return nullptr;
            offer = *received;
        }
    }

    std::vector<std::string> reasons;
    if (offer.magic != shm_message_magic || !offer.root_ok)
        reasons.push_back("root (rank " + std::to_string(root) + "): " +
                          std::string(offer.why_not, strnlen(offer.why_not, sizeof offer.why_not)));

    // 2. Each follower connects and says whether it could, in a broadcast of its own.
    unique_fd sock;
    std::string my_why;
    if (rank != root && offer.root_ok) {
        if (!(offer.host == me)) {
            my_why = std::memcmp(offer.host.boot_id, me.boot_id, sizeof me.boot_id) != 0 ? "another host (boot id differs)"
                     : offer.host.uid != me.uid ? "another user"
                                                : "another network namespace";
        } else {
            sock.reset(::socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0));
            socklen_t length;
            sockaddr_un addr = abstract_address(std::string(offer.name, strnlen(offer.name, sizeof offer.name)), length);
            shm_message hello;
            hello.kind = shm_message_kind::hello;
            hello.sequence = static_cast<std::uint64_t>(rank);
            if (!sock || ::connect(sock.get(), reinterpret_cast<sockaddr*>(&addr), length) != 0) {
                my_why = "cannot connect to the root's socket: " + errno_text(errno);
                sock.reset();
            } else if (!send_message(sock.get(), hello)) {
                my_why = "cannot write to the root's socket: " + errno_text(errno);
                sock.reset();
            }
        }
    }
    for (int r = 0; r < size; ++r) {
        if (r == root) continue;
        at::Tensor flag = at::zeros({128}, at::kByte);
        if (r == rank) {
            auto* p = flag.data_ptr<std::uint8_t>();
            p[0] = sock ? 1 : 0;
            std::memcpy(p + 1, my_why.data(), std::min<std::size_t>(my_why.size(), 126));
        }
        o.root = r;
        collective<Group> c(group, o, gstate, sequence);
        c.run(flag, "same-host handshake: rank " + std::to_string(r) + "'s answer");
        const auto* p = flag.data_ptr<std::uint8_t>();
        if (p[0] != 1 && offer.root_ok)
            reasons.push_back("rank " + std::to_string(r) + ": " +
                              std::string(reinterpret_cast<const char*>(p + 1), strnlen(reinterpret_cast<const char*>(p + 1), 126)));
    }

    // 3. The root accepts every follower (all connected before they said so) and confirms.
    at::Tensor confirm = at::zeros({1}, at::kByte);
    if (rank == root && reasons.empty()) {
        std::vector<root_link> links;
        std::string why;
        for (int i = 0; i < size - 1 && why.empty(); ++i) {
            pollfd p{listener.get(), POLLIN, 0};
            if (::poll(&p, 1, static_cast<int>(std::min<std::int64_t>(opts.timeout.count(), 10000))) != 1) {
                why = "a follower's connection did not arrive";
                break;
            }
            unique_fd conn(::accept4(listener.get(), nullptr, nullptr, SOCK_CLOEXEC));
            ucred cred{};
            socklen_t len = sizeof cred;
            shm_message hello;
            std::vector<unique_fd> stray;
            if (!conn || ::getsockopt(conn.get(), SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0 ||
                cred.uid != ::getuid() ||
                receive_message(conn.get(), hello, stray, std::chrono::milliseconds(10000)) != receive_status::ok ||
                hello.kind != shm_message_kind::hello || hello.sequence >= static_cast<std::uint64_t>(size) ||
                static_cast<int>(hello.sequence) == root ||
                std::any_of(links.begin(), links.end(), [&](const root_link& l) { return l.rank == static_cast<int>(hello.sequence); })) {
                why = "a connection to the root's socket was not a follower of this group";
                break;
            }
            root_link l;
            l.rank = static_cast<int>(hello.sequence);
            l.sock = std::move(conn);
            links.push_back(std::move(l));
        }
        if (why.empty()) {
            state->links = std::move(links);
            confirm.data_ptr<std::uint8_t>()[0] = 1;
        } else {
            reasons.push_back("root (rank " + std::to_string(root) + "): " + why);
        }
    }
    listener.reset();  // the name disappears; nobody else can connect
    o.root = root;
    {
        collective<Group> c(group, o, gstate, sequence);
        c.run(confirm, "same-host handshake: the root's decision");
    }
    state->shared = confirm.data_ptr<std::uint8_t>()[0] == 1;
    if (state->shared) {
        if (rank != root) state->link = std::make_shared<follower_link>(std::move(sock));
    } else {
        state->links.clear();
        if (reasons.empty()) reasons.push_back("root (rank " + std::to_string(root) + "): could not accept every follower");
        for (const auto& r : reasons) state->why_not += (state->why_not.empty() ? "" : "; ") + r;
    }
    return state;
}

}  // namespace spbcast::detail
