// Encodes a value's non-tensor content into the frame (tensors become table indices), and
// decodes it back on a follower. Both walk the type the same way, so the stream carries no
// tags: the schema fingerprint guarantees both sides walk the same type.
//
// Stream encoding per kind: scalars as their little-endian bytes (bool as one byte), strings
// and containers as a u64 count then the elements, optionals as a u8 presence byte, variants
// as a u32 alternative index, tensors as a u32 table index (0xffffffff: undefined), structs
// and tuples as their fields in order, IValues as a u8 tag then their content.
#pragma once

#include "../error.hpp"
#include "../options.hpp"
#include "bytes.hpp"
#include "field_path.hpp"
#include "fields.hpp"
#include "kinds.hpp"
#include "tensor_plan.hpp"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace spbcast::detail {

// The fewest stream bytes one value of T takes; used to reject element counts that the frame
// cannot possibly hold before reserving memory for them.
template <class T>
constexpr std::size_t min_wire_bytes() {
    constexpr kind k = kind_v<T>;
    if constexpr (k == kind::custom) return min_wire_bytes<wire_type_t<T>>();
    else if constexpr (k == kind::boolean) return 1;
    else if constexpr (k == kind::integer || k == kind::floating) return sizeof(T);
    else if constexpr (k == kind::enumeration) return sizeof(std::underlying_type_t<T>);
    else if constexpr (k == kind::tensor || k == kind::variant) return 4;
    else if constexpr (k == kind::ivalue || k == kind::optional) return 1;
    else if constexpr (k == kind::string || k == kind::sequence || k == kind::set ||
                       k == kind::map)
        return 8;
    else if constexpr (k == kind::array)
        return std::tuple_size_v<T> * min_wire_bytes<typename T::value_type>();
    else if constexpr (k == kind::tuple)
        return []<std::size_t... I>(std::index_sequence<I...>) {
            return (std::size_t{0} + ... + min_wire_bytes<std::tuple_element_t<I, T>>());
        }(std::make_index_sequence<std::tuple_size_v<T>>{});
    else if constexpr (k == kind::hana_struct || k == kind::aggregate)
        return []<std::size_t... I>(std::index_sequence<I...>) {
            return (std::size_t{0} + ... + min_wire_bytes<field_type_t<T, I>>());
        }(std::make_index_sequence<field_count<T>()>{});
    else return 0;
}

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

// IValue tags on the wire.
enum class ivalue_tag : std::uint8_t {
    none = 0, tensor, integer, floating, boolean, string,
    int_list, double_list, bool_list, tensor_list, generic_list, generic_dict, tuple,
};
// The static type of a generic list's elements and of a dict's keys and values travels whole
// (a tree of these codes), so Dict(str, int[]) stays Dict(str, int[]) and Tensor?[] stays
// Tensor?[] on every rank: code that calls to<c10::Dict<...>>() works on followers too.
enum class ivalue_type : std::uint8_t {
    any = 0, tensor, integer, floating, boolean, string,
    none, list, dict, tuple, optional, number, complex,
};

// Writes `type`; false (nothing meaningful written) when it is a type the wire cannot carry.
inline bool put_ivalue_type(byte_writer& out, const c10::TypePtr& type, std::size_t depth, std::size_t max_depth) {
    if (depth > max_depth) return false;
    auto code = [&](ivalue_type t) { out.put<std::uint8_t>(static_cast<std::uint8_t>(t)); };
    switch (type->kind()) {
        case c10::TypeKind::AnyType: code(ivalue_type::any); return true;
        case c10::TypeKind::TensorType: code(ivalue_type::tensor); return true;
        case c10::TypeKind::IntType: code(ivalue_type::integer); return true;
        case c10::TypeKind::FloatType: code(ivalue_type::floating); return true;
        case c10::TypeKind::BoolType: code(ivalue_type::boolean); return true;
        case c10::TypeKind::StringType: code(ivalue_type::string); return true;
        case c10::TypeKind::NoneType: code(ivalue_type::none); return true;
        case c10::TypeKind::NumberType: code(ivalue_type::number); return true;
        case c10::TypeKind::ComplexType: code(ivalue_type::complex); return true;
        case c10::TypeKind::ListType:
            code(ivalue_type::list);
            return put_ivalue_type(out, type->expectRef<c10::ListType>().getElementType(), depth + 1, max_depth);
        case c10::TypeKind::OptionalType:
            code(ivalue_type::optional);
            return put_ivalue_type(out, type->expectRef<c10::OptionalType>().getElementType(), depth + 1, max_depth);
        case c10::TypeKind::DictType: {
            code(ivalue_type::dict);
            const auto& dict = type->expectRef<c10::DictType>();
            return put_ivalue_type(out, dict.getKeyType(), depth + 1, max_depth) &&
                   put_ivalue_type(out, dict.getValueType(), depth + 1, max_depth);
        }
        case c10::TypeKind::TupleType: {
            const auto& tuple = type->expectRef<c10::TupleType>();
            if (tuple.schema()) return false;  // a NamedTuple: its names would be lost
            code(ivalue_type::tuple);
            out.put<std::uint32_t>(static_cast<std::uint32_t>(tuple.elements().size()));
            for (const auto& element : tuple.elements())
                if (!put_ivalue_type(out, element, depth + 1, max_depth)) return false;
            return true;
        }
        default: return false;
    }
}

