// Uniform access to the fields of a Hana Struct (named) and of a PFR aggregate (positional).
#pragma once

#include <boost/hana/accessors.hpp>
#include <boost/hana/at.hpp>
#include <boost/hana/concept/struct.hpp>
#include <boost/hana/first.hpp>
#include <boost/hana/length.hpp>
#include <boost/hana/second.hpp>
#include <boost/hana/string.hpp>
#include <boost/pfr/core.hpp>
#include <boost/pfr/tuple_size.hpp>

#include <cstddef>
#include <string_view>
#include <type_traits>
#include <utility>

namespace spbcast::detail {

template <class T>
inline constexpr bool is_hana_struct = boost::hana::Struct<T>::value;

template <class T>
constexpr std::size_t field_count() {
    if constexpr (is_hana_struct<T>)
        return decltype(boost::hana::length(boost::hana::accessors<T>()))::value;
    else
        return boost::pfr::tuple_size_v<T>;
}

template <std::size_t I, class T>
constexpr decltype(auto) field(T& value) {
    if constexpr (is_hana_struct<std::remove_const_t<T>>)
        return boost::hana::second(
            boost::hana::at_c<I>(boost::hana::accessors<std::remove_const_t<T>>()))(value);
    else
        return boost::pfr::get<I>(value);
}

template <class T, std::size_t I>
using field_type_t = std::remove_cvref_t<decltype(field<I>(std::declval<T&>()))>;

// Hana fields have names; PFR fields are known by position only (Boost < 1.84 has no names).
template <class T, std::size_t I>
constexpr std::string_view field_name() {
    if constexpr (is_hana_struct<T>)
        return boost::hana::to<char const*>(
            boost::hana::first(boost::hana::at_c<I>(boost::hana::accessors<T>())));
    else
        return {};
}

template <class T, class F>
constexpr void for_each_field_index(F&& f) {
    [&]<std::size_t... I>(std::index_sequence<I...>) {
        (f(std::integral_constant<std::size_t, I>{}), ...);
    }(std::make_index_sequence<field_count<T>()>{});
}

}  // namespace spbcast::detail
