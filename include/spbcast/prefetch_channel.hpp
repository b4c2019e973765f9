// The prefetch channel: a second Gloo group over the ranks of an SP group, used by a
// leader_loader's prefetch thread only. A c10d group runs its collectives in the order each rank
// issues them; two threads issuing collectives on one group (the trainer's all-reduce, the
// prefetch's broadcast) would issue them in an order that differs from rank to rank, so the
// prefetch needs a group of its own.
//
// spbcast makes one itself from the SP group's own rendezvous store where the SP group is (or,
// with LibTorch 2.x, has as its CPU backend) a ProcessGroupGloo held by a c10::intrusive_ptr;
// elsewhere pass one in loader_config::prefetch_channel (docs/loader.md shows how).
#pragma once

#include "detail/base/version.hpp"
#include "dist.hpp"
#include "error.hpp"
#include "group.hpp"

#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <string>
#include <type_traits>
#include <utility>

namespace spbcast {
namespace detail {

// The ProcessGroupGloo behind a group argument, or null and why not. Only a group that lives in
// a c10::intrusive_ptr can lend its store: the channel keeps the SP group alive through it.
template <class Group>
std::pair<c10::intrusive_ptr<c10d::ProcessGroupGloo>, std::string> gloo_behind(Group& group) {
    auto& g = group_of(group);
    using G = std::remove_cvref_t<decltype(g)>;
    c10d::ProcessGroupGloo* gloo = nullptr;
    if constexpr (std::is_base_of_v<c10d::ProcessGroupGloo, G>) {
        gloo = const_cast<G*>(&g);
#if SPBCAST_TORCH_AT_LEAST(2, 0)
    } else if constexpr (std::is_base_of_v<c10d::ProcessGroup, G>) {
        try {
            gloo = dynamic_cast<c10d::ProcessGroupGloo*>(
                const_cast<G&>(g).getBackend(c10::DeviceType::CPU).get());
        } catch (const std::exception&) {
            gloo = nullptr;  // no CPU backend
        }
#else
    } else if constexpr (std::is_base_of_v<c10d::ProcessGroup, G>) {
        gloo = dynamic_cast<c10d::ProcessGroupGloo*>(const_cast<G*>(&g));
#endif
    }
    if (!gloo)
        return {c10::intrusive_ptr<c10d::ProcessGroupGloo>(), "the SP group is not a Gloo group (a transport of your own, or a backend "
                         "other than Gloo for CPU tensors); set loader_config::prefetch_channel to "
                         "a second Gloo group over the same ranks"};
    if (c10::raw::intrusive_ptr::use_count(gloo) == 0)
        return {c10::intrusive_ptr<c10d::ProcessGroupGloo>(), "the SP group's ProcessGroupGloo is not held by a c10::intrusive_ptr; "
                         "set loader_config::prefetch_channel"};
    return {c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(gloo), {}};
}

#if !SPBCAST_TORCH_AT_LEAST(2, 0)
// LibTorch 1.13's ProcessGroupGloo keeps only Gloo's view of its store (set, get, wait): a
// c10d::Store over that view, enough for a new group's rendezvous (which uses only those three).
// It holds the SP group, whose store it reads.
class gloo_store_view final : public c10d::Store {
public:
    explicit gloo_store_view(c10::intrusive_ptr<c10d::ProcessGroupGloo> owner) : owner_(std::move(owner)) {}
    void set(const std::string& key, const std::vector<std::uint8_t>& value) override {
        store().set(key, std::vector<char>(value.begin(), value.end()));
    }
    std::vector<std::uint8_t> get(const std::string& key) override {
        const auto value = store().get(key);
        return {value.begin(), value.end()};
    }
    void wait(const std::vector<std::string>& keys) override { store().wait(keys); }
    void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
        store().wait(keys, timeout);
    }
    std::int64_t add(const std::string&, std::int64_t) override { unsupported("add"); }
    bool deleteKey(const std::string&) override { unsupported("deleteKey"); }
    bool check(const std::vector<std::string>&) override { unsupported("check"); }
    std::int64_t getNumKeys() override { unsupported("getNumKeys"); }

private:
    ::gloo::rendezvous::Store& store() { return *owner_->_getStore(); }
    [[noreturn]] static void unsupported(const char* what) {
        throw error(errc::invalid_argument, std::string("spbcast: the prefetch channel's store view has no ") +
                                                what + "; pass loader_config::prefetch_channel");
    }
    c10::intrusive_ptr<c10d::ProcessGroupGloo> owner_;
};
#endif

}  // namespace detail

// A second Gloo group over the ranks of `sp_group`, with its devices and timeout, rendezvoused
// under `key` in the SP group's own store. Collective: every rank of the SP group calls it with
// the same key, one the store has not seen (leader_loader sends a fresh one from the SP leader).
inline c10::intrusive_ptr<c10d::ProcessGroupGloo> make_prefetch_channel(
    const c10::intrusive_ptr<c10d::ProcessGroupGloo>& sp_group, const std::string& key) {
    const auto& own = sp_group->getOptions();
    auto options = c10d::ProcessGroupGloo::Options::create(own->timeout);
    options->devices = own->devices;
    options->threads = own->threads;
#if SPBCAST_TORCH_AT_LEAST(2, 0)
    // ProcessGroupGloo's constructor wraps the c10d store it is given in a GlooStore, its only
    // kind of store_. A static_cast: LibTorch's wheels do not export Gloo's type information,
    // which a dynamic_cast would need.
    auto* view = static_cast<c10d::ProcessGroupGloo::GlooStore*>(sp_group->_getStore().get());
    c10::intrusive_ptr<c10d::Store> store = view->_getStore();
#else
    c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<detail::gloo_store_view>(sp_group);
#endif
    dist::ignore_sigpipe_if_default();
    return c10::make_intrusive<c10d::ProcessGroupGloo>(c10::make_intrusive<c10d::PrefixStore>(key, store),
                                                       sp_group->getRank(), sp_group->getSize(), options);
}

}  // namespace spbcast