inline c10::TypePtr get_ivalue_type(byte_reader& in, std::size_t depth, std::size_t max_depth) {
    if (depth > max_depth) in.fail("IValue type nesting deeper than limits.max_depth");
    const auto raw = in.get<std::uint8_t>();
    switch (static_cast<ivalue_type>(raw)) {
        case ivalue_type::any: return c10::AnyType::get();
        case ivalue_type::tensor: return c10::TensorType::get();
        case ivalue_type::integer: return c10::IntType::get();
        case ivalue_type::floating: return c10::FloatType::get();
        case ivalue_type::boolean: return c10::BoolType::get();
        case ivalue_type::string: return c10::StringType::get();
        case ivalue_type::none: return c10::NoneType::get();
        case ivalue_type::number: return c10::NumberType::get();
        case ivalue_type::complex: return c10::ComplexType::get();
        case ivalue_type::list: return c10::ListType::create(get_ivalue_type(in, depth + 1, max_depth));
        case ivalue_type::optional: return c10::OptionalType::create(get_ivalue_type(in, depth + 1, max_depth));
        case ivalue_type::dict: {
            auto key = get_ivalue_type(in, depth + 1, max_depth);
            auto value = get_ivalue_type(in, depth + 1, max_depth);
            return c10::DictType::create(std::move(key), std::move(value));
        }
        case ivalue_type::tuple: {
            const auto n = in.get<std::uint32_t>();
            if (n > in.remaining()) in.fail("tuple type with " + std::to_string(n) + " elements exceeds the frame");
            std::vector<c10::TypePtr> elements;
            for (std::uint32_t i = 0; i < n; ++i) elements.push_back(get_ivalue_type(in, depth + 1, max_depth));
            return c10::TupleType::create(std::move(elements));
        }
    }
    in.fail("unknown IValue type code " + std::to_string(raw));
}

// ---------------------------------------------------------------------------------------------

class encoder {
public:
    encoder(byte_writer& out, send_plan& plan, const limits& lim)
        : out_(out), plan_(plan), limits_(lim) {}

    template <class T>
    void value(const T& v) {
        constexpr kind k = kind_v<T>;
        if constexpr (k == kind::custom) {
            value(codec<T>::to_wire(v));
        } else if constexpr (k == kind::tensor) {
            out_.put<std::uint32_t>(tensor_index(v));
        } else if constexpr (k == kind::ivalue) {
            ivalue(v, 0);
        } else if constexpr (k == kind::boolean) {
            out_.put<std::uint8_t>(v ? 1 : 0);
        } else if constexpr (k == kind::integer || k == kind::floating || k == kind::enumeration) {
            out_.put(v);
        } else if constexpr (k == kind::string) {
            string(v);
        } else if constexpr (k == kind::optional) {
            out_.put<std::uint8_t>(v.has_value() ? 1 : 0);
            if (v.has_value()) value(*v);
        } else if constexpr (k == kind::variant) {
            out_.put<std::uint32_t>(static_cast<std::uint32_t>(v.index()));
            std::visit([&](const auto& alternative) { value(alternative); }, v);
        } else if constexpr (k == kind::array || k == kind::sequence || k == kind::set) {
            if constexpr (k != kind::array) count(v.size());
            if constexpr (hashed_container<T>) buckets(v);
            if constexpr (is_bulk_vector<T>) {
                out_.put_bytes(v.data(), v.size() * sizeof(typename T::value_type));
            } else {
                std::uint64_t i = 0;
                for (const auto& element : v) {
                    path_.push_index(i++);
                    value(static_cast<const typename T::value_type&>(element));
                    path_.pop();
                }
            }
        } else if constexpr (k == kind::map) {
            count(v.size());
            if constexpr (hashed_container<T>) buckets(v);
            for (const auto& [key, mapped] : v) {
                value(key);
                path_.push_key(key_text(key));
                value(mapped);
                path_.pop();
            }
        } else if constexpr (k == kind::tuple) {
            std::apply([&](const auto&... elements) { (value(elements), ...); }, v);
        } else if constexpr (k == kind::hana_struct || k == kind::aggregate) {
            for_each_field_index<T>([&](auto index) {
                constexpr std::size_t i = decltype(index)::value;
                path_.push_field(field_name<T, i>(), i);
                value(field<i>(v));
                path_.pop();
            });
        }
    }

