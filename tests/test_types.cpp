// Every kind of value spbcast reflects, nested, rebuilt identically on every follower.
#include "support/roundtrip.hpp"

#include <boost/hana/adapt_struct.hpp>
#include <boost/hana/define_struct.hpp>

#include <array>
#include <deque>
#include <list>
#include <map>
#include <set>
#include <unordered_map>

using spbcast_test::roundtrip;

namespace user {

enum class Modality : uint8_t { text = 1, image = 2, video = 3 };

struct Span {  // a plain aggregate: reflected by Boost.PFR
    int32_t begin;
    int32_t end;
};

struct Sample {  // a Hana struct: named fields
    BOOST_HANA_DEFINE_STRUCT(Sample,
        (std::string, name),
        (Modality, modality),
        (std::vector<Span>, spans),
        (std::optional<at::Tensor>, pixels),
        (std::variant<int64_t, std::string, Span>, tag));
};

struct Adapted {  // an existing type adapted after the fact
    double score;
    std::map<std::string, std::vector<float>> extras;
};

// A type with private state and an invariant: taught through spbcast::codec.
class Grid {
public:
    Grid() = default;
    Grid(int64_t rows, int64_t cols) : rows_(rows), cols_(cols), cells_(at::arange(rows * cols).view({rows, cols})) {}
    int64_t rows() const { return rows_; }
    int64_t cols() const { return cols_; }
    const at::Tensor& cells() const { return cells_; }

private:
    int64_t rows_ = 0, cols_ = 0;
    at::Tensor cells_;
};

}  // namespace user

BOOST_HANA_ADAPT_STRUCT(user::Adapted, score, extras);

template <>
struct spbcast::codec<user::Grid> {
    static std::tuple<int64_t, int64_t, at::Tensor> to_wire(const user::Grid& g) {
        return {g.rows(), g.cols(), g.cells()};
    }
    static user::Grid from_wire(std::tuple<int64_t, int64_t, at::Tensor>&& w) {
        user::Grid g(std::get<0>(w), std::get<1>(w));
        CHECK(at::equal(g.cells(), std::get<2>(w)));  // the invariant holds on arrival
        return g;
    }
};

namespace {

struct Everything {  // PFR aggregate holding every standard kind
    bool flag;
    char c;
    int8_t i8;
    uint16_t u16;
    int64_t i64;
    uint64_t u64;
    float f32;
    double f64;
    user::Modality modality;
    std::string text;
    std::vector<int64_t> ints;
    std::vector<bool> bools;
    std::vector<std::string> strings;
    std::array<double, 3> triple;
    std::deque<int32_t> deque;
    std::list<std::string> list;
    std::set<int64_t> set;
    std::pair<std::string, at::Tensor> pair;
    std::tuple<int, std::optional<double>, std::vector<at::Tensor>> tuple;
    std::map<int64_t, std::string> int_map;
    std::unordered_map<std::string, at::Tensor> tensor_map;
    std::map<user::Modality, int> enum_map;
    std::optional<std::vector<user::Sample>> samples;
    std::optional<user::Sample> absent;
    user::Adapted adapted;
    user::Grid grid;
};

Everything make_everything() {
    Everything e{};
    e.flag = true;
    e.c = 'x';
    e.i8 = -7;
    e.u16 = 65535;
    e.i64 = std::numeric_limits<int64_t>::min();
    e.u64 = std::numeric_limits<uint64_t>::max();
    e.f32 = -0.0f;
    e.f64 = std::numeric_limits<double>::quiet_NaN();
    e.modality = user::Modality::video;
    e.text = std::string("with\0nul", 8);
    e.ints = {1, -2, 3};
    e.bools = {true, false, true};
    e.strings = {"", "a", std::string(10000, 'z')};
    e.triple = {1.5, -2.5, 1e300};
    e.deque = {4, 5};
    e.list = {"x", "y"};
    e.set = {3, 1, 2};
    e.pair = {"p", at::arange(5)};
    e.tuple = {7, std::nullopt, {at::ones({2, 2}), at::Tensor()}};
    e.int_map = {{-1, "minus"}, {10, "ten"}};
    e.tensor_map = {{"a", at::full({3}, 2.0)}, {"b", at::empty({0})}};
    e.enum_map = {{user::Modality::image, 2}};
    e.samples = std::vector<user::Sample>{
        {"first", user::Modality::image, {{0, 4}, {4, 9}}, at::linspace(0, 1, 6).view({2, 3}), int64_t{5}},
        {"second", user::Modality::text, {}, std::nullopt, std::string("tag")},
        {"third", user::Modality::video, {{1, 2}}, at::Tensor(), user::Span{3, 4}}};
    e.absent = std::nullopt;
    e.adapted = {0.25, {{"k", {1.f, 2.f}}, {"empty", {}}}};
    e.grid = user::Grid(3, 4);
    return e;
}

}  // namespace

