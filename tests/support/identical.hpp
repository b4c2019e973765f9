// Bit-exact comparison of a follower's value with the root's: values (as bits), dtypes,
// sizes, strides, requires_grad, conj/neg, absent optionals, empty containers, and the
// aliasing structure (same tensor object, shared storage, relative offsets).
#pragma once

#include <spbcast/broadcast.hpp>

#include <doctest/doctest.h>

#include <cstring>
#include <string>
#include <vector>

namespace spbcast_test {

// The bytes a tensor's elements occupy, in logical order, read as raw bits.
inline std::vector<std::uint8_t> tensor_bits(const at::Tensor& t) {
    if (t.numel() == 0) return {};
    at::Tensor raw = spbcast::detail::raw_bits_view(t.storage(), t.scalar_type(), t.storage_offset(),
                                                    t.sizes().vec(), t.strides().vec())
                         .contiguous();
    const auto* p = static_cast<const std::uint8_t*>(raw.data_ptr());
    return {p, p + raw.numel() * raw.element_size()};
}

class identical_checker {
public:
    // Compares as T's kind says (spbcast/detail/wire/kinds.hpp), through expect, require, check,
    // tensor and ivalue below.
    template <class T>
    void check(const T& a, const T& b, const std::string& path = "batch") {
        using namespace spbcast::detail;
        kind_traits<kind_v<T>>::compare(*this, a, b, path);
    }

    void expect(bool same, const std::string& path) { CHECK_MESSAGE(same, path); }
    void require(bool same, const std::string& path) { REQUIRE_MESSAGE(same, path); }

    // After check(): the tensors seen on each side must alias each other the same way.
    void check_structure() const {
        REQUIRE(root_.size() == follower_.size());
        for (std::size_t i = 0; i < root_.size(); ++i) {
            for (std::size_t j = i + 1; j < root_.size(); ++j) {
                const at::Tensor &ai = root_[i], &aj = root_[j], &bi = follower_[i], &bj = follower_[j];
                if (!ai.defined() || !aj.defined()) continue;
                const std::string where = paths_[i] + " vs " + paths_[j];
                CHECK_MESSAGE(bool(ai.is_same(aj) == bi.is_same(bj)), std::string("aliasing: " + where));
                const bool shared_a = ai.storage().is_alias_of(aj.storage());
                CHECK_MESSAGE(bool(shared_a == bi.storage().is_alias_of(bj.storage())),
                              std::string("shared storage: " + where));
                if (shared_a && ai.numel() > 0 && aj.numel() > 0)
                    CHECK_MESSAGE(bool(byte_offset(ai) - byte_offset(aj) == byte_offset(bi) - byte_offset(bj)),
                                  std::string("relative offset: " + where));
            }
        }
    }

    std::size_t tensors_checked() const { return root_.size(); }

    void tensor(const at::Tensor& a, const at::Tensor& b, const std::string& path) {
        root_.push_back(a);
        follower_.push_back(b);
        paths_.push_back(path);
        REQUIRE_MESSAGE(bool(a.defined() == b.defined()), path);
        if (!a.defined()) return;
        CHECK_MESSAGE(bool(a.scalar_type() == b.scalar_type()), path);
        CHECK_MESSAGE(bool(a.sizes().vec() == b.sizes().vec()), path);
        CHECK_MESSAGE(bool(a.strides().vec() == b.strides().vec()), path);
        CHECK_MESSAGE(bool(a.requires_grad() == b.requires_grad()), path);
        CHECK_MESSAGE(bool(a.is_conj() == b.is_conj()), path);
        CHECK_MESSAGE(bool(a.is_neg() == b.is_neg()), path);
        CHECK_MESSAGE(bool(b.device().is_cpu()), path);
        CHECK_MESSAGE(bool(tensor_bits(a) == tensor_bits(b)), std::string("bits of " + path));
    }

    void ivalue(const c10::IValue& a, const c10::IValue& b, const std::string& path) {
        REQUIRE_MESSAGE(bool(a.tagKind() == b.tagKind()), std::string(path + ": " + a.tagKind() + " vs " + b.tagKind()));
        if (a.isTensor()) return tensor(a.toTensor(), b.toTensor(), path);
        if (a.isDouble()) {
            const double x = a.toDouble(), y = b.toDouble();
            CHECK_MESSAGE(bool(std::memcmp(&x, &y, sizeof x) == 0), path);
            return;
        }
        if (a.isTensorList()) {
            const auto la = a.toTensorList(), lb = b.toTensorList();
            REQUIRE(la.size() == lb.size());
            for (std::size_t i = 0; i < la.size(); ++i) tensor(la.get(i), lb.get(i), path);
            return;
        }
        if (a.isList()) {
            const auto la = a.toList(), lb = b.toList();
            REQUIRE_MESSAGE(bool(la.size() == lb.size()), path);
            CHECK_MESSAGE(bool(*la.elementType() == *lb.elementType()), std::string(path + " element type"));
            for (std::size_t i = 0; i < la.size(); ++i)
                ivalue(la.get(i), lb.get(i), path + "[" + std::to_string(i) + "]");
            return;
        }
        if (a.isGenericDict()) {
            const auto da = a.toGenericDict(), db = b.toGenericDict();
            REQUIRE_MESSAGE(bool(da.size() == db.size()), path);
            CHECK_MESSAGE(bool(*da.keyType() == *db.keyType()), std::string(path + " key type"));
            CHECK_MESSAGE(bool(*da.valueType() == *db.valueType()), std::string(path + " value type"));
            auto ib = db.begin();
            for (auto ia = da.begin(); ia != da.end(); ++ia, ++ib) {
                ivalue(ia->key(), ib->key(), path + "{key}");
                ivalue(ia->value(), ib->value(), path + "{value}");
            }
            return;
        }
        if (a.isTuple()) {
            const auto& ea = a.toTuple()->elements();
            const auto& eb = b.toTuple()->elements();
            REQUIRE_MESSAGE(bool(ea.size() == eb.size()), path);
            for (std::size_t i = 0; i < ea.size(); ++i)
                ivalue(ea[i], eb[i], path + "(" + std::to_string(i) + ")");
            return;
        }
        CHECK_MESSAGE(bool(a == b), path);  // None, int, bool, string, int/double/bool lists
    }

private:
    static std::int64_t byte_offset(const at::Tensor& t) { return t.storage_offset() * t.element_size(); }

    std::vector<at::Tensor> root_, follower_;
    std::vector<std::string> paths_;
};

template <class T>
void require_identical(const T& root, const T& follower) {
    identical_checker checker;
    checker.check(root, follower);
    checker.check_structure();
}

}  // namespace spbcast_test