    field_path& path() { return path_; }

private:
    template <class C>
    void buckets(const C& c) {
        out_.put<std::uint64_t>(c.bucket_count());
        out_.put<float>(c.max_load_factor());
    }

    std::uint32_t tensor_index(const at::Tensor& t) {
        return plan_.add(t, limits_, [&] { return path_.str(); });
    }

    void count(std::uint64_t n) {
        if (n > limits_.max_container_size)
            fail(errc::limit_exceeded, "a container of " + std::to_string(n) +
                                           " elements exceeds limits.max_container_size = " +
                                           std::to_string(limits_.max_container_size) +
                                           "; raise it on every rank");
        out_.put<std::uint64_t>(n);
    }

    void string(const std::string& s) {
        if (s.size() > limits_.max_string_bytes)
            fail(errc::limit_exceeded, "a string of " + std::to_string(s.size()) +
                                           " bytes exceeds limits.max_string_bytes; raise it on "
                                           "every rank");
        out_.put_string(s);
    }

    template <class K>
    static std::string key_text(const K& key) {
        if constexpr (std::is_same_v<K, std::string>) return key;
        else if constexpr (std::is_enum_v<K>)
            return std::to_string(static_cast<std::underlying_type_t<K>>(key));
        else return std::to_string(key);
    }

    void ivalue(const c10::IValue& v, std::size_t depth) {
        if (depth > limits_.max_depth)
            fail(errc::limit_exceeded, "IValue nesting deeper than limits.max_depth");
        auto tag = [&](ivalue_tag t) { out_.put<std::uint8_t>(static_cast<std::uint8_t>(t)); };
        if (v.isNone()) {
            tag(ivalue_tag::none);
        } else if (v.isTensor()) {
            tag(ivalue_tag::tensor);
            out_.put<std::uint32_t>(tensor_index(v.toTensor()));
        } else if (v.isInt()) {
            tag(ivalue_tag::integer);
            out_.put<std::int64_t>(v.toInt());
        } else if (v.isDouble()) {
            tag(ivalue_tag::floating);
            out_.put<double>(v.toDouble());
        } else if (v.isBool()) {
            tag(ivalue_tag::boolean);
            out_.put<std::uint8_t>(v.toBool() ? 1 : 0);
        } else if (v.isString()) {
            tag(ivalue_tag::string);
            string(v.toStringRef());
        } else if (v.isIntList()) {
            tag(ivalue_tag::int_list);
            const auto list = v.toIntList();
            count(list.size());
            for (int64_t x : list) out_.put<std::int64_t>(x);
        } else if (v.isDoubleList()) {
            tag(ivalue_tag::double_list);
            const auto list = v.toDoubleList();
            count(list.size());
            for (double x : list) out_.put<double>(x);
        } else if (v.isBoolList()) {
            tag(ivalue_tag::bool_list);
            const auto list = v.toBoolList();
            count(list.size());
            for (bool x : list) out_.put<std::uint8_t>(x ? 1 : 0);
        } else if (v.isTensorList()) {
            tag(ivalue_tag::tensor_list);
            const auto list = v.toTensorList();
            count(list.size());
            std::uint64_t i = 0;
            for (at::Tensor t : list) {
                path_.push_index(i++);
                out_.put<std::uint32_t>(tensor_index(t));
                path_.pop();
            }
        } else if (v.isList()) {
            tag(ivalue_tag::generic_list);
            const auto list = v.toList();
            type(list.elementType());
            count(list.size());
            for (std::size_t i = 0; i < list.size(); ++i) {
                path_.push_index(i);
                ivalue(list.get(i), depth + 1);
                path_.pop();
            }
        } else if (v.isGenericDict()) {
            tag(ivalue_tag::generic_dict);
            const auto dict = v.toGenericDict();
            type(dict.keyType());
            type(dict.valueType());
            count(dict.size());
            for (const auto& entry : dict) {
                ivalue(entry.key(), depth + 1);
                path_.push_key(entry.key().isString() ? entry.key().toStringRef()
                                                      : entry.key().tagKind());
                ivalue(entry.value(), depth + 1);
                path_.pop();
            }
        } else if (v.isTuple()) {
            tag(ivalue_tag::tuple);
            const auto& elements = v.toTuple()->elements();
            count(elements.size());
            for (std::size_t i = 0; i < elements.size(); ++i) {
                path_.push_index(i);
                ivalue(elements[i], depth + 1);
                path_.pop();
            }
        } else {
            fail(errc::unsupported_value,
                 "an IValue of kind " + v.tagKind() +
                     " cannot be sent (supported: None, Tensor, int, double, bool, string, "
                     "lists, dicts, tuples); convert it in the collator");
        }
    }