TEST_CASE("every supported kind survives the trip, for every world size and root") {
    for (int world : {2, 3, 4})
        for (int root = 0; root < world; ++root) {
            CAPTURE(world);
            CAPTURE(root);
            roundtrip<Everything>(world, root, make_everything);
        }
}

TEST_CASE("followers' previous contents are replaced, empty containers and absent optionals included") {
    Everything stale = make_everything();
    stale.ints = {9, 9, 9, 9};
    stale.absent = user::Sample{"stale", user::Modality::text, {{1, 1}}, at::ones({1}), int64_t{1}};
    roundtrip<Everything>(2, 0, [] {
        Everything e{};
        e.grid = user::Grid(1, 1);
        return e;
    }, stale);
}

TEST_CASE("dynamic IValue batches, built like Python dicts") {
    auto make = [] {
        c10::impl::GenericDict dict(c10::StringType::get(), c10::AnyType::get());
        at::Tensor ids = at::arange(12).view({3, 4});
        dict.insert("input_ids", ids);
        dict.insert("alias", ids);
        dict.insert("view", ids.t());
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
        nested.push_back(c10::ivalue::Tuple::create({int64_t{1}, at::zeros({1})}));
        dict.insert("nested", nested);
        c10::impl::GenericDict by_int(c10::IntType::get(), c10::TensorType::get());
        by_int.insert(int64_t{3}, at::full({2}, 3.0));
        dict.insert("by_int", by_int);
        return std::vector<c10::IValue>{c10::IValue(dict), c10::IValue()};
    };
    for (int root : {0, 2}) roundtrip<std::vector<c10::IValue>>(3, root, make);
}

TEST_CASE("an IValue the wire cannot carry is refused on the root, by path, and reported on every rank") {
    auto errors = spbcast_test::run_ranks_collect(2, [](int rank, auto& group) {
        c10::IValue value;
        if (rank == 0) value = c10::IValue(c10::complex<double>(1.0, 2.0));
        spbcast::broadcast(value, group);
    });
    REQUIRE(errors[0]);
    REQUIRE(errors[1]);
    CHECK(spbcast_test::message_of(errors[0]).find("cannot send batch: an IValue of kind ComplexDouble") != std::string::npos);
    CHECK(spbcast_test::message_of(errors[1]).find("the root (rank 0) failed") != std::string::npos);
}

TEST_CASE("schemas are readable, canonical and stable") {
    CHECK(spbcast::schema_of<user::Sample> ==
          "user::Sample{name:str,modality:enum user::Modality:u8,spans:list<user::Span{i32,i32}>,"
          "pixels:optional<tensor>,tag:variant<i64|str|user::Span{i32,i32}>}");
    CHECK(spbcast::schema_of<user::Grid> == "user::Grid=tuple<i64,i64,tensor>");
    CHECK(spbcast::schema_of<std::vector<long>> == spbcast::schema_of<std::deque<int64_t>>);
    CHECK(spbcast::fingerprint_of<user::Sample> != spbcast::fingerprint_of<user::Adapted>);
    static_assert(spbcast::fingerprint_of<Everything> != 0, "computed at compile time");
}
