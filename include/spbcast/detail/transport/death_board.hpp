// Where the ranks of one host tell the ranks of other hosts which rank died.
//
// A rank's death is told at once only on its own host (peer_watch.hpp); the ranks of other
// hosts see its sockets close and their backend fails, without a name. The group's rendezvous
// store is shared by every host, and outlives a rank where it is served by the launcher
// (torchrun's agent) or lives in a file: a rank of the dead rank's host that sees the death
// writes its description under one key of the group's own store (the Gloo group's store is
// already prefixed per group), and a rank whose backend failed asks for that key for a moment,
// while it also waits for a death on its own host, before it raises (collective.hpp, fail).
// Nothing is read or written while nobody dies.
//
// A group lends its store where it has one to lend: a c10d ProcessGroup of LibTorch 2.x
// (getStore(): the group's prefixed store, as Python's init_process_group and new_group make
// it), or a ProcessGroupGloo (the c10d store inside its Gloo view of it, GlooStore; where
// LibTorch's headers declare it). The board holds it by a weak reference, so it keeps nothing
// alive: a store gone tells and reads nothing.
//
// The board never waits on the store: a timed-out wait leaves a TCPStore client's connection
// out of step (the server answers that wait later, when the key is set, and the next request
// reads that answer as its own), so later requests of the process could hang. It asks with
// check(), which the server answers at once, and polls.
#pragma once

#include "../base/version.hpp"

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#if !SPBCAST_TORCH_AT_LEAST(2, 0) || defined(USE_C10D_GLOO)
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#define SPBCAST_DEATH_BOARD_GLOO 1
#else
#define SPBCAST_DEATH_BOARD_GLOO 0
#endif

#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

#if SPBCAST_DEATH_BOARD_GLOO
// The c10d store a ProcessGroupGloo wraps in its GlooStore, which is the only store it makes (a
// LibTorch internal: GlooStore's member store_, protected in every version, reached through a
// pointer to member named in a derived class; a cast without RTTI, which would need libgloo).
struct gloo_store_access : c10d::ProcessGroupGloo::GlooStore {
    static c10::intrusive_ptr<c10d::Store> of(::gloo::rendezvous::Store* store) {
        if (!store) return {};
        return static_cast<c10d::ProcessGroupGloo::GlooStore*>(store)->*(&gloo_store_access::store_);
    }
};
#endif

class death_board {
public:
    // The board of `group`, or null where it has none.
    template <class Group>
    static std::shared_ptr<death_board> of(Group& group) {
        using G = std::remove_cvref_t<Group>;
        auto& g = const_cast<G&>(group);
        c10::intrusive_ptr<c10d::Store> store;
        if constexpr (requires { g.getStore(); }) {
            store = g.getStore();
        }
#if SPBCAST_DEATH_BOARD_GLOO
        else if constexpr (std::is_base_of_v<c10d::ProcessGroupGloo, G>) {
            store = gloo_store_access::of(g._getStore().get());
        }
#endif
        if (!store) return nullptr;
        return std::make_shared<death_board>(c10::weak_intrusive_ptr<c10d::Store>(store));
    }

    explicit death_board(c10::weak_intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}

    // Tells the other hosts that a rank died (`death`: "rank 0 (RANK=0, host h1, pid 42)
    // exited: ..."), unless a death is told already: the first is the cause, and a rank that
    // left after its own error (which that death caused) must not take its place. Called by the
    // watch thread; a store that cannot be reached tells nothing.
    void post(const std::string& death) noexcept {
        try {
            if (auto s = store_.lock(); s && !s->check({key})) s->set(key, std::vector<std::uint8_t>(death.begin(), death.end()));
        } catch (...) {
        }
    }

    // The death told so far; empty when none (or the store cannot be reached).
    std::string told() noexcept {
        try {
            auto s = store_.lock();
            if (!s || !s->check({key})) return {};
            const auto v = s->get(key);
            return std::string(v.begin(), v.end());
        } catch (...) {
            return {};
        }
    }

private:
    static constexpr const char* key = "spbcast/peer_death";
    c10::weak_intrusive_ptr<c10d::Store> store_;
};

}  // namespace spbcast::detail