    void type(const c10::TypePtr& t) {
        if (!put_ivalue_type(out_, t, 0, limits_.max_depth))
            fail(errc::unsupported_value,
                 "a container typed " + t->annotation_str() +
                     " cannot be sent (element types: Any, Tensor, int, float, bool, str, None, "
                     "number, complex, and lists, dicts, tuples and optionals of these)");
    }

    [[noreturn]] void fail(errc code, const std::string& what) {
        throw error(code, "cannot send " + path_.str() + ": " + what);
    }

    byte_writer& out_;
    send_plan& plan_;
    const limits& limits_;
    field_path path_;
};

// ---------------------------------------------------------------------------------------------

class decoder {
public:
    decoder(byte_reader& in, const std::vector<at::Tensor>& tensors, const limits& lim)
        : in_(in), tensors_(tensors), limits_(lim) {}

    template <class T>
    void value(T& v) {
        constexpr kind k = kind_v<T>;
        if constexpr (k == kind::custom) {
            if constexpr (has_from_wire<T>) v = codec<T>::from_wire(make<wire_type_t<T>>());
        } else if constexpr (k == kind::tensor) {
            v = tensor(in_.get<std::uint32_t>());
        } else if constexpr (k == kind::ivalue) {
            v = ivalue(0);
        } else if constexpr (k == kind::boolean) {
            v = boolean();
        } else if constexpr (k == kind::integer || k == kind::floating || k == kind::enumeration) {
            v = in_.get<T>();
        } else if constexpr (k == kind::string) {
            v = in_.get_string(limits_.max_string_bytes);
        } else if constexpr (k == kind::optional) {
            if (boolean())
                v = make<typename T::value_type>();
            else
                v.reset();
        } else if constexpr (k == kind::variant) {
            variant(v, in_.get<std::uint32_t>(),
                    std::make_index_sequence<std::variant_size_v<T>>{});
        } else if constexpr (k == kind::array) {
            for (std::size_t i = 0; i < v.size(); ++i) element(v[i], i);
        } else if constexpr (k == kind::sequence || k == kind::set) {
            using E = typename T::value_type;
            const auto n = count(min_wire_bytes<E>());
            v.clear();
            if constexpr (is_bulk_vector<T>) {
                v.resize(n);
                const auto* bytes = in_.get_bytes(n * sizeof(E));
                if (n != 0) std::memcpy(v.data(), bytes, n * sizeof(E));  // data() is null when empty
            } else if constexpr (requires { v.resize(n); v[0]; } && !std::is_same_v<E, bool> &&
                                 std::is_default_constructible_v<E>) {
                v.resize(n);
                for (std::size_t i = 0; i < n; ++i) element(v[i], i);
            } else if constexpr (hashed_container<T>) {
                const auto layout = buckets();
                std::vector<E> elements;
                elements.reserve(n);
                for (std::size_t i = 0; i < n; ++i) elements.push_back(make_element<E>(i));
                rebuild_in_order(v, elements, layout, [](const E& e) -> const E& { return e; });
            } else {
                for (std::size_t i = 0; i < n; ++i) {
                    if constexpr (k == kind::set) v.insert(make_element<E>(i));
                    else v.push_back(make_element<E>(i));
                }
            }
        } else if constexpr (k == kind::map) {
            using K = typename T::key_type;
            using M = typename T::mapped_type;
            const auto n = count(min_wire_bytes<K>() + min_wire_bytes<M>());
            v.clear();
            if constexpr (hashed_container<T>) {
                const auto layout = buckets();
                std::vector<std::pair<K, M>> entries;
                entries.reserve(n);
                for (std::size_t i = 0; i < n; ++i) {
                    K key = make<K>();
                    entries.emplace_back(std::move(key), make_element<M>(i));
                }
                rebuild_in_order(v, entries, layout, [](const auto& e) -> const K& { return e.first; });
            } else {
                for (std::size_t i = 0; i < n; ++i) {
                    K key = make<K>();
                    v.emplace(std::move(key), make_element<M>(i));
                }
            }
        } else if constexpr (k == kind::tuple) {
            std::apply([&](auto&... elements) { (value(elements), ...); }, v);
        } else if constexpr (k == kind::hana_struct || k == kind::aggregate) {
            for_each_field_index<T>([&](auto index) {
                constexpr std::size_t i = decltype(index)::value;
                path_.push_field(field_name<T, i>(), i);
                value(field<i>(v));
                path_.pop();
            });
        }
    }

