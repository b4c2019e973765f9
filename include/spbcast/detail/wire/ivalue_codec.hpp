// The IValue kind: dynamic values (None, tensors, ints, doubles, bools, strings, their lists,
// generic lists, dicts and tuples), for batches built like Python dicts (the contract:
// kind_traits.hpp). On the stream: a u8 tag, then the content; typed containers also carry
// their static element, key and value types.
#pragma once

#include "../../error.hpp"
#include "bytes.hpp"
#include "kind_traits.hpp"

#include <ATen/core/Dict.h>
#include <ATen/core/List.h>
#include <ATen/core/ivalue.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

namespace spbcast::detail {

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

template <class Encoder>
void encode_ivalue_type(Encoder& out, const c10::TypePtr& t) {
    if (!put_ivalue_type(out.writer(), t, 0, out.bounds().max_depth))
        out.fail(errc::unsupported_value,
                 "a container typed " + t->annotation_str() +
                     " cannot be sent (element types: Any, Tensor, int, float, bool, str, None, "
                     "number, complex, and lists, dicts, tuples and optionals of these)");
}

template <class Encoder>
void encode_ivalue(Encoder& out, const c10::IValue& v, std::size_t depth) {
    if (depth > out.bounds().max_depth)
        out.fail(errc::limit_exceeded, "IValue nesting deeper than limits.max_depth");
    byte_writer& w = out.writer();
    auto tag = [&](ivalue_tag t) { w.put<std::uint8_t>(static_cast<std::uint8_t>(t)); };
    if (v.isNone()) {
        tag(ivalue_tag::none);
    } else if (v.isTensor()) {
        tag(ivalue_tag::tensor);
        out.tensor(v.toTensor());
    } else if (v.isInt()) {
        tag(ivalue_tag::integer);
        w.put<std::int64_t>(v.toInt());
    } else if (v.isDouble()) {
        tag(ivalue_tag::floating);
        w.put<double>(v.toDouble());
    } else if (v.isBool()) {
        tag(ivalue_tag::boolean);
        out.flag(v.toBool());
    } else if (v.isString()) {
        tag(ivalue_tag::string);
        out.string(v.toStringRef());
    } else if (v.isIntList()) {
        tag(ivalue_tag::int_list);
        const auto list = v.toIntList();
        out.count(list.size());
        for (int64_t x : list) w.put<std::int64_t>(x);
    } else if (v.isDoubleList()) {
        tag(ivalue_tag::double_list);
        const auto list = v.toDoubleList();
        out.count(list.size());
        for (double x : list) w.put<double>(x);
    } else if (v.isBoolList()) {
        tag(ivalue_tag::bool_list);
        const auto list = v.toBoolList();
        out.count(list.size());
        for (bool x : list) out.flag(x);
    } else if (v.isTensorList()) {
        tag(ivalue_tag::tensor_list);
        const auto list = v.toTensorList();
        out.count(list.size());
        std::uint64_t i = 0;
        for (at::Tensor t : list) {
            out.path().push_index(i++);
            out.tensor(t);
            out.path().pop();
        }
    } else if (v.isList()) {
        tag(ivalue_tag::generic_list);
        const auto list = v.toList();
        encode_ivalue_type(out, list.elementType());
        out.count(list.size());
        for (std::size_t i = 0; i < list.size(); ++i) {
            out.path().push_index(i);
            encode_ivalue(out, list.get(i), depth + 1);
            out.path().pop();
        }
    } else if (v.isGenericDict()) {
        tag(ivalue_tag::generic_dict);
        const auto dict = v.toGenericDict();
        encode_ivalue_type(out, dict.keyType());
        encode_ivalue_type(out, dict.valueType());
        out.count(dict.size());
        for (const auto& entry : dict) {
            encode_ivalue(out, entry.key(), depth + 1);
            out.path().push_key(entry.key().isString() ? entry.key().toStringRef() : entry.key().tagKind());
            encode_ivalue(out, entry.value(), depth + 1);
            out.path().pop();
        }
    } else if (v.isTuple()) {
        tag(ivalue_tag::tuple);
        const auto& elements = v.toTuple()->elements();
        out.count(elements.size());
        for (std::size_t i = 0; i < elements.size(); ++i) {
            out.path().push_index(i);
            encode_ivalue(out, elements[i], depth + 1);
            out.path().pop();
        }
    } else {
        out.fail(errc::unsupported_value,
                 "an IValue of kind " + v.tagKind() +
                     " cannot be sent (supported: None, Tensor, int, double, bool, string, "
                     "lists, dicts, tuples); convert it in the collator");
    }
}

// IValue::type() fails on an undefined tensor (a tensor of unknown kind), also inside a
// tuple, whose type it computes from the elements.
inline c10::TypePtr ivalue_type_of(const c10::IValue& v) {
    if (v.isTensor()) return c10::TensorType::get();
    if (v.isTuple()) {
        std::vector<c10::TypePtr> elements;
        for (const auto& e : v.toTupleRef().elements()) elements.push_back(ivalue_type_of(e));
        return c10::TupleType::create(std::move(elements));
    }
    return v.type();
}

// A root only sends elements of a typed container's type.
template <class Decoder>
c10::IValue typed_ivalue(Decoder& in, c10::IValue v, const c10::TypePtr& type) {
    if (type->kind() == c10::TypeKind::AnyType) return v;
    const c10::TypePtr actual = ivalue_type_of(v);
    if (!actual->isSubtypeOf(*type))
        in.fail("an IValue of type " + actual->annotation_str() + " in a container typed " +
                type->annotation_str());
    return v;
}

template <class E, class Decoder, class Read>
c10::IValue decode_typed_list(Decoder& in, Read read, std::size_t min_element_bytes = 8) {
    c10::List<E> list;
    const auto n = in.count(min_element_bytes);
    list.reserve(n);
    for (std::size_t i = 0; i < n; ++i) list.push_back(read());
    return list;
}

template <class Decoder>
c10::IValue decode_ivalue(Decoder& in, std::size_t depth) {
    const std::size_t max_depth = in.bounds().max_depth;
    if (depth > max_depth) in.fail("IValue nesting deeper than limits.max_depth");
    byte_reader& r = in.reader();
    const auto raw = r.get<std::uint8_t>();
    switch (static_cast<ivalue_tag>(raw)) {
        case ivalue_tag::none: return c10::IValue();
        case ivalue_tag::tensor: return in.tensor();
        case ivalue_tag::integer: return r.get<std::int64_t>();
        case ivalue_tag::floating: return r.get<double>();
        case ivalue_tag::boolean: return in.flag();
        case ivalue_tag::string: return in.string();
        case ivalue_tag::int_list: return decode_typed_list<int64_t>(in, [&] { return r.get<std::int64_t>(); });
        case ivalue_tag::double_list: return decode_typed_list<double>(in, [&] { return r.get<double>(); });
        case ivalue_tag::bool_list: return decode_typed_list<bool>(in, [&] { return in.flag(); }, 1);
        case ivalue_tag::tensor_list: return decode_typed_list<at::Tensor>(in, [&] { return in.tensor(); }, 4);
        case ivalue_tag::generic_list: {
            const c10::TypePtr element_type = get_ivalue_type(r, 0, max_depth);
            c10::impl::GenericList list(element_type);
            const auto n = in.count(1);
            list.reserve(n);
            for (std::size_t i = 0; i < n; ++i)
                list.push_back(typed_ivalue(in, decode_ivalue(in, depth + 1), element_type));
            return list;
        }
        case ivalue_tag::generic_dict: {
            const c10::TypePtr key_type = get_ivalue_type(r, 0, max_depth);
            const c10::TypePtr value_type = get_ivalue_type(r, 0, max_depth);
            c10::impl::GenericDict dict(key_type, value_type);
            const auto n = in.count(2);
            for (std::size_t i = 0; i < n; ++i) {
                c10::IValue key = typed_ivalue(in, decode_ivalue(in, depth + 1), key_type);
                dict.insert_or_assign(std::move(key), typed_ivalue(in, decode_ivalue(in, depth + 1), value_type));
            }
            return dict;
        }
        case ivalue_tag::tuple: {
            std::vector<c10::IValue> elements;
            const auto n = in.count(1);
            elements.reserve(n);
            for (std::size_t i = 0; i < n; ++i) elements.push_back(decode_ivalue(in, depth + 1));
            return c10::ivalue::Tuple::create(std::move(elements));
        }
    }
    in.fail("unknown IValue tag " + std::to_string(raw));
}

template <>
struct kind_traits<kind::ivalue> {
    template <class T>
    static constexpr bool matches = std::is_same_v<T, c10::IValue>;
    template <class T>
    static constexpr void schema(schema_builder& out) { out += "ivalue"; }
    template <class T>
    static constexpr std::size_t min_bytes() { return 1; }
    template <class T>
    static void encode(auto& out, const T& v) { encode_ivalue(out, v, 0); }
    template <class T>
    static void decode(auto& in, T& v) { v = decode_ivalue(in, 0); }
    template <class T>
    static void compare(auto& same, const T& a, const T& b, const std::string& path) {
        same.ivalue(a, b, path);
    }
};

}  // namespace spbcast::detail
