// The container kinds: std::array, maps, sets and sequences (the contract: kind_traits.hpp).
// A count (u64, not for arrays), for hashed containers their bucket layout, then the elements.
#pragma once

#include "kind_traits.hpp"

#include <array>
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace spbcast::detail {

template <class T>
inline constexpr bool is_std_array = false;
template <class T, std::size_t N>
inline constexpr bool is_std_array<std::array<T, N>> = true;

template <class T>
concept map_like = requires(T& map) {
    typename T::key_type;
    typename T::mapped_type;
    map.emplace(std::declval<typename T::key_type>(), std::declval<typename T::mapped_type>());
    map.size();
    map.clear();
};

template <class T>
concept set_like = !map_like<T> && requires(T& set) {
    typename T::key_type;
    typename T::value_type;
    set.insert(std::declval<typename T::value_type>());
    set.size();
    set.clear();
};

template <class T>
concept sequence_like = !std::same_as<T, std::string> && requires(T& seq) {
    typename T::value_type;
    seq.push_back(std::declval<typename T::value_type>());
    seq.size();
    seq.clear();
    seq.begin();
    seq.end();
};

template <class T>
inline constexpr bool is_bulk_vector = false;  // a vector sent as one memcpy
template <class E, class A>
inline constexpr bool is_bulk_vector<std::vector<E, A>> =
    (kind_v<E> == kind::integer || kind_v<E> == kind::floating) && !std::is_same_v<E, bool>;

// std::unordered_map / unordered_set iterate in an order that depends on their bucket count and
// insertion history. Code that builds model inputs by iterating one must see the root's order
// on every rank, so the root sends its bucket count and load factor with the elements in its
// iteration order, and a follower rebuilds with the same buckets, inserting in reverse: each
// insertion lands at the front of its bucket or of the list, which reproduces the order. The
// follower checks the result and refuses a container whose order it could not reproduce.
template <class T>
concept hashed_container = requires(T& c, const T& cc) {
    { cc.bucket_count() } -> std::convertible_to<std::size_t>;
    { cc.max_load_factor() } -> std::convertible_to<float>;
    c.max_load_factor(1.0f);
    c.rehash(std::size_t{1});
};

struct bucket_layout {
    std::uint64_t count;
    float max_load_factor;
};

// What precedes a set's, a sequence's or a map's elements: their count, and a hashed
// container's bucket layout.
template <class C>
void put_size(auto& out, const C& c) {
    out.count(c.size());
    if constexpr (hashed_container<C>) {
        out.scalar(static_cast<std::uint64_t>(c.bucket_count()));
        out.scalar(static_cast<float>(c.max_load_factor()));
    }
}

inline bucket_layout get_buckets(auto& in) {
    bucket_layout layout{};
    in.scalar(layout.count);
    in.scalar(layout.max_load_factor);
    // A bucket array costs a pointer per bucket: bound it like the elements.
    if (layout.count > in.bounds().max_container_size + 1 || !(layout.max_load_factor > 0.0f))
        in.fail("a hashed container with " + std::to_string(layout.count) + " buckets");
    return layout;
}

// Rebuilds a hashed container so that it iterates in `in_order` (the root's order).
template <class C, class Entries, class KeyOf>
void rebuild_in_order(auto& in, C& c, Entries& in_order, const bucket_layout& layout, KeyOf key_of) {
    std::vector<typename C::key_type> keys;  // keys are strings or scalars: cheap to keep
    keys.reserve(in_order.size());
    for (const auto& e : in_order) keys.push_back(key_of(e));
    C rebuilt;  // fresh: the caller's old contents may have grown its bucket array
    rebuilt.max_load_factor(layout.max_load_factor);
    rebuilt.rehash(static_cast<std::size_t>(layout.count));
    for (auto it = in_order.rbegin(); it != in_order.rend(); ++it) rebuilt.insert(std::move(*it));
    bool same = rebuilt.size() == keys.size();
    auto expected = keys.begin();
    for (auto it = rebuilt.begin(); same && it != rebuilt.end(); ++it, ++expected)
        same = rebuilt.key_eq()(key_of(*it), *expected);
    c = std::move(rebuilt);
    if (!same)
        in.fail("this standard library cannot rebuild the hashed container in the root's "
                "iteration order (duplicate keys, or another hash function or library than the "
                "root's); use std::map or a vector of pairs");
}

// What arrays, sets and sequences share: elements in iteration order, compared in that order.
struct element_traits {
    template <class T>
    static void encode_elements(auto& out, const T& v) {
        if constexpr (is_bulk_vector<T>) {
            out.bytes(v.data(), v.size() * sizeof(typename T::value_type));
        } else {
            std::uint64_t i = 0;
            for (const auto& element : v) out.element(i++, static_cast<const typename T::value_type&>(element));
        }
    }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.require(a.size() == b.size(), path);
        auto ib = b.begin();
        std::size_t i = 0;
        for (auto ia = a.begin(); ia != a.end(); ++ia, ++ib, ++i)
            same.check(static_cast<const typename T::value_type&>(*ia),
                       static_cast<const typename T::value_type&>(*ib), path + "[" + std::to_string(i) + "]");
    }
};