    // A new T from the stream. Types without a default constructor are built from their parts:
    // a codec's type from its wire value, a tuple or an aggregate from its fields in order
    // (a braced initializer evaluates its elements left to right, the wire's order).
    template <class T>
    T make() {
        constexpr kind k = kind_v<T>;
        if constexpr (std::is_default_constructible_v<T>) {
            T v{};
            value(v);
            return v;
        } else if constexpr (k == kind::custom) {
            return codec<T>::from_wire(make<wire_type_t<T>>());
        } else if constexpr (k == kind::tuple) {
            return [&]<std::size_t... I>(std::index_sequence<I...>) {
                return T{make<std::tuple_element_t<I, T>>()...};
            }(std::make_index_sequence<std::tuple_size_v<T>>{});
        } else if constexpr (k == kind::hana_struct || k == kind::aggregate) {
            return [&]<std::size_t... I>(std::index_sequence<I...>) {
                return T{make_field<T, I>()...};
            }(std::make_index_sequence<field_count<T>()>{});
        } else {
            static_assert(std::is_default_constructible_v<T>,
                          "spbcast: followers must be able to build this type: give it a default "
                          "constructor or send it through spbcast::codec<T>");
        }
    }

private:
    template <class T, std::size_t I>
    field_type_t<T, I> make_field() {
        path_.push_field(field_name<T, I>(), I);
        field_type_t<T, I> f = make<field_type_t<T, I>>();
        path_.pop();
        return f;
    }

    template <class E>
    E make_element(std::size_t i) {
        path_.push_index(i);
        E e = make<E>();
        path_.pop();
        return e;
    }

    struct bucket_layout {
        std::uint64_t count;
        float max_load_factor;
    };
    bucket_layout buckets() {
        bucket_layout layout{in_.get<std::uint64_t>(), in_.get<float>()};
        // A bucket array costs a pointer per bucket: bound it like the elements.
        if (layout.count > limits_.max_container_size + 1 || !(layout.max_load_factor > 0.0f))
            fail("a hashed container with " + std::to_string(layout.count) + " buckets");
        return layout;
    }

    // Rebuilds a hashed container so that it iterates in `in_order` (the root's order).
    template <class C, class Entries, class KeyOf>
    void rebuild_in_order(C& c, Entries& in_order, const bucket_layout& layout, KeyOf key_of) {
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
            fail("this standard library cannot rebuild the hashed container in the root's "
                 "iteration order (duplicate keys, or another hash function or library than the "
                 "root's); use std::map or a vector of pairs");
    }

    template <class E>
    void element(E& e, std::size_t i) {
        path_.push_index(i);
        value(e);
        path_.pop();
    }

    bool boolean() {
        const auto b = in_.get<std::uint8_t>();
        if (b > 1) fail("a bool or presence byte of value " + std::to_string(b));
        return b == 1;
    }

    std::uint64_t count(std::size_t min_element_bytes) {
        return in_.get_count(limits_.max_container_size, min_element_bytes, "container size");
    }

    at::Tensor tensor(std::uint32_t index) {
        if (index == undefined_tensor) return at::Tensor();
        if (index >= tensors_.size()) fail("tensor index " + std::to_string(index) + " out of range");
        return tensors_[index];
    }

