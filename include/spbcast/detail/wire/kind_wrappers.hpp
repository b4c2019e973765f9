// The kinds that hold one other value: a codec's wire value, an optional, a variant
// (the contract: kind_traits.hpp).
#pragma once

#include "kind_traits.hpp"
#include "type_name.hpp"

#include <concepts>
#include <cstdint>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>

namespace spbcast::detail {

// The wire value that spbcast::codec<T>::to_wire makes of T; followers hand it to from_wire.
template <>
struct kind_traits<kind::custom> {
    template <class T>
    static constexpr bool matches = has_codec<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        static_assert(has_from_wire<T>,
                      "spbcast: this codec<T> has to_wire but no matching from_wire; add "
                      "'static T from_wire(Wire&& wire)' taking to_wire's result type, so followers "
                      "can rebuild T (docs/broadcast.md: 'Teaching spbcast a type').");
        out += type_name<T>();
        out += '=';
        append_schema<wire_type_t<T>>(out);
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return min_wire_bytes<wire_type_t<T>>(); }
    template <class T>
    static void encode(auto& out, const T& v) { out.value(codec<T>::to_wire(v)); }
    template <class T>
    static void decode(auto& in, T& v) {
        if constexpr (has_from_wire<T>) v = make<T>(in);  // else schema's static_assert says why
    }
    template <class T>
    static T make(auto& in) { return codec<T>::from_wire(in.template make<wire_type_t<T>>()); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.check(codec<T>::to_wire(a), codec<T>::to_wire(b), path);
    }
};

// Matches std::optional and a distinct c10::optional (LibTorch 1.x) alike, without naming the
// latter (in LibTorch 2.x it is an alias of std::optional).
template <class T>
concept optional_like = requires(T& value) {
    typename T::value_type;
    { value.has_value() } -> std::same_as<bool>;
    value.reset();
    *value;
    value.emplace();
} && std::is_constructible_v<T, std::nullopt_t> || is_specialization_of<T, std::optional>;

// A u8 presence byte, then the value if present.
template <>
struct kind_traits<kind::optional> {
    template <class T>
    static constexpr bool matches = optional_like<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "optional<";
        append_schema<typename T::value_type>(out);
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return 1; }
    template <class T>
    static void encode(auto& out, const T& v) {
        out.flag(v.has_value());
        if (v.has_value()) out.value(*v);
    }
    template <class T>
    static void decode(auto& in, T& v) {
        if (in.flag())
            v = in.template make<typename T::value_type>();
        else
            v.reset();
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.require(a.has_value() == b.has_value(), path);
        if (a.has_value()) same.check(*a, *b, path);
    }
};

// A u32 alternative index, then the alternative.
template <>
struct kind_traits<kind::variant> {
    template <class T>
    static constexpr bool matches = is_specialization_of<T, std::variant>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "variant<";
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            append_schema_list<std::variant_alternative_t<I, T>...>(out, '|');
        }(std::make_index_sequence<std::variant_size_v<T>>{});
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return 4; }
    template <class T>
    static void encode(auto& out, const T& v) {
        out.index(static_cast<std::uint32_t>(v.index()));
        std::visit([&](const auto& alternative) { out.value(alternative); }, v);
    }
    template <class T>
    static void decode(auto& in, T& v) {
        const std::uint32_t index = in.index();
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            if (index >= sizeof...(I)) in.fail("variant alternative " + std::to_string(index) + " out of range");
            // Emplace the announced alternative, built from the stream.
            (void)((index == I ? (v.template emplace<I>(in.template make<std::variant_alternative_t<I, T>>()), true)
                               : false) ||
                   ...);
        }(std::make_index_sequence<std::variant_size_v<T>>{});
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.require(a.index() == b.index(), path);
        std::visit([&](const auto& x) { same.check(x, std::get<std::remove_cvref_t<decltype(x)>>(b), path); }, a);
    }
};

}  // namespace spbcast::detail
