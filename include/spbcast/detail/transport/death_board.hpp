// Where the ranks of one host tell the ranks of other hosts which rank died.
//
// A rank's death is told at once only on its own host (peer_watch.hpp); the ranks of other
// hosts see its sockets close and their backend fails, without a name. The group's rendezvous
// store is shared by every host, and outlives a rank where it is served by the launcher
// (torchrun's agent) or lives in a file: a rank of the dead rank's host that sees the death
// writes its description under one key of the group's own store (the Gloo group's store is
// already prefixed per group), and a rank whose backend failed without a death on its own host
// waits for that key briefly before it raises, naming the dead rank. Nothing is read or written
// while nobody dies.
//
// A group lends its store where it has one to lend: a c10d ProcessGroup of LibTorch 2.x
// (getStore(): the group's prefixed store, as Python's init_process_group and new_group make
// it), or a ProcessGroupGloo held by a c10::intrusive_ptr (its Gloo view of the store; where
// LibTorch's headers declare it). Either is held by a weak reference, so the board keeps
// nothing alive: a store or group gone tells and reads nothing.
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

#include <chrono>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace spbcast::detail {

class death_board {
public:
    // The board of `group`, or null where it has none.
    template <class Group>
    static std::shared_ptr<death_board> of(Group& group) {
        using G = std::remove_cvref_t<Group>;
        auto& g = const_cast<G&>(group);
        if constexpr (requires { g.getStore(); }) {
            auto store = g.getStore();
            if (!store) return nullptr;
            c10::weak_intrusive_ptr<c10d::Store> weak(store);
            return std::make_shared<death_board>(
                [weak](const std::vector<std::uint8_t>& v) {
                    if (auto s = weak.lock()) s->set(key, v);
                },
                [weak](std::chrono::milliseconds wait) -> std::vector<std::uint8_t> {
                    auto s = weak.lock();
                    if (!s) return {};
                    s->wait({key}, wait);
                    return s->get(key);
                });
        }
#if SPBCAST_DEATH_BOARD_GLOO
        else if constexpr (std::is_base_of_v<c10d::ProcessGroupGloo, G>) {
            if (c10::raw::intrusive_ptr::use_count(&g) == 0) return nullptr;  // not held by an intrusive_ptr
            c10::weak_intrusive_ptr<c10d::ProcessGroupGloo> weak(
                c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&g));
            return std::make_shared<death_board>(
                [weak](const std::vector<std::uint8_t>& v) {
                    if (auto pg = weak.lock()) pg->_getStore()->set(key, std::vector<char>(v.begin(), v.end()));
                },
                [weak](std::chrono::milliseconds wait) -> std::vector<std::uint8_t> {
                    auto pg = weak.lock();
                    if (!pg) return {};
                    pg->_getStore()->wait({key}, wait);
                    const auto v = pg->_getStore()->get(key);
                    return {v.begin(), v.end()};
                });
        }
#endif
        else {
            return nullptr;
        }
    }

    death_board(std::function<void(const std::vector<std::uint8_t>&)> set,
                std::function<std::vector<std::uint8_t>(std::chrono::milliseconds)> wait_and_get)
        : set_(std::move(set)), wait_and_get_(std::move(wait_and_get)) {}

    // Tells the other hosts that a rank died (`death`: "rank 0 (RANK=0, host h1, pid 42)
    // exited: ..."). Called by the watch thread; a store that cannot be reached tells nothing.
    void post(const std::string& death) noexcept {
        try {
            set_(std::vector<std::uint8_t>(death.begin(), death.end()));
        } catch (...) {
        }
    }

    // The death another host told, waiting up to `wait` for it; empty when none came.
    std::string read(std::chrono::milliseconds wait) noexcept {
        try {
            const auto v = wait_and_get_(wait);
            return std::string(v.begin(), v.end());
        } catch (...) {
            return {};
        }
    }

private:
    static constexpr const char* key = "spbcast/peer_death";
    std::function<void(const std::vector<std::uint8_t>&)> set_;
    std::function<std::vector<std::uint8_t>(std::chrono::milliseconds)> wait_and_get_;
};

}  // namespace spbcast::detail
