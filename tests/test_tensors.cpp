// Tensors arrive exact: every dtype bit for bit, every shape and stride case, aliases and
// shared storages (checked through writes), flags; and the wire carries no more than it must.
#include "support/counting_group.hpp"
#include "support/roundtrip.hpp"

#include <spbcast/detail/wire/dtype.hpp>

using namespace spbcast_test;

namespace {

std::vector<c10::ScalarType> all_dtypes() {
    std::vector<c10::ScalarType> types;
#define SPBCAST_LIST(code, name) types.push_back(c10::ScalarType::name);
    SPBCAST_DTYPES(SPBCAST_LIST)
#undef SPBCAST_LIST
    return types;
}

// Random bits reinterpreted as the dtype: NaNs with payloads, -0.0, denormals and infinities
// all occur. Bool gets 0/1 bytes, the only valid ones.
at::Tensor random_bits(c10::ScalarType dtype, std::vector<int64_t> sizes, uint64_t seed) {
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    const auto itemsize = static_cast<int64_t>(c10::elementSize(dtype));
    int64_t numel = 1;
    for (auto s : sizes) numel *= s;
    at::Tensor bytes = at::randint(0, dtype == at::kBool ? 2 : 256, {numel * itemsize}, gen,
                                   at::TensorOptions().dtype(at::kByte));
    at::Tensor t = at::empty(sizes, at::TensorOptions().dtype(dtype));
    std::memcpy(t.data_ptr(), bytes.data_ptr(), numel * itemsize);
    return t;
}

struct TensorCases {
    std::vector<at::Tensor> dtypes;   // one per dtype, plus a non-contiguous view of each
    at::Tensor scalar, empty, rank7, transposed, expanded, stepped, narrowed, undefined;
    at::Tensor leaf_grad, conj_view, neg_view;
    at::Tensor alias_a, alias_b;      // the same tensor object twice
    at::Tensor view_a, view_b;        // overlapping views of one storage
    at::Tensor other_dtype_view;      // a view with another dtype over view_a's storage
};

TensorCases make_cases() {
    TensorCases c;
    uint64_t seed = 1;
    for (auto dtype : all_dtypes()) {
        at::Tensor t = random_bits(dtype, {4, 6}, seed++);
        c.dtypes.push_back(t);
        c.dtypes.push_back(t.t());
    }
    c.scalar = at::scalar_tensor(-0.0, at::kDouble);
    c.empty = at::empty({0, 3}, at::kFloat);
    c.rank7 = random_bits(at::kFloat, {2, 1, 3, 1, 2, 2, 3}, seed++);
    c.transposed = random_bits(at::kLong, {5, 7}, seed++).t();
    c.expanded = at::arange(4, at::kLong).view({1, 1, 4}).expand({3, 2, 4});
    c.stepped = random_bits(at::kShort, {100}, seed++).slice(0, 3, 90, 7);
    c.narrowed = random_bits(at::kFloat, {8, 8}, seed++).narrow(1, 2, 3);
    c.leaf_grad = random_bits(at::kFloat, {3}, seed++).abs_().set_requires_grad(true);
    c.conj_view = random_bits(at::kComplexFloat, {4}, seed++).conj();
    c.neg_view = at::_neg_view(at::arange(6, at::kDouble));
    c.alias_a = random_bits(at::kInt, {9}, seed++);
    c.alias_b = c.alias_a;
    at::Tensor base = random_bits(at::kFloat, {16}, seed++);
    c.view_a = base.narrow(0, 2, 8);
    c.view_b = base.narrow(0, 6, 8).view({2, 4});
    c.other_dtype_view = base.narrow(0, 4, 4).view(at::kInt);
    return c;
}

}  // namespace



TEST_CASE("every dtype and every shape case arrives bit-exact with its strides and flags") {
    MESSAGE("dtypes with wire codes in this LibTorch: " << all_dtypes().size());
    for (int world : {2, 4})
        for (int root : {0, world - 1}) roundtrip<TensorCases>(world, root, make_cases);
}