// Its elements, no count: the size is part of the type.
template <>
struct kind_traits<kind::array> : element_traits {
    template <class T>
    static constexpr bool matches = is_std_array<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += "array<";
        append_schema<typename T::value_type>(out);
        out += ',';
        append_number(out, std::tuple_size_v<T>);
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return std::tuple_size_v<T> * min_wire_bytes<typename T::value_type>(); }
    template <class T>
    static void encode(auto& out, const T& v) { encode_elements(out, v); }
    template <class T>
    static void decode(auto& in, T& v) {
        for (std::size_t i = 0; i < v.size(); ++i) in.element(i, v[i]);
    }
};

// Sets and sequences: a count, the bucket layout of a hashed set, the elements.
template <kind K>
struct collection_traits : element_traits {
    template <class T>
    static constexpr void schema(schema_builder& out) {
        out += K == kind::sequence ? "list<" : "set<";
        append_schema<typename T::value_type>(out);
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return 8; }
    template <class T>
    static void encode(auto& out, const T& v) {
        put_size(out, v);
        encode_elements(out, v);
    }
    template <class T>
    static void decode(auto& in, T& v) {
        using E = typename T::value_type;
        const auto n = in.count(min_wire_bytes<E>());
        v.clear();
        if constexpr (is_bulk_vector<T>) {
            v.resize(n);
            const auto* bytes = in.bytes(n * sizeof(E));
            if (n != 0) std::memcpy(v.data(), bytes, n * sizeof(E));  // data() is null when empty
        } else if constexpr (requires { v.resize(n); v[0]; } && !std::is_same_v<E, bool> &&
                             std::is_default_constructible_v<E>) {
            v.resize(n);
            for (std::size_t i = 0; i < n; ++i) in.element(i, v[i]);
        } else if constexpr (hashed_container<T>) {
            const auto layout = get_buckets(in);
            std::vector<E> elements;
            elements.reserve(n);
            for (std::size_t i = 0; i < n; ++i) elements.push_back(in.template make_element<E>(i));
            rebuild_in_order(in, v, elements, layout, [](const E& e) -> const E& { return e; });
        } else {
            for (std::size_t i = 0; i < n; ++i) {
                if constexpr (K == kind::set) v.insert(in.template make_element<E>(i));
                else v.push_back(in.template make_element<E>(i));
            }
        }
    }
};

template <>
struct kind_traits<kind::set> : collection_traits<kind::set> {
    template <class T>
    static constexpr bool matches = set_like<T>;
};

template <>
struct kind_traits<kind::sequence> : collection_traits<kind::sequence> {
    template <class T>
    static constexpr bool matches = sequence_like<T>;
};

// A count, the bucket layout of a hashed map, then per entry its key and its value.
template <>
struct kind_traits<kind::map> {
    template <class T>
    static constexpr bool matches = map_like<T>;
    template <class T>
    static constexpr void schema(schema_builder& out) {
        static_assert(is_key_type<typename T::key_type>,
                      "spbcast: map keys must be strings, integers, bools or enums");
        out += "map<";
        append_schema<typename T::key_type>(out);
        out += ',';
        append_schema<typename T::mapped_type>(out);
        out += '>';
    }
    template <class T>
    static constexpr std::size_t min_bytes() { return 8; }
    template <class T>
    static void encode(auto& out, const T& v) {
        put_size(out, v);
        for (const auto& [key, mapped] : v) {
            out.value(key);
            out.keyed(key_text(key), mapped);
        }
    }
    template <class T>
    static void decode(auto& in, T& v) {
        using K = typename T::key_type;
        using M = typename T::mapped_type;
        const auto n = in.count(min_wire_bytes<K>() + min_wire_bytes<M>());
        v.clear();
        if constexpr (hashed_container<T>) {
            const auto layout = get_buckets(in);
            std::vector<std::pair<K, M>> entries;
            entries.reserve(n);
            for (std::size_t i = 0; i < n; ++i) {
                K key = in.template make<K>();
                entries.emplace_back(std::move(key), in.template make_element<M>(i));
            }
            rebuild_in_order(in, v, entries, layout, [](const auto& e) -> const K& { return e.first; });
        } else {
            for (std::size_t i = 0; i < n; ++i) {
                K key = in.template make<K>();
                v.emplace(std::move(key), in.template make_element<M>(i));
            }
        }
    }
    // An ordered map entry by entry; a hashed one by looking each key up.
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        if constexpr (requires { typename T::key_compare; }) {
            element_traits::compare(same, a, b, path);
        } else {
            same.require(a.size() == b.size(), path);
            for (const auto& [key, value] : a) {
                same.require(b.count(key) == 1, path);
                same.check(value, b.at(key), path + "[key]");
            }
        }
    }

private:
    // The key as the error path shows it: batch["key"].
    template <class K>
    static std::string key_text(const K& key) {
        if constexpr (std::is_same_v<K, std::string>) return key;
        else if constexpr (std::is_enum_v<K>)
            return std::to_string(static_cast<std::underlying_type_t<K>>(key));
        else return std::to_string(key);
    }
};

}  // namespace spbcast::detail
