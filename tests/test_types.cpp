// Every kind of value spbcast reflects, nested, rebuilt identically on every follower.
#include "support/fixtures.hpp"
#include "support/roundtrip.hpp"

#include <boost/hana/adapt_struct.hpp>
#include <boost/hana/define_struct.hpp>

#include <array>
#include <cstring>
#include <deque>
#include <list>
#include <map>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include <spbcast/digest.hpp>

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
    auto make = [] { return std::vector<c10::IValue>{spbcast_test::representative_dict(), c10::IValue()}; };
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

// The kind of a type is the first, in priority order, whose traits match it; each kind's
// smallest stream size bounds the counts a follower accepts.
TEST_CASE("every type has one kind, the first in priority order whose traits match") {
    using spbcast::detail::kind;
    using spbcast::detail::kind_v;
    using spbcast::detail::min_wire_bytes;
    static_assert(kind_v<user::Grid> == kind::custom);  // a codec beats reflection
    static_assert(kind_v<at::Tensor> == kind::tensor);
    static_assert(kind_v<c10::IValue> == kind::ivalue);
    static_assert(kind_v<bool> == kind::boolean);  // before integers
    static_assert(kind_v<const char> == kind::integer);
    static_assert(kind_v<double> == kind::floating);
    static_assert(kind_v<user::Modality> == kind::enumeration);
    static_assert(kind_v<std::string> == kind::string);  // not a sequence of chars
    static_assert(kind_v<std::optional<int>> == kind::optional);
    static_assert(kind_v<std::variant<int, float>> == kind::variant);
    static_assert(kind_v<std::array<int, 2>> == kind::array);  // before tuple-likes
    static_assert(kind_v<std::unordered_map<std::string, int>> == kind::map);
    static_assert(kind_v<std::unordered_set<int>> == kind::set);
    static_assert(kind_v<std::list<int>> == kind::sequence);
    static_assert(kind_v<std::pair<int, std::string>> == kind::tuple);
    static_assert(kind_v<user::Sample> == kind::hana_struct);
    static_assert(kind_v<user::Adapted> == kind::hana_struct);
    static_assert(kind_v<Everything> == kind::aggregate);  // the last resort
    static_assert(kind_v<int*> == kind::unsupported);

    CHECK(min_wire_bytes<user::Grid>() == 8 + 8 + 4);
    CHECK(min_wire_bytes<std::tuple<bool, double, std::optional<int>>>() == 1 + 8 + 1);
    CHECK(min_wire_bytes<std::array<int16_t, 3>>() == 6);
    CHECK(min_wire_bytes<user::Span>() == 8);
    CHECK(min_wire_bytes<std::variant<std::string, double>>() == 4);
    CHECK(min_wire_bytes<std::map<std::string, std::vector<float>>>() == 8);
    CHECK(min_wire_bytes<c10::IValue>() == 1);
}

namespace user {

// docs/broadcast.md's Grid: no default constructor, rebuilt only through its constructor.
class FixedGrid {
public:
    FixedGrid(int64_t rows, int64_t cols) : rows_(rows), cols_(cols), cells_(at::arange(rows * cols).view({rows, cols})) {}
    int64_t rows() const { return rows_; }
    int64_t cols() const { return cols_; }
    const at::Tensor& cells() const { return cells_; }

private:
    int64_t rows_, cols_;
    at::Tensor cells_;
};

// A wire type without a default constructor: an aggregate holding a FixedGrid.
struct Labelled {
    std::string label;
    FixedGrid grid;
};

class Tile {
public:
    Tile(std::string label, FixedGrid grid) : wire_{std::move(label), std::move(grid)} {}
    const Labelled& wire() const { return wire_; }

private:
    Labelled wire_;
};

struct GridBatch {
    FixedGrid main;
    std::vector<FixedGrid> grids;
    std::optional<FixedGrid> maybe;
    std::map<std::string, FixedGrid> named;
    std::variant<int64_t, FixedGrid> either;
    Tile tile;
};

}  // namespace user

template <>
struct spbcast::codec<user::FixedGrid> {
    static std::pair<int64_t, int64_t> to_wire(const user::FixedGrid& g) { return {g.rows(), g.cols()}; }
    static user::FixedGrid from_wire(std::pair<int64_t, int64_t>&& w) { return user::FixedGrid(w.first, w.second); }
};

template <>
struct spbcast::codec<user::Tile> {
    static user::Labelled to_wire(const user::Tile& t) { return t.wire(); }
    static user::Tile from_wire(user::Labelled&& w) { return user::Tile(std::move(w.label), std::move(w.grid)); }
};

