// The same-host handshake: once per (group, root), a collective over the group that sets up
// one socket (descriptor_socket.hpp) between the root and each follower of its host, or says on
// every rank why not.
//
// - The root listens on a name in the abstract namespace made of a random nonce and its pid;
//   the nonce travels over the group, so only ranks of this group can find it, and nothing has
//   a name in a file system (a SIGKILL leaks nothing; the name vanishes with the socket). The
//   listening socket is closed as soon as every follower is accepted.
// - Who shares a host: boot id, user and network namespace (host_identity.hpp) must match the
//   root's, and the connect must succeed. Every rank states its result and its
//   options.transport in a broadcast of its own, so every rank sees the same answers and takes
//   the same decision - no rank ever decides by a timeout. The root confirms in one last
//   broadcast.
#pragma once

#include "../../error.hpp"
#include "../../options.hpp"
#include "collective.hpp"
#include "death_board.hpp"
#include "descriptor_socket.hpp"
#include "fork_safety.hpp"
#include "../wire/frame.hpp"
#include "follower_links.hpp"
#include "group_state.hpp"
#include "host_identity.hpp"
#include "peer_watch.hpp"
#include "same_host_registry.hpp"
#include "shm_segment.hpp"

#include <ATen/ATen.h>

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

namespace spbcast::detail {

inline sockaddr_un abstract_address(const std::string& name, socklen_t& length) {
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    addr.sun_path[0] = '\0';
    std::memcpy(addr.sun_path + 1, name.data(), std::min(name.size(), sizeof addr.sun_path - 2));
    length = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size());
    return addr;
}

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
static_assert(sizeof(handshake_answer) == 320);

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
// On transport_mode::network it offers no path, only its identity (the peer watch).
inline handshake_offer make_offer(const options& opts, const host_identity& me, bool relays, owned_fd& listener) {
    handshake_offer offer;
    offer.host = me;
    offer.transport = static_cast<std::uint32_t>(opts.transport);
    offer.relays = relays ? 1 : 0;
    std::string name;
    const std::string why = opts.transport == transport_mode::network ? "options.transport = network"
                                                                       : listen_for_followers(me, listener, name);
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

// Every rank of the group on this host is watched from now on (peer_watch.hpp): its death
// wakes this rank's waits on the group at once, and its messages name it; this rank then
// writes the name on the group's death board for the ranks of other hosts (death_board.hpp).
inline void watch_peers_on_this_host(const handshake_offer& offer, const std::vector<handshake_answer>& answers,
                                     int root, int rank, const host_identity& me, group_state& gstate) {
    if (!me.known() || !peer_watch::available()) return;
    for (int r = 0; r < static_cast<int>(answers.size()); ++r) {
        const host_identity& id = r == root ? offer.host : answers[static_cast<std::size_t>(r)].host;
        if (r == rank || !(id == me) || id.pid <= 0 || id.pid == me.pid) continue;
        if (std::find(gstate.peers.begin(), gstate.peers.end(), id.pid) != gstate.peers.end()) continue;
        std::function<void(const std::string&)> tell_other_hosts;
        if (gstate.board)
            tell_other_hosts = [board = gstate.board, who = describe_peer(r, id)](const std::string& how) {
                board->post(who + " " + how);
            };
        if (peer_watch::instance().watch(id.pid, describe_peer(r, id), std::move(tell_other_hosts)))
            gstate.peers.push_back(id.pid);
    }
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
    if (!gstate.board) gstate.board = death_board::of(group);
    watch_peers_on_this_host(*offer, answers, root, rank, me, gstate);
    // Across hosts the relay runs even where every rank is alone on its host (each gets the
    // payload into memory of its own); on one host the path needs a follower that maps.
    state->shared = spans_hosts || std::any_of(decided.begin(), decided.end(),
                                               [](const relay_host& h) { return !h.members.empty(); });
    for (const relay_host& host : decided) {
        const bool here = host.leader == rank || std::find(host.members.begin(), host.members.end(), rank) != host.members.end();
        if (here) state->leader = host.leader;
        if (here && host.leader != rank && state->shared) state->link = std::make_shared<follower_link>(std::move(sock));
    }
    state->watch_only = offer->transport == static_cast<std::uint32_t>(transport_mode::network);
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