TEST_CASE("aliases and shared storages behave on followers as on the root, through writes") {
    run_ranks(3, [](int rank, auto& group) {
        TensorCases cases = rank == 1 ? make_cases() : TensorCases{};
        spbcast::broadcast(cases, group, {.root = 1});
        CHECK(cases.alias_a.is_same(cases.alias_b));
        cases.alias_a.fill_(7);
        CHECK(cases.alias_b.eq(7).all().item<bool>());
        // view_a covers elements 2..9 of the base, view_b 6..13: they overlap in 6..9.
        cases.view_a.fill_(1.5f);
        CHECK(cases.view_b.view(-1).narrow(0, 0, 4).eq(1.5f).all().item<bool>());
        CHECK_FALSE(cases.view_b.view(-1).narrow(0, 4, 4).eq(1.5f).all().item<bool>());
        CHECK(cases.other_dtype_view.storage().is_alias_of(cases.view_a.storage()));
        CHECK(cases.expanded.stride(0) == 0);
        CHECK(cases.expanded.stride(1) == 0);
    });
}

TEST_CASE("the wire carries each storage's touched span or its views' elements, whichever is smaller") {
    struct Sparse {
        at::Tensor every_thousandth;  // 1000 elements of an 8 MB storage
        at::Tensor expanded;          // 4 KiB expanded 256 times
        at::Tensor big;               // 4 MiB, sent in place
    };
    auto make = [] {
        at::Tensor base = at::arange(1000000, at::kLong);
        return Sparse{base.slice(0, 0, 1000000, 1000), at::arange(512, at::kLong).expand({256, 512}),
                      at::ones({1 << 20}, at::kFloat)};
    };
    run_ranks(2, [&](int rank, auto& group) {
        counting_group counted{group};
        Sparse value = rank == 0 ? make() : Sparse{};
        spbcast::broadcast(value, counted);
        const uint64_t frame = spbcast::detail::inline_frame_bytes;
        const uint64_t contiguous = 1000 * 8 + 512 * 8 + (4u << 20);
        const uint64_t tables = 1024, trailer = spbcast::detail::trailer_bytes(1, 0);
        CHECK(counted.bytes <= frame + contiguous + tables + trailer);
        // the frame, the rest of its body (the two small storages ride in it), the large
        // storage in place, the status trailer
        CHECK(counted.collectives == 4);
        if (rank == 1) {
            require_identical(make(), value);
            CHECK(value.every_thousandth.stride(0) == 1000);
        }
    });
}

TEST_CASE("a small batch costs one collective: its payload rides in the frame") {
    run_ranks(2, [](int rank, auto& group) {
        counting_group counted{group};
        std::vector<at::Tensor> value;
        if (rank == 0) value = {at::ones({100}), at::zeros({3, 3}, at::kInt)};
        spbcast::broadcast(value, counted);
        CHECK(counted.collectives == 1);
        if (rank == 1) require_identical(std::vector<at::Tensor>{at::ones({100}), at::zeros({3, 3}, at::kInt)}, value);
    });
}

TEST_CASE("any c10d group form: a reference, an intrusive_ptr, a ProcessGroup wrapper") {
    run_ranks(2, [](int rank, auto& gloo) {
        std::vector<at::Tensor> value;
        auto make = [] { return std::vector<at::Tensor>{at::arange(10)}; };
        if (rank == 0) value = make();
        c10::intrusive_ptr<c10d::ProcessGroupGloo> pointer =
            c10::intrusive_ptr<c10d::ProcessGroupGloo>::reclaim_copy(&gloo);
        spbcast::broadcast(value, pointer);
        require_identical(make(), value);
#if SPBCAST_TORCH_AT_LEAST(2, 0)
        // LibTorch 2.x: the ProcessGroup front end dispatching to a Gloo Backend.
        auto wrapper = c10::make_intrusive<c10d::ProcessGroup>(gloo.getRank(), gloo.getSize());
        wrapper->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO,
                            c10::intrusive_ptr<c10d::Backend>::reclaim_copy(&gloo));
        wrapper->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
        value = rank == 0 ? make() : std::vector<at::Tensor>{};
        spbcast::broadcast(value, wrapper);
        require_identical(make(), value);
#endif
    });
}