    template <class V, std::size_t... I>
    void variant(V& v, std::uint32_t index, std::index_sequence<I...>) {
        if (index >= sizeof...(I)) fail("variant alternative " + std::to_string(index) + " out of range");
        // Emplace the announced alternative, then decode into it.
        (void)((index == I ? (v.template emplace<I>(make<std::variant_alternative_t<I, V>>()), true) : false) || ...);
    }

    c10::IValue ivalue(std::size_t depth) {
        if (depth > limits_.max_depth) fail("IValue nesting deeper than limits.max_depth");
        const auto raw = in_.get<std::uint8_t>();
        switch (static_cast<ivalue_tag>(raw)) {
            case ivalue_tag::none: return c10::IValue();
            case ivalue_tag::tensor: return tensor(in_.get<std::uint32_t>());
            case ivalue_tag::integer: return in_.get<std::int64_t>();
            case ivalue_tag::floating: return in_.get<double>();
            case ivalue_tag::boolean: return boolean();
            case ivalue_tag::string: return in_.get_string(limits_.max_string_bytes);
            case ivalue_tag::int_list: return typed_list<int64_t>([&] { return in_.get<std::int64_t>(); });
            case ivalue_tag::double_list: return typed_list<double>([&] { return in_.get<double>(); });
            case ivalue_tag::bool_list: return typed_list<bool>([&] { return boolean(); }, 1);
            case ivalue_tag::tensor_list:
                return typed_list<at::Tensor>([&] { return tensor(in_.get<std::uint32_t>()); }, 4);
            case ivalue_tag::generic_list: {
                const c10::TypePtr element_type = get_ivalue_type(in_, 0, limits_.max_depth);
                c10::impl::GenericList list(element_type);
                const auto n = count(1);
                list.reserve(n);
                for (std::size_t i = 0; i < n; ++i) list.push_back(typed(ivalue(depth + 1), element_type));
                return list;
            }
            case ivalue_tag::generic_dict: {
                const c10::TypePtr key_type = get_ivalue_type(in_, 0, limits_.max_depth);
                const c10::TypePtr value_type = get_ivalue_type(in_, 0, limits_.max_depth);
                c10::impl::GenericDict dict(key_type, value_type);
                const auto n = count(2);
                for (std::size_t i = 0; i < n; ++i) {
                    c10::IValue key = typed(ivalue(depth + 1), key_type);
                    dict.insert_or_assign(std::move(key), typed(ivalue(depth + 1), value_type));
                }
                return dict;
            }
            case ivalue_tag::tuple: {
                std::vector<c10::IValue> elements;
                const auto n = count(1);
                elements.reserve(n);
                for (std::size_t i = 0; i < n; ++i) elements.push_back(ivalue(depth + 1));
                return c10::ivalue::Tuple::create(std::move(elements));
            }
        }
        fail("unknown IValue tag " + std::to_string(raw));
    }

    // A root only sends elements of a typed container's type.
    c10::IValue typed(c10::IValue v, const c10::TypePtr& type) {
        if (type->kind() == c10::TypeKind::AnyType) return v;
        const c10::TypePtr actual = type_of(v);
        if (!actual->isSubtypeOf(*type))
            fail("an IValue of type " + actual->annotation_str() + " in a container typed " +
                 type->annotation_str());
        return v;
    }

    // IValue::type() fails on an undefined tensor (a tensor of unknown kind), also inside a
    // tuple, whose type it computes from the elements.
    static c10::TypePtr type_of(const c10::IValue& v) {
        if (v.isTensor()) return c10::TensorType::get();
        if (v.isTuple()) {
            std::vector<c10::TypePtr> elements;
            for (const auto& e : v.toTupleRef().elements()) elements.push_back(type_of(e));
            return c10::TupleType::create(std::move(elements));
        }
        return v.type();
    }

    template <class E, class Read>
    c10::IValue typed_list(Read read, std::size_t min_element_bytes = 8) {
        c10::List<E> list;
        const auto n = count(min_element_bytes);
        list.reserve(n);
        for (std::size_t i = 0; i < n; ++i) list.push_back(read());
        return list;
    }

    [[noreturn]] void fail(const std::string& what) {
        in_.fail(what + " while decoding " + path_.str());
    }

    byte_reader& in_;
    const std::vector<at::Tensor>& tensors_;
    const limits& limits_;
    field_path path_;
};

}  // namespace spbcast::detail
