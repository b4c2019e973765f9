// Values the tests, the fault tests and the fuzz corpus broadcast. (Realistic xtuner batches
// are examples/common/profiles.hpp; a real media loader is media_loader.hpp.)
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>

#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

namespace spbcast_test {

// A number from the environment, or `fallback` where the variable is unset or empty.
inline std::uint64_t env_number(const char* name, std::uint64_t fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::stoull(v) : fallback;
}

// How many broadcasts a soak test runs: SPBCAST_SOAK_STEPS, 1000 by default so that the suite
// stays fast on two cores; CI's soak step runs 10 000.
inline std::uint64_t soak_steps() { return env_number("SPBCAST_SOAK_STEPS", 1000); }

// A dynamic batch built like a Python dict, with every IValue kind the wire carries - tensors,
// int, double (-0.0 too), bool, string, None, int/double/bool/tensor lists, a generic list
// holding a string and a tuple, an int-keyed dict - and the tensor relations a broadcast must
// keep: one tensor under two keys and in a list, a transposed view and a stride-0 expanded
// view of its storage, and a float16 tensor. `variant` grows the ids; an odd one adds a
// non-contiguous `pixel_values` (the fuzz corpus's variety). Deterministic: every rank that
// builds it gets the same value.
inline c10::IValue representative_dict(int variant = 0) {
    c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
    at::Tensor ids = at::arange(12 + 4 * variant).view({-1, 4});
    dict.insert("input_ids", ids);
    dict.insert("alias", ids);
    dict.insert("view", ids.t());
    dict.insert("position_ids", ids.view({1, -1}).expand({3, ids.numel()}));
    dict.insert("num_padding", int64_t{17});
    dict.insert("scale", 0.5);
    dict.insert("packed", true);
    dict.insert("device", std::string("cpu"));
    dict.insert("none", c10::IValue());
    dict.insert("int_list", std::vector<int64_t>{1, 2, 3});
    dict.insert("double_list", std::vector<double>{0.5, -0.0});
    dict.insert("bool_list", c10::List<bool>({true, false}));
    dict.insert("tensor_list", c10::List<at::Tensor>({at::ones({2}), ids}));
    c10::impl::GenericList nested(c10::AnyType::get());
    nested.push_back(std::string("x"));
    nested.push_back(c10::ivalue::Tuple::create({int64_t{1}, at::zeros({1}, at::kHalf)}));
    dict.insert("nested", nested);
    c10::impl::GenericDict by_int(c10::IntType::get(), c10::TensorType::get());
    by_int.insert(int64_t{3}, at::full({2}, 3.0));
    dict.insert("by_int", by_int);
    if (variant % 2) dict.insert("pixel_values", at::arange(32, at::kFloat).view({4, 8}).t());
    return c10::IValue(dict);
}

}  // namespace spbcast_test