TEST_CASE("types without a default constructor travel through their codecs, as fields and elements") {
    static_assert(!std::is_default_constructible_v<user::GridBatch>);
    auto make = [] {
        return user::GridBatch{user::FixedGrid(2, 3),
                               {user::FixedGrid(1, 1), user::FixedGrid(4, 2)},
                               user::FixedGrid(5, 1),
                               {{"a", user::FixedGrid(2, 2)}},
                               user::FixedGrid(3, 3),
                               user::Tile("t", user::FixedGrid(6, 1))};
    };
    spbcast_test::run_ranks(3, [&](int rank, auto& group) {
        user::GridBatch batch = rank == 1 ? make() : user::GridBatch{user::FixedGrid(0, 0), {}, std::nullopt, {}, int64_t{0},
                                                                      user::Tile("", user::FixedGrid(0, 0))};
        spbcast::broadcast(batch, group, {.root = 1});
        CHECK(spbcast::digest(batch) == spbcast::digest(make()));
        CHECK(batch.grids.size() == 2);
        CHECK(batch.grids[1].rows() == 4);
        REQUIRE(batch.maybe.has_value());
        CHECK(batch.maybe->cells().equal(at::arange(5).view({5, 1})));
        CHECK(batch.named.at("a").cols() == 2);
        CHECK(std::get<user::FixedGrid>(batch.either).rows() == 3);
        CHECK(batch.tile.wire().label == "t");
        CHECK(batch.tile.wire().grid.rows() == 6);
    });
}

TEST_CASE("unordered containers iterate in the root's order on every rank") {
    using Map = std::unordered_map<std::string, at::Tensor>;
    auto make = [] {
        Map m;
        for (const char* key : {"input_ids", "labels", "position_ids", "pixel_values", "image_grid_thw",
                                "cu_seq_lens", "attention_mask"})
            m.emplace(key, at::full({2}, static_cast<int64_t>(std::strlen(key))));
        m.erase("labels");  // a history of its own: the order depends on more than the keys
        m.emplace("labels", at::arange(3));
        std::unordered_set<int64_t> ids{42, 7, 1000003, 3, 19, 77, 5};
        return std::pair<Map, std::unordered_set<int64_t>>{std::move(m), std::move(ids)};
    };
    auto order = [](const auto& container) {
        std::vector<std::string> keys;
        for (const auto& element : container) {
            if constexpr (requires { element.first; }) keys.push_back(element.first);
            else keys.push_back(std::to_string(element));
        }
        return keys;
    };
    const auto expected = make();
    spbcast_test::run_ranks(3, [&](int rank, auto& group) {
        auto batch = rank == 0 ? make() : std::pair<Map, std::unordered_set<int64_t>>{};
        spbcast::broadcast(batch, group);
        CHECK(order(batch.first) == order(expected.first));
        CHECK(order(batch.second) == order(expected.second));
        CHECK(spbcast::digest(batch) == spbcast::digest(expected));
    });
}

TEST_CASE("IValue lists, dicts, tuples and optionals keep their static types") {
    auto make = [] {
        c10::Dict<std::string, c10::List<int64_t>> lengths;
        lengths.insert("image", c10::List<int64_t>({4, 8}));
        lengths.insert("video", c10::List<int64_t>());
        c10::List<c10::optional<at::Tensor>> maybe_tensors;
        maybe_tensors.push_back(at::ones({2}));
        maybe_tensors.push_back(c10::nullopt);
        c10::impl::GenericList nested(c10::ListType::create(c10::TupleType::create({c10::IntType::get(), c10::StringType::get()})));
        nested.push_back(c10::IValue(c10::List<c10::IValue>(c10::TupleType::create({c10::IntType::get(), c10::StringType::get()}))));
        return c10::IValue(c10::ivalue::Tuple::create({c10::IValue(lengths), c10::IValue(maybe_tensors), c10::IValue(nested)}));
    };
    const c10::IValue expected = make();
    spbcast_test::run_ranks(2, [&](int rank, auto& group) {
        c10::IValue value = rank == 0 ? make() : c10::IValue();
        spbcast::broadcast(value, group);
        const auto& elements = value.toTupleRef().elements();
        const auto& want = expected.toTupleRef().elements();
        REQUIRE(elements.size() == 3);
        for (std::size_t i = 0; i < 3; ++i) {
            CAPTURE(i);
            CHECK(elements[i].type()->annotation_str() == want[i].type()->annotation_str());
            const bool same_type = *elements[i].type() == *want[i].type();
            CHECK(same_type);
        }
        const auto lengths = elements[0].to<c10::Dict<std::string, c10::List<int64_t>>>();
        CHECK(lengths.at("image").vec() == std::vector<int64_t>{4, 8});
        const auto maybe = elements[1].to<c10::List<c10::optional<at::Tensor>>>();
        CHECK_FALSE(maybe.get(1).has_value());
        CHECK(spbcast::digest(value) == spbcast::digest(expected));
    });
}
