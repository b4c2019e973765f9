// The tuple kind: std::pair and std::tuple, sent as their elements in order with no count (the
// contract: kind_traits.hpp). Plain standard types, so this stays in the reflection-free core.
#pragma once

#include "kind_traits.hpp"

#include <cstddef>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>

namespace spbcast::detail {

template <class T>
concept tuple_like = is_specialization_of<T, std::tuple> || is_specialization_of<T, std::pair>;

template <>
struct kind_traits<kind::tuple> {
    template <class T>
    static constexpr bool matches = tuple_like<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "tuple<";
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            append_schema_list<std::tuple_element_t<I, T>...>(out, ',');
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() {
        return []<std::size_t... I>(std::index_sequence<I...>) {
            return (std::size_t{0} + ... + min_wire_bytes<std::tuple_element_t<I, T>>());
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
    template <class T>
    static void encode(auto& out, const T& v) {
        std::apply([&](const auto&... elements) { (out.value(elements), ...); }, v);
    }
    template <class T>
    static void decode(auto& in, T& v) {
        std::apply([&](auto&... elements) { (in.value(elements), ...); }, v);
    }
    // A braced initializer evaluates its elements left to right, the wire's order.
    template <class T>
    static T make(auto& in) {
        return [&]<std::size_t... I>(std::index_sequence<I...>) {
            return T{in.template make<std::tuple_element_t<I, T>>()...};
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        [&]<std::size_t... I>(std::index_sequence<I...>) {
            (same.check(std::get<I>(a), std::get<I>(b), path + "." + std::to_string(I)), ...);
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    }
};

}  // namespace spbcast::detail
